"""Where the workers of a layout live, and the one table that turns a scheduler action into their tasks.

Every worker thread of the job has a ZeroMQ identity ``"<rank>:<role>"``. The roles are the stages
(``condition``, ``denoise``, ``decode``), the transfer threads (``condition_edge`` on every member of the condition
group, ``latent_receiver`` on a decode rank that is not the DiT leader, ``frames`` on the coordinator rank when
decode lives elsewhere) and the ``heartbeat`` thread of every rank but the coordinator's.

``plan(action, ...)`` is the table: for each scheduler action, the tasks to send (in order) and the completions
that together finish it (the join), plus the tasks to send once it is finished:

| action               | tasks, in order                                     | finished by             | then        |
|----------------------|-----------------------------------------------------|-------------------------|-------------|
| InitCache(condition) | InitCondition -> condition                          | its InitDone            |             |
| InitCache(decode)    | InitDecode -> decode                                | its InitDone            |             |
| InitCache(denoise)   | BroadcastContext -> every condition_edge,           | every DiT rank's        |             |
|                      | InitDenoise -> every DiT rank                       | InitDone                |             |
| RunCondition(i)      | ConditionChunk -> condition                         | its ChunkDone           | Broadcast-  |
|                      |                                                     |                         | Condition   |
|                      |                                                     |                         | -> edges    |
| RunDenoise(i)        | ReceiveLatent -> latent_receiver (if any),          | the leader's ChunkDone  |             |
|                      | DenoiseChunk -> every DiT rank                      |                         |             |
| RunDecode(i)         | ReceiveFrames -> frames (if any), DecodeChunk ->    | its ChunkDone and the   |             |
|                      | decode                                              | frames' TransferDone    |             |
| Release(stage)       | Release -> every rank of the stage                  | every such ReleaseDone  |             |
| NewPrompt(r)         | EncodePrompt -> condition                           | its ChunkDone           | Broadcast-  |
|                      |                                                     |                         | Context     |
|                      |                                                     |                         | -> edges    |

A ``NewPrompt`` (``set_prompt``, ``runtime.prompts``) is not a scheduler action: rank 0 plans it itself, and its
chunk-phase completion travels under the negative index ``context_index(r)``, which no chunk has. Receivers are
announced before the sender's task, and the condition moves as soon as it is encoded (overlapping
the DiT's current chunk). The DiT ranks other than the leader answer their chunks too: their spans reach the
timeline, but only the leader (who sends the latent) moves the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ipc import protocol
from ipc.protocol import Phase, Stage, TensorSpec
from runtime.config import LayoutConfig
from runtime.scheduler_types import InitCache, Release, RunCondition, RunDecode, RunDenoise

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

    @property
    def index(self) -> int:
        return protocol.context_index(self.revision)


StageAction = InitCache | RunCondition | RunDenoise | RunDecode | Release | NewPrompt
Part = tuple[Phase, int]  # one completion a join waits for: its phase and the rank that sends it


def identity(rank: int, role: str) -> bytes:
    return f"{rank}:{role}".encode()


@dataclass(frozen=True)
class Placement:
    """ZeroMQ identities of every worker thread of the job, derived from the layout."""

    condition: int  # rank of each stage
    decode: int
    denoise: tuple[int, ...]  # the DiT group, leader first
    coordinator: int
    world_size: int

    @property
    def dit_leader(self) -> int:
        return self.denoise[0]

    @property
    def condition_edges(self) -> tuple[bytes, ...]:
        """Every member of the condition group (the condition rank and the DiT ranks), in rank order."""
        return tuple(identity(r, CONDITION_EDGE) for r in sorted({self.condition, *self.denoise}))

    @property
    def latent_receiver(self) -> bytes | None:
        return None if self.decode == self.dit_leader else identity(self.decode, LATENT_RECEIVER)

    @property
    def frames_receiver(self) -> bytes | None:
        return None if self.decode == self.coordinator else identity(self.coordinator, FRAMES_RECEIVER)

    @property
    def heartbeat_ranks(self) -> tuple[int, ...]:
        return tuple(r for r in range(self.world_size) if r != self.coordinator)

    def ranks_of(self, stage: Stage) -> tuple[int, ...]:
        return {Stage.CONDITION: (self.condition,), Stage.DENOISE: self.denoise, Stage.DECODE: (self.decode,)}[stage]

    def workers_of(self, stage: Stage) -> tuple[bytes, ...]:
        return tuple(identity(r, stage.value) for r in self.ranks_of(stage))

    @property
    def all(self) -> tuple[bytes, ...]:
        """Every worker thread that reports in at start-up (and acknowledges shutdown)."""
        stages = tuple(w for stage in Stage for w in self.workers_of(stage))
        receivers = tuple(i for i in (self.latent_receiver, self.frames_receiver) if i is not None)
        beats = tuple(identity(r, HEARTBEAT) for r in self.heartbeat_ranks)
        return (*stages, *self.condition_edges, *receivers, *beats)


def placement_of(layout: LayoutConfig) -> Placement:
    return Placement(condition=layout.condition, decode=layout.decode, denoise=tuple(layout.dit),
                     coordinator=layout.coordinator, world_size=layout.world_size)


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
class Plan:
    """What one scheduler action takes on this layout (see the module table)."""

    sends: tuple[tuple[bytes, protocol.WorkerTask], ...]
    waits: frozenset[Part]  # the completions that finish the action
    then: tuple[tuple[bytes, protocol.WorkerTask], ...] = field(default=())  # sent once it is finished


def _dtype(geometry: StreamGeometry) -> str:
    return geometry.dtype  # a torch dtype's name already (``models.geometry``)


def plan(action: StageAction, session: SessionFacts, where: Placement,
         control: protocol.ChunkControl | None = None, steps: int | None = None) -> Plan:
    """The tasks of ``action`` for ``session`` on this layout (``control``: the accepted control of a denoise;
    ``steps``: the denoising steps it runs, None: the preset's all)."""
    sid, g = session.id, session.geometry
    condition, decode = identity(where.condition, Stage.CONDITION.value), identity(where.decode, Stage.DECODE.value)
    dit = where.workers_of(Stage.DENOISE)
    match action:
        case InitCache(stage=Stage.CONDITION):
            init_condition = protocol.InitCondition(
                session=sid, seed=session.seed, prompt=session.prompt, image=session.image,
                image_height=session.image_height, image_width=session.image_width, height=g.height, width=g.width,
                restore=session.restore)
            return Plan(((condition, init_condition),), frozenset({(Phase.INIT, where.condition)}))
        case InitCache(stage=Stage.DECODE):
            init_decode = protocol.InitDecode(session=sid, height=g.height, width=g.width, restore=session.restore)
            return Plan(((decode, init_decode),), frozenset({(Phase.INIT, where.decode)}))
        case InitCache(stage=Stage.DENOISE):
            context = protocol.BroadcastContext(session=sid, index=-1,
                                                tensor=TensorSpec(shape=g.context_shape, dtype=_dtype(g)))
            init = protocol.InitDenoise(session=sid, seed=session.seed, prompt=session.prompt, height=g.height,
                                        width=g.width, intrinsics=session.intrinsics, restore=session.restore,
                                        prompt_revision=session.prompt_revision)
            return Plan((*((edge, context) for edge in where.condition_edges), *((w, init) for w in dit)),
                        frozenset((Phase.INIT, r) for r in where.denoise))
        case RunCondition(index=index):
            moved = protocol.BroadcastCondition(session=sid, index=index,
                                                tensor=TensorSpec(shape=g.condition_shape, dtype=_dtype(g)))
            return Plan(((condition, protocol.ConditionChunk(session=sid, index=index)),),
                        frozenset({(Phase.CHUNK, where.condition)}),
                        then=tuple((edge, moved) for edge in where.condition_edges))
        case RunDenoise(index=index):
            assert control is not None, "a denoise runs with its accepted control"
            latent = TensorSpec(shape=g.latent_shape, dtype=_dtype(g))
            receive = () if where.latent_receiver is None else (
                (where.latent_receiver, protocol.ReceiveLatent(session=sid, index=index, tensor=latent)),)
            denoise = protocol.DenoiseChunk(session=sid, index=index, control=control, latent=latent, steps=steps,
                                            prompt_revision=session.prompt_revision)
            return Plan((*receive, *((w, denoise) for w in dit)), frozenset({(Phase.CHUNK, where.dit_leader)}))
        case RunDecode(index=index):
            frames = TensorSpec(shape=g.frames_shape(index), dtype="uint8")
            task = (decode, protocol.DecodeChunk(session=sid, index=index, frames=frames))
            if where.frames_receiver is None:
                return Plan((task,), frozenset({(Phase.CHUNK, where.decode)}))
            receive = protocol.ReceiveFrames(session=sid, index=index, tensor=frames)
            return Plan(((where.frames_receiver, receive), task),
                        frozenset({(Phase.CHUNK, where.decode), (Phase.TRANSFER, where.coordinator)}))
        case NewPrompt(index=index, prompt=prompt):
            moved = protocol.BroadcastContext(session=sid, index=index,
                                              tensor=TensorSpec(shape=g.context_shape, dtype=_dtype(g)))
            return Plan(((condition, protocol.EncodePrompt(session=sid, index=index, prompt=prompt)),),
                        frozenset({(Phase.CHUNK, where.condition)}),
                        then=tuple((edge, moved) for edge in where.condition_edges))
        case Release(stage=stage):
            release = protocol.Release(session=sid)
            return Plan(tuple((w, release) for w in where.workers_of(stage)),
                        frozenset((Phase.RELEASE, r) for r in where.ranks_of(stage)))
    raise AssertionError(f"no tasks for {action}")
