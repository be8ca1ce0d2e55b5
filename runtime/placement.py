"""Where the workers of a layout live, and the stage table that turns a scheduler action into their tasks.

``STAGES`` holds one entry per stage (``StageSpec``), in pipeline order: its ranks in the layout, its cache init,
its chunk task, and the edge its chunk's result leaves on (``EdgeSpec``: the tensor-plane group, the thread that
moves it, who receives it and whether the receipt is part of the chunk's completion). Everything stage-shaped is
derived from it: the tasks of each action (``plan``), the join keys and which completion belongs to which join
(``key_of``, ``join_of``), the worker threads of each rank (``Placement.threads_on``, the launcher's wiring) and
the tensor-plane groups (``group_members``, ``ipc.tensor_plane``). The scheduler's per-stage rules (which chunk a
stage takes next, where its result goes) are its own table (``runtime.scheduler._RULES``).

Every worker thread of the job has a ZeroMQ identity ``"<rank>:<role>"``. The roles are the stages
(``condition``, ``denoise``, ``decode``), the transfer threads of the edges (``condition_edge`` on every member of
the condition group, ``latent_receiver`` on a decode rank that is not the DiT leader, ``frames`` on the coordinator
rank when decode lives elsewhere) and the ``heartbeat`` thread of every rank but the coordinator's.

``plan(action, ...)`` gives, for each action, the tasks to send (in order) and the completions that together finish
it (the join), plus the tasks to send once it is finished. On the default table:

| action               | tasks, in order                                     | finished by             | then        |
|----------------------|-----------------------------------------------------|-------------------------|-------------|
| InitCache(condition) | InitCondition -> condition                          | its InitDone            |             |
| InitCache(decode)    | InitDecode -> decode                                | its InitDone            |             |
| InitCache(denoise)   | BroadcastContext -> every condition_edge,           | every DiT rank's        |             |
|                      | InitDenoise -> every DiT rank                       | InitDone                |             |
| RunChunk(condition)  | ConditionChunk -> condition                         | its ChunkDone           | Broadcast-  |
|                      |                                                     |                         | Condition   |
|                      |                                                     |                         | -> edges    |
| RunChunk(denoise)    | ReceiveLatent -> latent_receiver (if any),          | the leader's ChunkDone  |             |
|                      | DenoiseChunk -> every DiT rank                      |                         |             |
| RunChunk(decode)     | ReceiveFrames -> frames (if any), DecodeChunk ->    | its ChunkDone and the   |             |
|                      | decode                                              | frames' TransferDone    |             |
| Release(stage)       | Release -> every rank of the stage                  | every such ReleaseDone  |             |
| NewPrompt(r)         | EncodePrompt -> condition                           | its ChunkDone           | Broadcast-  |
|                      |                                                     |                         | Context     |
|                      |                                                     |                         | -> edges    |

The general rules behind the rows: a chunk goes to every rank of its stage and is finished by its leader's
``ChunkDone`` (the first rank; the DiT ranks other than the leader answer too, their spans reach the timeline, but
only the leader, who sends the latent, moves the schedule), plus the receiver's ``TransferDone`` where its edge
``answers``. A point-to-point edge's receive is announced before the sender's task (none where sender and
receiver share a rank: a local hand-off); a broadcast edge is posted by every member's edge thread once the chunk
is finished, so the condition moves as soon as it is encoded (overlapping the DiT's current chunk). A stage whose
init takes the ``context`` gets the session's prompt context over its input edge first.

A ``NewPrompt`` (``set_prompt``, ``runtime.prompts``) is not a scheduler action: rank 0 plans it itself, and its
chunk-phase completion travels under the negative index ``context_index(r)``, which no chunk has.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from ipc import protocol
from ipc.protocol import Edge, Phase, Stage, TensorSpec
from runtime.config import LayoutConfig
from runtime.scheduler_types import InitCache, Release, RunChunk

if TYPE_CHECKING:
    from models.geometry import StreamGeometry

CONDITION_EDGE = "condition_edge"
LATENT_RECEIVER = "latent_receiver"
FRAMES_RECEIVER = "frames"
HEARTBEAT = "heartbeat"


@dataclass(frozen=True)
class NewPrompt:
    """Encode revision ``revision`` of a session's prompt, then move its context to every DiT rank."""

    session: str
    revision: int
    prompt: str

    stage = Stage.CONDITION  # the stage that encodes it (its join is a chunk of that stage)

    @property
    def index(self) -> int:
        return protocol.context_index(self.revision)


StageAction = InitCache | RunChunk | Release | NewPrompt
Part = tuple[Phase, int]  # one completion a join waits for: its phase and the rank that sends it
JoinKey = tuple[Stage, Phase, int]  # a stage's init, chunk (its index) or release (index -1)


def identity(rank: int, role: str) -> bytes:
    return f"{rank}:{role}".encode()


@dataclass(frozen=True)
class SessionFacts:
    """What the table needs to know of a session."""

    id: str
    seed: int
    prompt: str
    geometry: StreamGeometry  # the backend's geometry at the session's frame size
    image: bytes = b""  # raw uint8 RGB start image (only for the condition stage's init)
    image_height: int = 0
    image_width: int = 0
    intrinsics: tuple[float, float, float, float] | None = None  # the session's camera at 480x832 (the DiT's init)
    prompt_revision: int = 0  # the prompt revision a denoise dispatched now uses (``runtime.prompts``)
    restore: str = ""  # the snapshot every stage's init loads its state from ("" : a fresh session)


@dataclass(frozen=True)
class EdgeSpec:
    """The tensor-plane edge a stage's chunk result leaves on, sent by the stage's leader."""

    edge: Edge
    role: str  # the thread that runs its transfer tasks on a rank
    task: Callable[..., protocol.WorkerTask]  # the transfer task that announces one chunk's tensor on it
    to: Stage | None  # the stage that takes the result (None: the coordinator, which emits it)
    # True: to every rank of ``to``, posted by every member's edge thread (the sender's too) once the chunk is
    # finished; False: to the leader of ``to``, whose receive is announced before the chunk's task
    broadcast: bool
    answers: bool  # the receiver's TransferDone is part of the chunk's join (else the sender's ChunkDone says it)
    tensor: Callable[[StreamGeometry, int], TensorSpec]  # what moves for chunk ``index``


Chunk = Callable[[SessionFacts, int, protocol.ChunkControl | None, int | None], protocol.WorkerTask]


@dataclass(frozen=True)
class StageSpec:
    """One stage of the pipeline: where it runs, its tasks, and where its result goes."""

    stage: Stage
    ranks: Callable[[LayoutConfig], tuple[int, ...]]  # its ranks in the layout, the leader first
    init: Callable[[SessionFacts], protocol.WorkerTask]  # the cache init every rank of it runs
    chunk_task: type  # the type of its chunk task
    chunk: Chunk  # its chunk task for (session, index, the accepted control, the steps)
    out: EdgeSpec
    group: str | None = None  # the name of a process group of its own ranks (the DiT's Ulysses group)
    context: bool = False  # its init first takes the session's prompt context over its input edge
    controlled: bool = False  # its chunk takes a client's control, steps and prompt revision (fixed at dispatch)
    image: bool = False  # its init takes the session's start image (rank 0 drops its copy once it is sent)
    # the items of a session's cost (``models.memory.session_items``) its stage object holds and counts itself
    # (``session_nbytes``): what a rank checks the memory model against; the rest is in its edges' mailboxes
    memory_items: tuple[str, ...] = ()

    @property
    def role(self) -> str:
        return self.stage.value


def _dtype(geometry: StreamGeometry) -> str:
    return geometry.dtype  # a torch dtype's name already (``models.geometry``)


def _context(g: StreamGeometry) -> TensorSpec:
    return TensorSpec(shape=g.context_shape, dtype=_dtype(g))


def _latent(g: StreamGeometry, index: int) -> TensorSpec:
    return TensorSpec(shape=g.latent_shape, dtype=_dtype(g))


def _frames(g: StreamGeometry, index: int) -> TensorSpec:
    return TensorSpec(shape=g.frames_shape(index), dtype="uint8")


def _init_condition(s: SessionFacts) -> protocol.WorkerTask:
    g = s.geometry
    return protocol.InitCondition(session=s.id, seed=s.seed, prompt=s.prompt, image=s.image,
                                  image_height=s.image_height, image_width=s.image_width, height=g.height,
                                  width=g.width, restore=s.restore)


def _init_denoise(s: SessionFacts) -> protocol.WorkerTask:
    g = s.geometry
    return protocol.InitDenoise(session=s.id, seed=s.seed, prompt=s.prompt, height=g.height, width=g.width,
                                intrinsics=s.intrinsics, restore=s.restore, prompt_revision=s.prompt_revision)


def _init_decode(s: SessionFacts) -> protocol.WorkerTask:
    g = s.geometry
    return protocol.InitDecode(session=s.id, height=g.height, width=g.width, restore=s.restore)


def _condition_chunk(s: SessionFacts, index: int, _control: protocol.ChunkControl | None,
                     _steps: int | None) -> protocol.WorkerTask:
    return protocol.ConditionChunk(session=s.id, index=index)


def _denoise_chunk(s: SessionFacts, index: int, control: protocol.ChunkControl | None,
                   steps: int | None) -> protocol.WorkerTask:
    assert control is not None, "a denoise runs with its accepted control"
    return protocol.DenoiseChunk(session=s.id, index=index, control=control, latent=_latent(s.geometry, index),
                                 steps=steps, prompt_revision=s.prompt_revision)


def _decode_chunk(s: SessionFacts, index: int, _control: protocol.ChunkControl | None,
                  _steps: int | None) -> protocol.WorkerTask:
    return protocol.DecodeChunk(session=s.id, index=index, frames=_frames(s.geometry, index))


STAGES: Final[Mapping[Stage, StageSpec]] = {  # in pipeline order (``Stage``'s)
    Stage.CONDITION: StageSpec(
        Stage.CONDITION, ranks=lambda lay: (lay.condition,), init=_init_condition,
        chunk_task=protocol.ConditionChunk, chunk=_condition_chunk,
        out=EdgeSpec(Edge.CONDITION, CONDITION_EDGE, protocol.BroadcastCondition, to=Stage.DENOISE, broadcast=True,
                     answers=False, tensor=lambda g, _index: TensorSpec(shape=g.condition_shape, dtype=_dtype(g))),
        image=True, memory_items=("encode_cache", "encode_snapshot")),
    Stage.DENOISE: StageSpec(
        Stage.DENOISE, ranks=lambda lay: tuple(lay.dit), init=_init_denoise,
        chunk_task=protocol.DenoiseChunk, chunk=_denoise_chunk,
        out=EdgeSpec(Edge.LATENT, LATENT_RECEIVER, protocol.ReceiveLatent, to=Stage.DECODE, broadcast=False,
                     answers=False, tensor=_latent),
        group="dit", context=True, controlled=True, memory_items=("kv_cache", "text_cache")),
    Stage.DECODE: StageSpec(
        Stage.DECODE, ranks=lambda lay: (lay.decode,), init=_init_decode,
        chunk_task=protocol.DecodeChunk, chunk=_decode_chunk,
        out=EdgeSpec(Edge.FRAMES, FRAMES_RECEIVER, protocol.ReceiveFrames, to=None, broadcast=False, answers=True,
                     tensor=_frames), memory_items=("decode_cache",)),
}
assert tuple(STAGES) == tuple(Stage), "the table lists every stage, in pipeline order"


@dataclass(frozen=True)
class Placement:
    """ZeroMQ identities of every worker thread of the job, derived from the layout and the stage table."""

    ranks: Mapping[Stage, tuple[int, ...]] = field(hash=False)  # each stage's ranks, the leader first
    coordinator: int
    world_size: int

    def ranks_of(self, stage: Stage) -> tuple[int, ...]:
        return self.ranks[stage]

    def leader(self, stage: Stage) -> int:
        return self.ranks[stage][0]

    def workers_of(self, stage: Stage) -> tuple[bytes, ...]:
        return tuple(identity(r, STAGES[stage].role) for r in self.ranks_of(stage))

    @property
    def heartbeat_ranks(self) -> tuple[int, ...]:
        return tuple(r for r in range(self.world_size) if r != self.coordinator)

    def receivers(self, stage: Stage) -> tuple[int, ...]:
        """The ranks the result of ``stage`` goes to along its out edge."""
        out = STAGES[stage].out
        if out.to is None:
            return (self.coordinator,)
        return self.ranks_of(out.to) if out.broadcast else (self.leader(out.to),)

    def members(self, stage: Stage) -> tuple[int, ...]:
        """The ranks of the out edge of ``stage`` (its sender and receivers), in rank order."""
        return tuple(sorted({self.leader(stage), *self.receivers(stage)}))

    def edge_ranks(self, stage: Stage) -> tuple[int, ...]:
        """The ranks that run a transfer thread of the out edge of ``stage``: every member of a broadcast; the
        receivers that are not the sender otherwise (a receiver on the sender's rank is a local hand-off)."""
        if STAGES[stage].out.broadcast:
            return self.members(stage)
        return tuple(r for r in self.receivers(stage) if r != self.leader(stage))

    def edge_threads(self, stage: Stage) -> tuple[bytes, ...]:
        return tuple(identity(r, STAGES[stage].out.role) for r in self.edge_ranks(stage))

    def threads_on(self, rank: int) -> tuple[str, ...]:
        """The roles of the worker threads of ``rank``, in the order they start: per stage in pipeline order, the
        stage's worker, then the transfer thread of its out edge; the heartbeat last."""
        roles = []
        for stage, spec in STAGES.items():
            if rank in self.ranks_of(stage):
                roles.append(spec.role)
            if rank in self.edge_ranks(stage):
                roles.append(spec.out.role)
        if rank != self.coordinator:
            roles.append(HEARTBEAT)
        return tuple(roles)

    @property
    def all(self) -> tuple[bytes, ...]:
        """Every worker thread that reports in at start-up (and acknowledges shutdown)."""
        return tuple(identity(rank, role) for rank in range(self.world_size) for role in self.threads_on(rank))


def placement_of(layout: LayoutConfig) -> Placement:
    return Placement(ranks={stage: spec.ranks(layout) for stage, spec in STAGES.items()},
                     coordinator=layout.coordinator, world_size=layout.world_size)


def group_members(layout: LayoutConfig) -> list[tuple[str, list[int], bool]]:
    """The tensor-plane groups in their fixed creation order, with their ranks and whether it is a stage's own
    group: each stage's own group (``group``), then each stage's out edge (named after its ``Edge``), in pipeline
    order."""
    where = placement_of(layout)
    own = [(spec.group, sorted(where.ranks_of(stage)), True) for stage, spec in STAGES.items()
           if spec.group is not None]
    edges = [(spec.out.edge.value, list(where.members(stage)), False) for stage, spec in STAGES.items()]
    return own + edges


@dataclass(frozen=True)
class Plan:
    """What one scheduler action takes on this layout (see the module table)."""

    sends: tuple[tuple[bytes, protocol.WorkerTask], ...]
    waits: frozenset[Part]  # the completions that finish the action
    then: tuple[tuple[bytes, protocol.WorkerTask], ...] = field(default=())  # sent once it is finished


def plan(action: StageAction, session: SessionFacts, where: Placement,
         control: protocol.ChunkControl | None = None, steps: int | None = None) -> Plan:
    """The tasks of ``action`` for ``session`` on this layout (``control``: the accepted control of a ``controlled``
    stage's chunk; ``steps``: the denoising steps it runs, None: the preset's all)."""
    sid, g = session.id, session.geometry
    match action:
        case InitCache(stage=stage):
            init = STAGES[stage].init(session)
            context = ()
            if STAGES[stage].context:  # the prompt context, over the stage's input edge (the open's: index -1)
                source = _input_of(stage)
                moved = protocol.BroadcastContext(session=sid, index=-1, tensor=_context(g))
                context = tuple((edge, moved) for edge in where.edge_threads(source))
            return Plan((*context, *((w, init) for w in where.workers_of(stage))),
                        frozenset((Phase.INIT, r) for r in where.ranks_of(stage)))
        case RunChunk(stage=stage, index=index):
            spec = STAGES[stage]
            task = spec.chunk(session, index, control, steps)
            out = spec.out
            moved = out.task(session=sid, index=index, tensor=out.tensor(g, index))
            edge = tuple((e, moved) for e in where.edge_threads(stage))
            tasks = tuple((w, task) for w in where.workers_of(stage))
            waits = {(Phase.CHUNK, where.leader(stage))}
            if out.answers:
                waits |= {(Phase.TRANSFER, r) for r in where.edge_ranks(stage)}
            if out.broadcast:  # moved by the edge threads once the result exists
                return Plan(tasks, frozenset(waits), then=edge)
            return Plan((*edge, *tasks), frozenset(waits))  # receivers are announced before the sender's task
        case NewPrompt(index=index, prompt=prompt):
            moved = protocol.BroadcastContext(session=sid, index=index, tensor=_context(g))
            return Plan(((where.workers_of(action.stage)[0], protocol.EncodePrompt(session=sid, index=index,
                                                                                    prompt=prompt)),),
                        frozenset({(Phase.CHUNK, where.leader(action.stage))}),
                        then=tuple((edge, moved) for edge in where.edge_threads(action.stage)))
        case Release(stage=stage):
            release = protocol.Release(session=sid)
            return Plan(tuple((w, release) for w in where.workers_of(stage)),
                        frozenset((Phase.RELEASE, r) for r in where.ranks_of(stage)))
    raise AssertionError(f"no tasks for {action}")


def _input_of(stage: Stage) -> Stage:
    """The stage whose out edge feeds ``stage``."""
    return next(source for source, spec in STAGES.items() if spec.out.to is stage)


# the edge a session's prompt context travels over: the input edge of the stage whose init takes it
CONTEXT_CARRIER: Final = next(STAGES[_input_of(stage)].out.edge for stage, spec in STAGES.items() if spec.context)


def key_of(action: StageAction) -> JoinKey:
    """The join an action starts: the stage's init, release, or chunk (a new prompt's under its negative index)."""
    match action:
        case InitCache(stage=stage):
            return stage, Phase.INIT, -1
        case Release(stage=stage):
            return stage, Phase.RELEASE, -1
        case RunChunk(stage=stage, index=index):
            return stage, Phase.CHUNK, index
    return action.stage, Phase.CHUNK, action.index


_ANSWERED: Final = {spec.out.edge: stage for stage, spec in STAGES.items() if spec.out.answers}


def join_of(done: protocol.Completion) -> tuple[JoinKey | None, Part]:
    """The join a completion belongs to (None: none waits for it) and the part of it that it is."""
    match done:
        case protocol.InitDone(stage=stage):
            return (stage, Phase.INIT, -1), (Phase.INIT, done.rank)
        case protocol.ReleaseDone(stage=stage):
            return (stage, Phase.RELEASE, -1), (Phase.RELEASE, done.rank)
        case protocol.ChunkDone(stage=stage, index=index):
            return (stage, Phase.CHUNK, index), (Phase.CHUNK, done.rank)
        case protocol.TransferDone(edge=edge, index=index) if edge in _ANSWERED:  # a receipt that ends a chunk
            return (_ANSWERED[edge], Phase.CHUNK, index), (Phase.TRANSFER, done.rank)
    return None, (Phase.TRANSFER, done.rank)


_CHUNK_TASKS: Final = {spec.chunk_task: stage for stage, spec in STAGES.items()}


def step_of(task: protocol.WorkerTask) -> Stage | Edge | None:
    """What a task of one chunk works on (a stage or an edge), for the queue time of its spans; None for the
    session-wide tasks (inits, releases, the prompt context), whose spans stay off the chunk timeline."""
    if isinstance(task, protocol.BroadcastContext):
        return None
    edge = getattr(type(task), "edge", None)
    return edge if edge is not None else _CHUNK_TASKS.get(type(task))
