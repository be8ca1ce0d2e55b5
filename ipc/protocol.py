"""Every message on the control plane: client <-> coordinator and coordinator <-> role workers.

Messages are msgpack maps with a protocol version ``v`` and a ``type`` tag, typed as frozen msgspec structs.
``decode`` validates everything (size, msgpack, version, type, every field's presence, type and value) before
any handler runs and raises one ``ProtocolViolation`` whose message names the problem. No pickle anywhere.
Fields are appended with defaults, never reordered; each carries a comment saying why it exists.
Tensors never travel here: a task on this plane announces each one (session, chunk, shape, dtype), the tensor
plane moves it.

The values that travel inside messages keep one shape from end to end: a ``ChunkControl`` is built by the SDK (or
cut by the live control service) and is what the DiT stage receives; a ``ChunkFacts`` is built on rank 0 and is
what a client stores in its trace file. The three stages of a session share one vocabulary, ``Stage``: the
condition stage (text + VAE encode of the condition chunks), the denoise stage (the DiT group), the decode stage.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any, ClassVar, Union

import msgspec

PROTOCOL_VERSION = 2  # 2: controls and chunk facts are typed values (``ChunkControl``, ``ChunkFacts``)
DEFAULT_MAX_BYTES = 16 * 1024 * 1024

KEYS = frozenset("wasdijkl")  # W/S forward/back, A/D strafe, I/K pitch, J/L yaw
MAX_MOUSE_DEGREES = 360.0  # per chunk; more is a client bug, not a turn


class ProtocolViolation(ValueError):
    """A message from outside is malformed; the message text says what is wrong. ``req`` is the request id of
    the message when it could still be read, so the error reaches the caller waiting for it."""

    def __init__(self, message: str, req: int | None = None) -> None:
        super().__init__(message)
        self.req = req


class _Msg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type", kw_only=True):
    v: int = PROTOCOL_VERSION  # protocol version; a mismatch is rejected with both versions named


class _Value(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A value carried inside messages (no tag, no version of its own)."""


# ----------------------------------------------------------------------------------------------------------------
# values


class Stage(str, Enum):
    """The three stages of a session, each run by one role of the layout."""

    CONDITION = "condition"  # prompt context once, then the condition chunks (VAE encode of the start image)
    DENOISE = "denoise"  # the DiT group: condition + control -> latent
    DECODE = "decode"  # latent -> uint8 frames


class Edge(str, Enum):
    """The tensor transfers between ranks, each announced by a task before it moves."""

    CONTEXT = "context"  # a session's prompt context: condition rank -> every DiT rank
    CONDITION = "condition"  # a chunk's condition: condition rank -> every DiT rank
    LATENT = "latent"  # a chunk's latent: DiT leader -> decode rank
    FRAMES = "frames"  # a chunk's frames: decode rank -> coordinator rank


class ChunkControl(_Value):
    """The control applied to one chunk: what the client asked for and exactly what the model sees."""

    keys: frozenset[str] = frozenset()  # keys held for the whole chunk (taps included); lower-cased
    mouse: tuple[float, float] = (0.0, 0.0)  # yaw, pitch in degrees over the whole chunk
    poses: tuple[tuple[float, ...], ...] | None = None  # explicit c2w per video frame, 16 floats row-major
    revision: int = -1  # client revision of the live input this snapshot came from (-1: indexed control)

    def __post_init__(self) -> None:
        if any(k != k.lower() for k in self.keys):  # case-insensitive on the way in, one spelling after
            msgspec.structs.force_setattr(self, "keys", frozenset(k.lower() for k in self.keys))
        unknown = set(self.keys) - KEYS
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}; valid keys are {sorted(KEYS)}")
        if not all(math.isfinite(v) and abs(v) <= MAX_MOUSE_DEGREES for v in self.mouse):
            raise ValueError(f"mouse must be two finite angles within ±{MAX_MOUSE_DEGREES} degrees, got {self.mouse}")
        if self.poses is not None:
            if any(len(p) != 16 for p in self.poses):
                raise ValueError("each pose must be a 4x4 camera-to-world matrix given as 16 floats")
            if not all(math.isfinite(v) for p in self.poses for v in p):
                raise ValueError("poses must hold finite numbers")


class Span(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One stage or transfer of one chunk on one rank, in rank-0 seconds (an array on the wire: many per chunk)."""

    name: str  # a stage ("condition" | "denoise" | "decode") or a transfer ("transfer:<edge>")
    rank: int
    role: str  # the worker that ran it: a stage, or a transfer worker (condition_edge, latent_receiver, frames)
    queued: float  # when the work was handed to the rank
    start: float
    end: float

    def __post_init__(self) -> None:
        if not self.queued <= self.start <= self.end:
            raise ValueError(f"span {self.name} on rank {self.rank} needs queued <= start <= end, got "
                             f"{self.queued}, {self.start}, {self.end}")

    @property
    def duration(self) -> float:
        return self.end - self.start


class ChunkTimes(_Value):
    """Rank-0 times of one chunk, as the scheduler saw its events."""

    control_accepted: float | None  # the latency anchor; None only if no control was accepted
    condition_submitted: float
    condition_ready: float
    denoise_start: float
    denoise_end: float
    decode_start: float
    decode_end: float
    emitted: float
    condition_start: float | None = None  # when the condition role started condition[i] (its queue wait ends)

    @property
    def control_to_output(self) -> float | None:
        return None if self.control_accepted is None else self.emitted - self.control_accepted

    @property
    def condition_wait(self) -> float:
        """How long the join waited for the condition after the control was accepted (0 if it was prefetched)."""
        anchor = self.condition_submitted if self.control_accepted is None else self.control_accepted
        return max(0.0, self.condition_ready - anchor)


class ChunkFacts(_Value):
    """Everything rank 0 knows about one emitted chunk: sent with its frames, kept in metrics and trace files."""

    index: int
    frames: int  # video frames in the chunk
    control: ChunkControl  # the control the model saw
    times: ChunkTimes  # the scheduler's rank-0 times
    spans: tuple[Span, ...] = ()  # every rank's stages and transfers of this chunk, on the rank-0 clock


class TensorSpec(_Value):
    """The header of a tensor transfer: what the receiver allocates before the data moves."""

    shape: tuple[int, ...]
    dtype: str  # a torch dtype name without the prefix: "float32", "bfloat16", "uint8"


# ----------------------------------------------------------------------------------------------------------------
# client -> coordinator


class Open(_Msg, tag="open"):
    req: int  # client request id, echoed in the reply
    image: bytes  # start image, PNG or JPEG bytes; its size sets the session's frame size when stream.size="image"
    prompt: str = ""  # text prompt
    seed: int = 0  # noise seed: same seed + image + prompt + controls -> same frames
    num_chunks: int | None = None  # session length in chunks; None: until closed (bounded by server.max_chunks)
    live: bool = False  # live mode: controls come as held-key state (control_state), cut into per-chunk snapshots
    pause_when_idle: bool = False  # live mode: pause generation while no input is held


class Control(_Msg, tag="control"):
    req: int
    session: str
    index: int  # chunk index this control applies to; must be the next expected one
    control: ChunkControl = ChunkControl()  # keys, mouse or poses of that chunk (no keys: a still camera)


class ControlState(_Msg, tag="control_state"):
    req: int
    session: str
    keys: list[str] = []  # every key held now
    mouse: tuple[float, float] = (0.0, 0.0)  # mouse motion (yaw, pitch degrees) since the previous message
    taps: list[str] = []  # keys pressed and released since the previous message
    revision: int = 0  # client input revision, strictly increasing; echoed on the chunk that applied it


class Close(_Msg, tag="close"):
    req: int
    session: str


class Stats(_Msg, tag="stats"):
    req: int


class Heartbeat(_Msg, tag="heartbeat"):
    req: int = 0
    session: str | None = None  # resume: a reconnecting client re-attaches to a session it still owns


# ----------------------------------------------------------------------------------------------------------------
# coordinator -> client


class Opened(_Msg, tag="opened"):
    req: int
    session: str
    height: int  # this session's frame size (fixed by the server, or derived from the start image)
    width: int
    fps: float
    frames_first_chunk: int  # video frames of chunk 0 (the first latent frame gives one frame)
    frames_per_chunk: int  # video frames of every later chunk
    num_chunks: int | None


class Accepted(_Msg, tag="accepted"):
    req: int
    session: str
    index: int


class Chunk(_Msg, tag="chunk"):
    session: str
    frames: bytes  # uint8 RGB, row-major [n, height, width, 3]
    shape: tuple[int, int, int, int]
    facts: ChunkFacts  # index, the control applied, the times on one timeline (rank-0 clock), spans per stage


class Closed(_Msg, tag="closed"):
    session: str
    reason: str  # "client", "complete", "disconnect", "failed", "shutdown"
    error: str | None = None
    summary: dict[str, Any] = {}  # the session's metrics (JSON-able, documented in runtime/metrics.py)


class Error(_Msg, tag="error", kw_only=True):
    req: int | None = None  # the request that caused it, when known
    session: str | None = None
    code: str  # machine-readable: bad_message, unknown_session, rejected_control, busy, failed, shutdown, ...
    message: str
    retry_after_s: float | None = None  # set when trying again later can work (server full)


class StatsReply(_Msg, tag="stats_reply"):
    req: int
    stats: dict[str, Any]  # server counters and per-session metrics (JSON-able)


class HeartbeatAck(_Msg, tag="heartbeat_ack"):
    req: int = 0
    session: str | None = None


ClientMessage = Union[Open, Control, ControlState, Close, Stats, Heartbeat]  # noqa: UP007
ServerMessage = Union[Opened, Accepted, Chunk, Closed, Error, StatsReply, HeartbeatAck]  # noqa: UP007

# ----------------------------------------------------------------------------------------------------------------
# coordinator -> role workers: one task per operation. Each task states what it is (``phase``, and ``edge`` for
# transfers) so a worker answers it with the matching completion without a table of names.


class Phase(str, Enum):
    INIT = "init"  # a stage opens a session's caches
    CHUNK = "chunk"  # a stage works on one chunk
    RELEASE = "release"  # a stage frees a session's caches
    TRANSFER = "transfer"  # a tensor moves between ranks


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


class InitDenoise(_Task, tag="init_denoise"):
    phase = Phase.INIT
    seed: int
    prompt: str
    height: int  # the session's frame size
    width: int


class InitDecode(_Task, tag="init_decode"):
    phase = Phase.INIT
    height: int  # the session's frame size
    width: int


class ConditionChunk(_Task, tag="condition_chunk"):
    phase = Phase.CHUNK
    index: int


class DenoiseChunk(_Task, tag="denoise_chunk"):
    phase = Phase.CHUNK
    index: int
    control: ChunkControl
    latent: TensorSpec  # what the DiT leader sends to the decode rank (zeros of it after a failure)


class DecodeChunk(_Task, tag="decode_chunk"):
    phase = Phase.CHUNK
    index: int
    frames: TensorSpec  # what the decode rank sends to the coordinator rank (zeros of it after a failure)


class Release(_Task, tag="release"):
    phase = Phase.RELEASE


class _Transfer(_Task):
    phase = Phase.TRANSFER
    edge: ClassVar[Edge]
    index: int  # the chunk (-1 for a session's prompt context)
    tensor: TensorSpec


class BroadcastContext(_Transfer, tag="broadcast_context"):
    edge = Edge.CONTEXT


class BroadcastCondition(_Transfer, tag="broadcast_condition"):
    edge = Edge.CONDITION


class ReceiveLatent(_Transfer, tag="receive_latent"):
    edge = Edge.LATENT


class ReceiveFrames(_Transfer, tag="receive_frames"):
    edge = Edge.FRAMES


class Shutdown(_Msg, tag="shutdown"):
    """Every worker thread stops and answers ``ShutdownDone``."""


WorkerTask = Union[  # noqa: UP007
    InitCondition, InitDenoise, InitDecode, ConditionChunk, DenoiseChunk, DecodeChunk, Release, BroadcastContext,
    BroadcastCondition, ReceiveLatent, ReceiveFrames,
]


class Ping(_Msg, tag="ping"):
    """Coordinator -> each rank's heartbeat thread, periodically: liveness both ways and a clock sample."""

    seq: int
    sent: float  # coordinator clock when sent (t0)


# ----------------------------------------------------------------------------------------------------------------
# role workers -> coordinator: one completion per kind of task


class Hello(_Msg, tag="hello"):
    rank: int
    role: str  # which worker thread of the rank this is


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


WorkerMessage = Union[Hello, InitDone, ChunkDone, ReleaseDone, TransferDone, TaskFailed, ShutdownDone, Beat]  # noqa: UP007
CoordinatorMessage = Union[  # noqa: UP007
    InitCondition, InitDenoise, InitDecode, ConditionChunk, DenoiseChunk, DecodeChunk, Release, BroadcastContext,
    BroadcastCondition, ReceiveLatent, ReceiveFrames, Shutdown, Ping,
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
    incarnation: str  # random per job start: a new one under a known name means the old job is gone
    token: str = ""  # a shared secret, when the router requires one (router.register_token)


class Registered(_Msg, tag="registered"):
    """The router -> a replica, answering each ``register``: accepted, or why not (logged by the replica)."""

    ok: bool
    message: str = ""


_encoder = msgspec.msgpack.Encoder()  # maps keep their order (a summary lists releases in the order they happened)
_decoders = {
    "client": msgspec.msgpack.Decoder(ClientMessage),
    "server": msgspec.msgpack.Decoder(ServerMessage),
    "worker": msgspec.msgpack.Decoder(WorkerMessage),
    "coordinator": msgspec.msgpack.Decoder(CoordinatorMessage),
    "replica": msgspec.msgpack.Decoder(Register),  # what a replica sends its router
    "router": msgspec.msgpack.Decoder(Registered),  # what a router answers a replica
}
_raw = msgspec.msgpack.Decoder()


def encode(message: _Msg) -> bytes:
    return _encoder.encode(message)


def to_builtins(value: Any) -> Any:
    """A message or value as JSON-able builtins, e.g. a chunk's facts for a JSON file. Sets (a control's keys)
    become sorted lists, so the same facts always read the same."""
    return msgspec.to_builtins(value, order="deterministic")


def decode(data: bytes, direction: str, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """Decode one message read by ``direction`` ("client": what a client sends, "server": what it receives,
    "worker"/"coordinator" likewise inside the job). Raises ``ProtocolViolation`` naming the problem."""
    if len(data) > max_bytes:
        raise ProtocolViolation(f"message of {len(data)} bytes exceeds the limit of {max_bytes} bytes")
    try:
        message = _decoders[direction].decode(data)
    except msgspec.DecodeError as error:
        raise _explain(data, error) from None
    if message.v != PROTOCOL_VERSION:
        raise ProtocolViolation(f"protocol version {message.v} is not supported (server speaks {PROTOCOL_VERSION})",
                                getattr(message, "req", None))
    return message


def _explain(data: bytes, error: msgspec.DecodeError) -> ProtocolViolation:
    try:
        raw = _raw.decode(data)
    except msgspec.DecodeError:
        return ProtocolViolation("not a msgpack message")
    if not isinstance(raw, dict):
        return ProtocolViolation(f"a message must be a msgpack map, got {type(raw).__name__}")
    req = raw.get("req")
    req = req if isinstance(req, int) and not isinstance(req, bool) else None
    version = raw.get("v", PROTOCOL_VERSION)
    if version != PROTOCOL_VERSION:
        return ProtocolViolation(f"protocol version {version!r} is not supported (this server speaks "
                                 f"{PROTOCOL_VERSION})", req)
    if "type" not in raw:
        return ProtocolViolation("message has no 'type' field", req)
    text = str(error)
    if "Invalid value" in text and "$.type" in text:
        return ProtocolViolation(f"unknown message type {raw['type']!r}", req)
    return ProtocolViolation(f"invalid {raw['type']!r} message: {text}", req)
