"""Every message of the control plane as a schema: client <-> coordinator, coordinator <-> role workers, replica
<-> router. Frozen msgspec structs tagged by ``type``; fields are appended with defaults, never reordered; each
carries a comment saying why it exists. The codec (``encode``, ``decode`` and its checks) is ``ipc.protocol``,
which re-exports every name here: callers import from there.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, ClassVar, Union

import msgspec
from msgspec import UNSET, UnsetType

from ipc.auth import MAX_TOKEN_CHARS
from ipc.metrics_types import ServerStats, SessionSummary
from ipc.values import (
    PROTOCOL_VERSION,
    QUALITY_STEPS,
    ChunkControl,
    ChunkFacts,
    Edge,
    InputState,
    SessionId,
    Stage,
    Steps,
    _Msg,
    _Value,
    intrinsics_problem,
)


class TensorSpec(_Value):
    """The header of a tensor transfer: what the receiver allocates before the data moves."""

    shape: tuple[int, ...]
    dtype: str  # a torch dtype name without the prefix: "float32", "bfloat16", "uint8"


# ----------------------------------------------------------------------------------------------------------------
# client -> coordinator

# the client token (``ipc.auth``; not a session's watch ``token``): a server or router that requires one refuses a
# request without it, or with another, ``unauthorized`` before any work. Left out of the bytes when unset, so a
# client without a token sends what it sent before the field existed.
AuthToken = Union[Annotated[str, msgspec.Meta(max_length=MAX_TOKEN_CHARS)], UnsetType]  # noqa: UP007


class _Request(_Msg, kw_only=True):
    """A client request: every one may carry the client token."""

    auth: AuthToken = UNSET


class Open(_Request, tag="open"):
    req: int  # client request id, echoed in the reply
    image: bytes  # start image, PNG or JPEG bytes; its size sets the session's frame size when stream.size="image"
    prompt: Annotated[str, msgspec.Meta(max_length=100_000)] = ""  # text prompt (server.max_prompt_chars is tighter)
    seed: int = 0  # noise seed: same seed + image + prompt + controls -> same frames
    num_chunks: int | None = None  # session length in chunks; None: until closed (bounded by server.max_chunks)
    live: bool = False  # live mode: controls come as held-key state (control_state), cut into per-chunk snapshots
    pause_when_idle: bool = False  # live mode: pause generation while no input is held
    # the camera (fx, fy, cx, cy) in pixels of a 480x832 frame (the official examples' convention), scaled to the
    # session's frame size; None: the server's controls.intrinsics. The DiT's camera rays are computed with it.
    intrinsics: tuple[float, float, float, float] | None = None
    # denoising steps per chunk, a quality preset (4, 2 or 1; None: 4, the preset's all): the session's best quality,
    # which the server's degrade ladder may lower (to hold real time for every session) but never below min_steps
    steps: Steps | None = None
    min_steps: Steps | None = None  # the lowest steps this session accepts from the ladder (None: capacity.min_steps)
    # a snapshot id (``save``): the session starts from it, at its chunk, instead of from ``image`` (sent empty);
    # its seed, prompt, frame size and camera are the snapshot's. Restoring one snapshot twice forks it
    restore: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    # with ``restore``: the session takes indexed controls even if the saved one was live (an exact replay sends
    # the recorded per-chunk controls)
    indexed: bool = False

    def __post_init__(self) -> None:
        why = None if self.intrinsics is None else intrinsics_problem(self.intrinsics)
        why = why or steps_problem(self.steps) or steps_problem(self.min_steps)
        if why is None and self.steps is not None and self.min_steps is not None and self.min_steps > self.steps:
            why = f"min_steps ({self.min_steps}) must not exceed steps ({self.steps})"
        if why is not None:
            raise ValueError(why)


def steps_problem(steps: int | None) -> str | None:
    """Why ``steps`` is not a quality preset, or None (None itself is fine: the default)."""
    if steps is None or steps in QUALITY_STEPS:
        return None
    return f"steps must be one of {', '.join(map(str, QUALITY_STEPS))} (denoising steps per chunk), got {steps}"


class Control(_Request, tag="control"):
    req: int
    session: SessionId
    index: int  # chunk index this control applies to; must be the next expected one
    control: ChunkControl = ChunkControl()  # keys, mouse or poses of that chunk (no keys: a still camera)
    # from this chunk on, the session's best quality in denoising steps (QUALITY_STEPS; None: unchanged); the chunk
    # facts' steps_changed is the receipt. Below the session's min_steps it lowers that floor too.
    steps: Steps | None = None

    def __post_init__(self) -> None:
        why = steps_problem(self.steps)
        if why is not None:
            raise ValueError(why)


class ControlState(InputState, tag_field="type", tag="control_state", kw_only=True):
    """A live session's input (``InputState``: keys, mouse, taps, revision, the same fields as the page's ``state``)
    with the request's own fields."""

    v: int = PROTOCOL_VERSION  # as ``_Msg``'s (a struct has one base with fields: the input state's)
    auth: AuthToken = UNSET  # as ``_Request``'s
    req: int
    session: SessionId
    # from the next chunk cut on, the session's best quality in denoising steps (as ``Control.steps``; None: unchanged)
    steps: Steps | None = None

    def __post_init__(self) -> None:
        why = steps_problem(self.steps)
        if why is not None:
            raise ValueError(why)

    def _folded_over(self, older: InputState) -> dict[str, Any]:
        """A fold keeps the steps an older state asked for unless this one asks again (None: unchanged)."""
        kept = older.steps if isinstance(older, ControlState) else None
        return {} if self.steps is not None else {"steps": kept}


class Close(_Request, tag="close"):
    req: int
    session: SessionId


class SetPrompt(_Request, tag="set_prompt"):
    """A new prompt mid-stream: re-encoded on the condition rank, it replaces the session's cross-attention context
    from the first chunk whose denoise was not yet dispatched when the new context was ready (``PromptScheduled``)."""

    req: int
    session: SessionId
    prompt: Annotated[str, msgspec.Meta(max_length=100_000)]  # as ``open``'s (server.max_prompt_chars is tighter)


class Save(_Request, tag="save"):
    """Save the session at its next chunk boundary (owner only); answered by ``saved`` once every file is written."""

    req: int
    session: SessionId


class Stats(_Request, tag="stats"):
    req: int


class Drain(_Request, tag="drain"):
    """An operator's: drain this server as a SIGTERM does (stop admitting, save every session, hand each off, exit
    0); answered by a ``draining`` reply with the counts. A second ``drain`` is answered the same (changing nothing)."""

    req: int
    operator: AuthToken = UNSET  # the server's operator token (``server.operator_token_file``): else refused


class Heartbeat(_Request, tag="heartbeat"):
    req: int = 0
    session: SessionId | None = None  # resume: a reconnecting client re-attaches to a session it still owns


class Watch(_Request, tag="watch"):
    """Spectate a running session read-only from its next chunk, with the token its owner got in ``opened``."""

    req: int
    session: SessionId
    token: Annotated[str, msgspec.Meta(max_length=128)]  # the session's watch token (unguessable)


class Unwatch(_Request, tag="unwatch"):
    """Stop watching: the watcher's stream of the session ends with a ``closed`` (reason "unwatched")."""

    req: int
    session: SessionId


# ----------------------------------------------------------------------------------------------------------------
# coordinator -> client


class StreamHeader(msgspec.Struct, frozen=True):
    """What a client needs to show a session's stream, spelled once: ``opened`` and ``watching`` carry these fields
    after ``req``, the SDK's ``SessionInfo`` starts with them, the page's ``opened`` and ``watching`` too (each builds
    its fields from ``header_fields``). Rank 0 builds it from the session (``runtime.session.Session.header``)."""

    session: str
    height: int  # this session's frame size (fixed by the server, or derived from the start image)
    width: int
    fps: float
    frames_first_chunk: int  # video frames of chunk 0 (the first latent frame gives one frame)
    frames_per_chunk: int  # video frames of every later chunk
    num_chunks: int | None

    @classmethod
    def of(cls, stream: Any) -> StreamHeader:
        """The header of anything that carries its fields (an ``opened``, a ``watching``, a ``SessionInfo``)."""
        return cls(**{name: getattr(stream, name) for name in cls.__struct_fields__})

    def as_fields(self) -> dict[str, Any]:
        """The fields by name, to build a message that carries them (``Watching(req=..., **header.as_fields())``)."""
        return msgspec.structs.asdict(self)


def header_fields() -> list[tuple[str, Any]]:
    """``StreamHeader``'s fields (name, type), in order, as ``msgspec.defstruct`` takes them."""
    return [(field.name, field.type) for field in msgspec.structs.fields(StreamHeader)]


# What a client needs to show a session's stream: the answer to its ``open`` or ``watch`` (never sent as such).
_Stream = msgspec.defstruct("_Stream", [("req", int), *header_fields()], bases=(_Msg,), module=__name__)


class Opened(_Stream, tag="opened"):
    # the camera the DiT's rays use for this session: (fx, fy, cx, cy) in pixels of *this session's* frame (the open
    # request's or the server's intrinsics, scaled from 480x832); None from a server that predates the field
    intrinsics: tuple[float, float, float, float] | None = None
    # denoising steps its first chunks run (the open's, or fewer when the ladder admitted it lower; each chunk's facts
    # say what it ran and when that changed); 0 from a server before quality presets
    steps: int = 0
    # the token others ``watch`` this session with (the owner shares it; "" from a server without spectators)
    watch_token: str = ""
    first_chunk: int = 0  # the index of its first chunk and control: a restored session's snapshot chunk, else 0


class Accepted(_Msg, tag="accepted"):
    req: int
    session: str
    index: int


class PromptScheduled(_Msg, tag="prompt_scheduled"):
    """The answer to ``set_prompt``, once its context is encoded and on its way to the DiT ranks."""

    req: int
    session: str
    revision: int  # the new prompt's revision (the open's is 0; each accepted set_prompt adds one)
    chunk: int  # the first chunk that uses it (its facts carry ``revision``), unless a later set_prompt supersedes it


class Chunk(_Msg, tag="chunk"):
    session: str
    frames: bytes  # uint8 RGB, row-major [n, height, width, 3]; empty when they travel apart (``frames_part``)
    shape: tuple[int, int, int, int]
    facts: ChunkFacts  # index, the control applied, the times on one timeline (rank-0 clock), spans per stage
    # 1 (version 4): the frames are the ZeroMQ frame right after this map, sent and read without a copy
    # (``ipc.chunk_wire``); 0: inside ``frames`` (a server before version 4)
    frames_part: int = 0

    def __post_init__(self) -> None:  # on decode too: a reader never reshapes bytes into a shape they are not
        n, height, width, channels = self.shape
        if self.frames_part not in (0, 1):
            raise ValueError(f"a chunk's frames cannot be in ZeroMQ part {self.frames_part}")
        size = len(self.frames) if self.frames_part == 0 else n * height * width * 3
        if min(self.shape) < 0 or channels != 3 or n * height * width * 3 != size or (self.frames_part and self.frames):
            raise ValueError(f"frames of shape {self.shape} do not match their {len(self.frames)} bytes")


class Closed(_Msg, tag="closed"):
    session: str
    reason: str  # "client", "complete", "disconnect", "failed", "shutdown"; to a watcher also "unwatched"
    error: str | None = None
    # the session's metrics (``ipc.metrics_types``); UNSET (left out) where it has none of its own: to a watcher
    summary: SessionSummary | UnsetType = UNSET


class Error(_Msg, tag="error", kw_only=True):
    req: int | None = None  # the request that caused it, when known
    session: str | None = None
    code: str  # machine-readable: bad_message, unknown_session, rejected_control, busy, failed, shutdown, ...
    message: str
    retry_after_s: float | None = None  # set when trying again later can work (server full)


class Watching(_Stream, tag="watching"):
    """The answer to ``watch``: the session's geometry; its chunks follow from the next one emitted."""


class Missed(_Msg, tag="missed"):
    """To a watcher, right before the next chunk it gets: ``chunks`` chunks of the session were dropped for it since
    the last one it got (it read too slowly; the player never waits for a watcher). ``total``: so far."""

    session: str
    chunks: int
    total: int


class Saved(_Msg, tag="saved"):
    """A finished ``save``: the snapshot's id (what ``open(restore=...)`` takes), its chunk and its cost."""

    req: int
    session: str
    snapshot: str
    chunk: int  # the boundary: a restored session's first chunk
    bytes: int  # every rank's file together
    pause_s: float  # how long the session's DiT waited for the ranks' copies (the save's only cost on the stream)
    write_s: float  # the slowest rank's write and hash, off the stream
    files: int = 0
    wait_s: float = 0.0  # from the request to the boundary (the chunks before it finishing as they would anyway)


class StatsReply(_Msg, tag="stats_reply"):
    req: int
    stats: ServerStats  # server counters and per-session metrics (``ipc.metrics_types``)


class HeartbeatAck(_Msg, tag="heartbeat_ack"):
    req: int = 0
    session: str | None = None
    server: str = ""  # this server's id for its lifetime: a client sees a restarted server (its sessions are gone)


class Migrated(_Msg, tag="migrated"):
    """From a router with ``snapshot_every``: the session's replica went down and the session goes on on
    ``replica`` from its latest snapshot. It keeps its id; its chunks and controls continue from ``chunk`` (the
    snapshot's boundary): chunks from ``chunk`` on come again, and a control below ``chunk`` is refused."""

    session: str
    chunk: int  # the chunk it resumes from: the next chunk and control index
    replica: str  # the router's name of the replica it now runs on


class Draining(_Msg, tag="draining"):
    """The server drains (a SIGTERM or a ``drain``). As the answer to ``drain`` (``req`` set): how many sessions it
    hands off and the seconds left before it stops. As a session's notice (``session`` set): the session was saved
    at chunk ``chunk`` as ``snapshot`` and is closed here next (``closed`` reason ``drained``); chunks below
    ``chunk`` all came before this notice. Open it elsewhere with ``open(restore=snapshot)``: it goes on from
    ``chunk``. A router takes the notice itself and moves the session (its client sees ``migrated``)."""

    req: int | None = None
    session: str | None = None
    snapshot: str | None = None
    chunk: int | None = None  # the snapshot's boundary: the restored session's first chunk
    sessions: int = 0  # (the reply) sessions open when the drain began, each handed off or closed before the exit
    left_s: float = 0.0  # (the reply) seconds before the server stops whatever is still open (server.drain_s)


ClientMessage = Union[Open, Control, ControlState, Close, Stats, Heartbeat, SetPrompt, Watch, Unwatch,  # noqa: UP007
                      Save, Drain]
ServerMessage = Union[  # noqa: UP007
    Opened, Accepted, Chunk, Closed, Error, StatsReply, HeartbeatAck, PromptScheduled, Watching, Missed, Saved,
    Migrated, Draining,
]

# ----------------------------------------------------------------------------------------------------------------
# coordinator -> role workers: one task per operation. Each task states what it is (``phase``, and ``edge`` for
# transfers) so a worker answers it with the matching completion without a table of names.


class Phase(str, Enum):
    INIT = "init"  # a stage opens a session's caches
    CHUNK = "chunk"  # a stage works on one chunk
    RELEASE = "release"  # a stage frees a session's caches
    TRANSFER = "transfer"  # a tensor moves between ranks
    SAVE = "save"  # a stage copies a session's state for a snapshot


class _Task(_Msg):
    session: str
    phase: ClassVar[Phase]


class InitCondition(_Task, tag="init_condition"):
    phase = Phase.INIT
    seed: int
    prompt: str
    image: bytes  # raw uint8 RGB [image_height, image_width, 3]: the start image at its own size
    image_height: int
    image_width: int
    height: int  # the session's frame size; the stage resizes the image to it
    width: int
    restore: str = ""  # a snapshot id: the stage loads this rank's file of it instead of starting from the image


class InitDenoise(_Task, tag="init_denoise"):
    phase = Phase.INIT
    seed: int
    prompt: str
    height: int  # the session's frame size
    width: int
    intrinsics: tuple[float, float, float, float] | None = None  # the session's camera at 480x832; None: the stage's
    restore: str = ""  # a snapshot id: KV ring, noise and camera state from this rank's file of it
    prompt_revision: int = 0  # the revision of its context (a restored session's snapshot's; later ones switch)


class InitDecode(_Task, tag="init_decode"):
    phase = Phase.INIT
    height: int  # the session's frame size
    width: int
    restore: str = ""  # a snapshot id: the decoder cache from this rank's file of it


class ConditionChunk(_Task, tag="condition_chunk"):
    phase = Phase.CHUNK
    index: int


class DenoiseChunk(_Task, tag="denoise_chunk"):
    phase = Phase.CHUNK
    index: int
    control: ChunkControl
    latent: TensorSpec  # what the DiT leader sends to the decode rank (zeros of it after a failure)
    steps: int | None = None  # denoising steps this chunk runs (QUALITY_STEPS, chosen on rank 0); None: all
    # the prompt context this chunk attends to; a revision the DiT rank has not applied yet is taken from its
    # mailbox (under ``context_index(revision)``) before the chunk's passes, the older ones dropped
    prompt_revision: int = 0


def context_index(revision: int) -> int:
    """The (negative) index a session's prompt context of ``revision`` travels under: -1 the open's, -1 - r the
    r-th ``set_prompt``'s; so chunk indices (>= 0) and contexts share one key space on every rank."""
    return -1 - revision


def revision_of(index: int) -> int:
    """The prompt revision of a context index (``context_index``'s inverse)."""
    return -1 - index


class EncodePrompt(_Task, tag="encode_prompt"):
    """The condition rank encodes a ``set_prompt``'s text; its context then moves like the open's
    (``BroadcastContext`` with the same index). Answered as a chunk of the condition stage at that index."""

    phase = Phase.CHUNK
    index: int  # context_index(revision)
    prompt: str


class DecodeChunk(_Task, tag="decode_chunk"):
    phase = Phase.CHUNK
    index: int
    frames: TensorSpec  # what the decode rank sends to the coordinator rank (zeros of it after a failure)


class Release(_Task, tag="release"):
    phase = Phase.RELEASE


class _Transfer(_Task):
    phase = Phase.TRANSFER
    edge: ClassVar[Edge]
    index: int  # the chunk (a prompt context: ``context_index(revision)``, -1 for the open's)
    tensor: TensorSpec


class BroadcastContext(_Transfer, tag="broadcast_context"):
    edge = Edge.CONTEXT


class BroadcastCondition(_Transfer, tag="broadcast_condition"):
    edge = Edge.CONDITION


class ReceiveLatent(_Transfer, tag="receive_latent"):
    edge = Edge.LATENT


class ReceiveFrames(_Transfer, tag="receive_frames"):
    edge = Edge.FRAMES


class SaveState(_Task, tag="save_state"):
    """Copy the session's state of this stage (after every task sent before this one) and write it as this rank's
    file of ``snapshot`` on a side thread; answered ``save_captured`` after the copy, ``save_written`` after the
    file."""

    phase = Phase.SAVE
    snapshot: str
    chunk: int  # the boundary: conditions already encoded for chunks >= it are part of the condition stage's state
    prompt_revision: int = 0  # the prompt the boundary chunk uses: the condition stage saves its context


class Shutdown(_Msg, tag="shutdown"):
    """Every worker thread stops and answers ``ShutdownDone``."""


WorkerTask = Union[  # noqa: UP007
    InitCondition, InitDenoise, InitDecode, ConditionChunk, DenoiseChunk, DecodeChunk, Release, BroadcastContext,
    BroadcastCondition, ReceiveLatent, ReceiveFrames, EncodePrompt, SaveState,
]


class Ping(_Msg, tag="ping"):
    """Coordinator -> each rank's heartbeat thread, periodically: liveness both ways and a clock sample."""

    seq: int
    sent: float  # coordinator clock when sent (t0)


# ----------------------------------------------------------------------------------------------------------------
# role workers -> coordinator: one completion per kind of task


class WarmUp(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One stage's start-up warm-up at one frame size on one rank (``ranks.warmup``)."""

    stage: str  # condition, denoise or decode
    height: int
    width: int
    chunks: int  # chunks of the throwaway session
    seconds: float
    thread: str = ""  # the thread that ran it: the one that serves the stage (cuDNN's autotune cache is per thread)
    failed: str = ""  # why this size could not warm here (out of memory): the rank cannot serve it; "" when it did


class Hello(_Msg, tag="hello"):
    rank: int
    role: str  # which worker thread of the rank this is
    pid: int = 0  # the rank's process: rank 0 watches the processes on its own host to name a dead rank
    host: str = ""  # the rank's host name (a pid means something on that host only)
    room: int = -1  # bytes this rank can give to sessions once ready (memory-aware admission); -1: unlimited
    warm_up: tuple[WarmUp, ...] = ()  # a stage thread: its stage's warm-up, which it ran itself before this hello


class WorkerSpan(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    name: str  # a stage or "transfer:<edge>"; "<stage>.init" and "<stage>.release" for cache work
    start: float  # on the worker's clock
    end: float


class _Done(_Msg, kw_only=True):
    rank: int
    role: str  # the worker thread that answers
    session: str
    spans: tuple[WorkerSpan, ...] = ()


class InitDone(_Done, tag="init_done"):
    stage: Stage


class ChunkDone(_Done, tag="chunk_done"):
    stage: Stage
    index: int


class ReleaseDone(_Done, tag="release_done"):
    stage: Stage


class TransferDone(_Done, tag="transfer_done"):
    edge: Edge
    index: int


class TaskFailed(_Done, tag="task_failed", kw_only=True):
    phase: Phase  # what failed: a cache init, a chunk, a release or a transfer
    stage: Stage | None  # None for a transfer
    index: int = -1  # the chunk, for a chunk or a transfer
    error: str
    fatal: bool = False  # the rank cannot go on (tensor plane broken): the job ends
    snapshot: str = ""  # a failed ``save_state``'s snapshot: its refusal is told apart from an older save's


class SaveCaptured(_Done, tag="save_captured"):
    stage: Stage
    snapshot: str


class SaveWritten(_Done, tag="save_written"):
    """From a rank's snapshot writer thread: its file is on disk (or why not)."""

    stage: Stage
    snapshot: str
    name: str = ""
    bytes: int = 0
    sha256: str = ""
    seconds: float = 0.0  # write and hash
    error: str = ""


class ShutdownDone(_Msg, tag="shutdown_done"):
    rank: int
    role: str


Completion = Union[InitDone, ChunkDone, ReleaseDone, TransferDone, TaskFailed]  # noqa: UP007


class Beat(_Msg, tag="beat"):
    """A rank's answer to a ping: its liveness, its memory, and the worker side of an NTP-style sample."""

    rank: int
    seq: int
    echo: float  # the ping's `sent` (t0, coordinator clock)
    received: float  # worker clock when the ping arrived (t1)
    sent: float  # worker clock when this reply left (t2)
    rss: int = 0  # resident memory of the rank now, bytes
    peak_rss: int = 0  # peak resident memory, bytes
    cuda_peak: int = 0  # torch.cuda.max_memory_allocated, bytes (0 without CUDA)
    room: int = -1  # bytes this rank can give to sessions (as in its hello); -1: unlimited
    # bytes the sessions' caches hold on this rank now, as its stages count them (``held`` on the wire)
    cache_bytes: int = msgspec.field(default=0, name="held")


WorkerMessage = Union[Hello, InitDone, ChunkDone, ReleaseDone, TransferDone, TaskFailed, ShutdownDone, Beat,  # noqa: UP007
                      SaveCaptured, SaveWritten]
CoordinatorMessage = Union[  # noqa: UP007
    InitCondition, InitDenoise, InitDecode, ConditionChunk, DenoiseChunk, DecodeChunk, Release, BroadcastContext,
    BroadcastCondition, ReceiveLatent, ReceiveFrames, Shutdown, Ping, EncodePrompt, SaveState,
]

# ----------------------------------------------------------------------------------------------------------------
# replica <-> router (``python -m ranks.router``): membership. Everything else between a router and its replicas is
# the client protocol above: the router is one client of each replica.


class Register(_Msg, tag="register"):
    """A replica's rank 0 -> the router's registration socket, every ``replica.heartbeat_s``: here I am and this is
    where clients reach me. Re-sent as a heartbeat, so a replica joins a router that starts after it."""

    name: str  # the replica's name at the router; a requeued job keeps it and so takes its old place
    endpoint: str  # where the router connects as a client (tcp://host:port of the replica's server)
    max_sessions: int  # the replica's server.max_sessions: the router places at most this many sessions there
    layout: str  # layout.name, reported in the router's stats
    incarnation: str  # the server id of this job (its heartbeat acks carry it): the router tells jobs apart by it
    token: str = ""  # a shared secret, when the router requires one (router.register_token)


class Registered(_Msg, tag="registered"):
    """The router -> a replica, answering each ``register``: accepted, or why not (logged by the replica)."""

    ok: bool
    message: str = ""
