"""Every message on the control plane: client <-> coordinator and coordinator <-> role workers.

Messages are msgpack maps with a protocol version ``v`` and a ``type`` tag, typed as frozen msgspec structs.
``decode`` validates everything (size, msgpack, version, type, every field's presence and type) before any
handler runs and raises one ``ProtocolViolation`` whose message names the problem. No pickle anywhere.
Fields are appended with defaults, never reordered; each carries a comment saying why it exists.
Tensors never travel here: a header on this plane announces them, the tensor plane moves them.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

PROTOCOL_VERSION = 1
DEFAULT_MAX_BYTES = 16 * 1024 * 1024


class ProtocolViolation(ValueError):
    """A message from outside is malformed; the message text says what is wrong."""


class _Msg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type", kw_only=True):
    v: int = PROTOCOL_VERSION  # protocol version; a mismatch is rejected with both versions named


# ----------------------------------------------------------------------------------------------------------------
# client -> coordinator


class Open(_Msg, tag="open"):
    req: int  # client request id, echoed in the reply
    image: bytes  # start image, PNG or JPEG bytes; resized to the stream geometry
    prompt: str = ""  # text prompt
    seed: int = 0  # noise seed: same seed + image + prompt + controls -> same frames
    num_chunks: int | None = None  # session length in chunks; None: until closed (bounded by server.max_chunks)
    live: bool = False  # live mode: controls come as held-key state (control_state), cut into per-chunk snapshots
    pause_when_idle: bool = False  # live mode: pause generation while no input is held


class Control(_Msg, tag="control"):
    req: int
    session: str
    index: int  # chunk index this control applies to; must be the next expected one
    keys: list[str] = []  # held keys (w a s d i j k l)
    mouse: tuple[float, float] = (0.0, 0.0)  # yaw, pitch in degrees over the chunk
    poses: list[list[float]] | None = None  # explicit camera-to-world pose per video frame, 16 floats each


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
    height: int
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
    index: int
    frames: bytes  # uint8 RGB, row-major [n, height, width, 3]
    shape: tuple[int, int, int, int]
    control: dict[str, Any]  # the control snapshot actually applied (keys, mouse, poses, revision)
    facts: dict[str, Any]  # timings of this chunk on one timeline (rank-0 clock), spans per stage


class Closed(_Msg, tag="closed"):
    session: str
    reason: str  # "client", "complete", "disconnect", "failed", "shutdown"
    error: str | None = None
    summary: dict[str, Any] = {}  # the session's metrics


class Error(_Msg, tag="error", kw_only=True):
    req: int | None = None  # the request that caused it, when known
    session: str | None = None
    code: str  # machine-readable: bad_message, unknown_session, rejected_control, busy, failed, shutdown, ...
    message: str
    retry_after_s: float | None = None  # set when trying again later can work (server full)


class StatsReply(_Msg, tag="stats_reply"):
    req: int
    stats: dict[str, Any]


class HeartbeatAck(_Msg, tag="heartbeat_ack"):
    req: int = 0
    session: str | None = None


ClientMessage = Union[Open, Control, ControlState, Close, Stats, Heartbeat]  # noqa: UP007
ServerMessage = Union[Opened, Accepted, Chunk, Closed, Error, StatsReply, HeartbeatAck]  # noqa: UP007

# ----------------------------------------------------------------------------------------------------------------
# coordinator <-> role workers (the tensor plane moves the data these announce)

class Hello(_Msg, tag="hello"):
    rank: int
    role: str  # which worker thread of the rank this is


class Task(_Msg, tag="task"):
    """A command to a role worker. ``op`` is one of: init, encode, denoise, decode, release (stages);
    edge_context, edge_condition, expect_latent, expect_frames (transfers announced before they happen);
    shutdown."""

    op: str
    session: str = ""
    index: int = -1
    seed: int = 0
    prompt: str = ""
    image: bytes = b""  # raw uint8 [H, W, 3] for the condition role's init
    control: dict[str, Any] = {}


class Done(_Msg, tag="done"):
    rank: int
    role: str
    op: str
    session: str = ""
    index: int = -1
    ok: bool = True
    error: str = ""
    spans: list[list[Any]] = []  # [name, start, end] on the worker's clock
    info: dict[str, Any] = {}  # e.g. peak memory, released caches


class Ping(_Msg, tag="ping"):
    """Coordinator -> each rank's heartbeat thread, periodically: liveness both ways and a clock sample."""

    seq: int
    sent: float  # coordinator clock when sent (t0)


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


WorkerMessage = Union[Hello, Done, Beat]  # noqa: UP007
CoordinatorMessage = Union[Task, Ping]  # noqa: UP007

_encoder = msgspec.msgpack.Encoder()
_decoders = {
    "client": msgspec.msgpack.Decoder(ClientMessage),
    "server": msgspec.msgpack.Decoder(ServerMessage),
    "worker": msgspec.msgpack.Decoder(WorkerMessage),
    "coordinator": msgspec.msgpack.Decoder(CoordinatorMessage),
}
_raw = msgspec.msgpack.Decoder()


def encode(message: _Msg) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes, direction: str, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """Decode one message read by ``direction`` ("client": what a client sends, "server": what it receives,
    "worker"/"coordinator" likewise inside the job). Raises ``ProtocolViolation`` naming the problem."""
    if len(data) > max_bytes:
        raise ProtocolViolation(f"message of {len(data)} bytes exceeds the limit of {max_bytes} bytes")
    try:
        message = _decoders[direction].decode(data)
    except msgspec.DecodeError as error:
        raise ProtocolViolation(_explain(data, error)) from None
    if message.v != PROTOCOL_VERSION:
        raise ProtocolViolation(f"protocol version {message.v} is not supported (server speaks {PROTOCOL_VERSION})")
    return message


def _explain(data: bytes, error: msgspec.DecodeError) -> str:
    try:
        raw = _raw.decode(data)
    except msgspec.DecodeError:
        return "not a msgpack message"
    if not isinstance(raw, dict):
        return f"a message must be a msgpack map, got {type(raw).__name__}"
    version = raw.get("v", PROTOCOL_VERSION)
    if version != PROTOCOL_VERSION:
        return f"protocol version {version!r} is not supported (this server speaks {PROTOCOL_VERSION})"
    if "type" not in raw:
        return "message has no 'type' field"
    text = str(error)
    if "Invalid value" in text and "$.type" in text:
        return f"unknown message type {raw['type']!r}"
    return f"invalid {raw['type']!r} message: {text}"
