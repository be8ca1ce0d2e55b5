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
from typing import Annotated, Any, ClassVar, Union

import msgspec
from msgspec import UNSET, UnsetType

# 2: controls and chunk facts are typed values (``ChunkControl``, ``ChunkFacts``); 3: fields appended with defaults
# (``open``'s intrinsics, steps, min_steps and restore; a control's steps; the facts' steps and prompt revision),
# new messages (``set_prompt``, ``watch``/``unwatch``, ``save``, ``migrated``), and clients read server messages
# tolerantly (unknown fields and message types are skipped, ``ipc.tolerant``)
PROTOCOL_VERSION = 3
# the versions whose messages this one reads: a version-2 message is a version-3 message that uses no new field
SUPPORTED_VERSIONS = frozenset({2, PROTOCOL_VERSION})
DEFAULT_MAX_BYTES = 16 * 1024 * 1024

KEYS = frozenset("wasdijkl")  # W/S forward/back, A/D strafe, I/K pitch, J/L yaw
MAX_MOUSE_DEGREES = 360.0  # per chunk; more is a client bug, not a turn
MAX_REVISION = 2**31 - 1  # a live input's revision: the page's frame header carries it as an int32 (2^31 states
# is a year at 60 a second); one limit for every client, so a page and a script are refused alike
MAX_POSE_TRANSLATION = 1e6  # scene units from the origin: far beyond any walk (0.05 units a frame for days)
POSE_ORTHONORMAL_TOLERANCE = 1e-3  # |R^T R - I| of an explicit pose's rotation
MAX_DEPTH = 16  # nesting of a client message: the deepest legitimate one (a control's poses) is 4
MAX_ITEMS = 8192  # msgpack items in one client message: the largest legitimate one (256 poses) holds about 4.2k
MAX_INTERNAL_ITEMS = 1_000_000  # from the server or another rank: trusted, only bounded against runaway work
MAX_ERROR_CHARS = 300  # error texts never echo unbounded input
INTRINSICS_HEIGHT, INTRINSICS_WIDTH = 480, 832  # camera intrinsics are given for this frame (the official convention)
MAX_FOCAL_PIXELS = 1e5  # at 832 pixels wide a field of view of about half a degree: more is a unit mistake
# Quality presets: denoising steps a chunk may run, best first (subsets of the preset's timesteps, see
# models.schedule.step_subset); the degrade ladder walks down this list and back up.
QUALITY_STEPS = (4, 2, 1)

# Field types with the bounds every client message is held to while it is decoded (not after).
Steps = Annotated[int, msgspec.Meta(ge=1, le=4)]  # one of QUALITY_STEPS (checked after decoding)
SessionId = Annotated[str, msgspec.Meta(max_length=64)]
Key = Annotated[str, msgspec.Meta(max_length=8)]
KeyList = Annotated[list[Key], msgspec.Meta(max_length=16)]


def clip(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` cut to ``limit`` characters (an error text must not grow with the input that caused it)."""
    suffix = " ... (clipped)"
    return text if len(text) <= limit else text[: limit - len(suffix)] + suffix


class ProtocolViolation(ValueError):
    """A message from outside is malformed; the message text says what is wrong (clipped, never echoing unbounded
    input). ``req`` is the request id of the message when it could still be read, so the error reaches the caller
    waiting for it."""

    def __init__(self, message: str, req: int | None = None) -> None:
        super().__init__(clip(message))
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

    keys: Annotated[frozenset[Key], msgspec.Meta(max_length=16)] = frozenset()  # held for the whole chunk (taps too)
    mouse: tuple[float, float] = (0.0, 0.0)  # yaw, pitch in degrees over the whole chunk
    # explicit c2w per video frame, 16 floats row-major (a chunk has at most 4 * chunk_latent_frames frames)
    poses: Annotated[tuple[tuple[float, ...], ...], msgspec.Meta(max_length=256)] | None = None
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
            for i, pose in enumerate(self.poses):
                why = pose_problem(pose)
                if why is not None:
                    raise ValueError(f"pose {i}: {why}")


class InputState(_Value, kw_only=True):
    """A live session's input, one shape from the page to rank 0: the page's ``state`` message (``web.page_protocol``)
    and the wire's ``control_state`` are this value with their own envelope; both SDKs send it and the live control
    service folds it in. Its types are checked while it is decoded, its values by ``check_input_state`` (at each
    trust boundary: the gateway for a page, rank 0 for every client); only rank 0 knows which revision is stale."""

    keys: KeyList = []  # every key held now (case-insensitive)
    mouse: tuple[float, float] = (0.0, 0.0)  # mouse motion (yaw, pitch degrees) since the previous state
    taps: KeyList = []  # keys pressed and released since the previous state
    revision: int = 0  # client input revision, strictly increasing; echoed on the chunk that applied it


class InputStateError(ValueError):
    """A live input state that must not count; ``reason`` is machine-readable: ``unknown_keys``, ``malformed``, or
    (rank 0's live control service only) ``stale_revision``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def check_input_state(state: InputState) -> None:
    """What an ``InputState``'s types cannot say: known key names, mouse motion finite and within
    ±``MAX_MOUSE_DEGREES`` (a turn per state: more is a client bug), a revision in 0..``MAX_REVISION``. Raises
    ``InputStateError``; the message names the field the same way whichever client sent it."""
    for name, keys in (("keys", state.keys), ("taps", state.taps)):
        unknown = sorted({k.lower() for k in keys} - KEYS)
        if unknown:
            raise InputStateError("unknown_keys", f"{name}: unknown keys {clip(str(unknown), 80)}; valid "
                                                  f"{''.join(sorted(KEYS))}")
    for axis, value in zip(("yaw", "pitch"), state.mouse):
        if not math.isfinite(value) or abs(value) > MAX_MOUSE_DEGREES:
            raise InputStateError("malformed", f"mouse {axis} must be finite and within ±{MAX_MOUSE_DEGREES:g} "
                                               f"degrees, got {value!r}")
    if not 0 <= state.revision <= MAX_REVISION:
        raise InputStateError("malformed", f"revision must be in 0..{MAX_REVISION}, got "
                                           f"{clip(str(state.revision), 40)}")


def intrinsics_problem(values: tuple[float, ...]) -> str | None:
    """Why ``(fx, fy, cx, cy)`` (pixels of a 480x832 frame) is not a camera the model can take, or None: finite,
    positive focal lengths up to ``MAX_FOCAL_PIXELS``, the principal point inside the frame."""
    if len(values) != 4:
        return f"intrinsics are 4 numbers (fx, fy, cx, cy), got {len(values)}"
    if not all(math.isfinite(v) for v in values):
        return f"intrinsics must be finite, got {values}"
    fx, fy, cx, cy = values
    if not (0 < fx <= MAX_FOCAL_PIXELS and 0 < fy <= MAX_FOCAL_PIXELS):
        return f"focal lengths fx, fy must be positive (at most {MAX_FOCAL_PIXELS:g} pixels), got {fx:g}, {fy:g}"
    if not (0 <= cx <= INTRINSICS_WIDTH and 0 <= cy <= INTRINSICS_HEIGHT):
        return (f"the principal point (cx, cy) = ({cx:g}, {cy:g}) must lie inside the {INTRINSICS_WIDTH}x"
                f"{INTRINSICS_HEIGHT} frame the intrinsics are given for")
    return None


def pose_problem(pose: tuple[float, ...]) -> str | None:
    """Why 16 floats are not a camera-to-world pose the model can take, or None: a rigid transform (orthonormal
    rotation with determinant 1, last row 0 0 0 1) within ``MAX_POSE_TRANSLATION`` of the origin."""
    if len(pose) != 16:
        return f"a pose is a 4x4 camera-to-world matrix given as 16 floats, got {len(pose)}"
    if not all(math.isfinite(v) for v in pose):
        return "a pose must hold finite numbers"
    if any(abs(a - b) > POSE_ORTHONORMAL_TOLERANCE for a, b in zip(pose[12:], (0.0, 0.0, 0.0, 1.0))):
        return "the last row of a pose must be 0 0 0 1"
    if max(abs(pose[3]), abs(pose[7]), abs(pose[11])) > MAX_POSE_TRANSLATION:
        return f"a pose's translation must stay within {MAX_POSE_TRANSLATION:g} scene units of the origin"
    rows = [pose[0:3], pose[4:7], pose[8:11]]
    for i in range(3):
        for j in range(3):
            dot = sum(rows[k][i] * rows[k][j] for k in range(3))  # (R^T R)[i][j]
            if abs(dot - (i == j)) > POSE_ORTHONORMAL_TOLERANCE:
                return "a pose's rotation must be orthonormal (a rigid camera, no scale or shear)"
    det = (rows[0][0] * (rows[1][1] * rows[2][2] - rows[1][2] * rows[2][1])
           - rows[0][1] * (rows[1][0] * rows[2][2] - rows[1][2] * rows[2][0])
           + rows[0][2] * (rows[1][0] * rows[2][1] - rows[1][1] * rows[2][0]))  # fmt: skip
    if det < 0:
        return "a pose's rotation must not mirror (determinant -1)"
    return None


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

    # bounded as the play page's frame header carries them (u32, u16): a server's nonsense is refused on decode,
    # never a struct error in a gateway's sender (2^32 chunks are 80 years of a stream)
    index: Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
    frames: Annotated[int, msgspec.Meta(ge=0, le=2**16 - 1)]  # video frames in the chunk
    control: ChunkControl  # the control the model saw
    times: ChunkTimes  # the scheduler's rank-0 times
    spans: tuple[Span, ...] = ()  # every rank's stages and transfers of this chunk, on the rank-0 clock
    steps: int = 0  # denoising steps the chunk ran (QUALITY_STEPS); 0: from a server before quality presets
    # set on the first chunk that runs a new steps setting (the receipt of a change, from this chunk on): "client"
    # (its control asked), "ladder_down" or "ladder_up" (the server's degrade ladder); None: same as the chunk before
    steps_changed: str | None = None
    # the prompt this chunk's cross-attention used: 0 the open's, r the r-th ``set_prompt`` (``PromptScheduled``)
    prompt_revision: int = 0


# the metrics on the wire (``Closed.summary``, ``StatsReply.stats``); they hold a ``ChunkControl``, defined above
from ipc.metrics_types import ServerStats, SessionSummary  # noqa: E402


class TensorSpec(_Value):
    """The header of a tensor transfer: what the receiver allocates before the data moves."""

    shape: tuple[int, ...]
    dtype: str  # a torch dtype name without the prefix: "float32", "bfloat16", "uint8"


# ----------------------------------------------------------------------------------------------------------------
# client -> coordinator


class Open(_Msg, tag="open"):
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


class Control(_Msg, tag="control"):
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
    req: int
    session: SessionId
    # from the next chunk cut on, the session's best quality in denoising steps (as ``Control.steps``; None: unchanged)
    steps: Steps | None = None

    def __post_init__(self) -> None:
        why = steps_problem(self.steps)
        if why is not None:
            raise ValueError(why)


class Close(_Msg, tag="close"):
    req: int
    session: SessionId


class SetPrompt(_Msg, tag="set_prompt"):
    """A new prompt mid-stream: re-encoded on the condition rank, it replaces the session's cross-attention context
    from the first chunk whose denoise was not yet dispatched when the new context was ready (``PromptScheduled``)."""

    req: int
    session: SessionId
    prompt: Annotated[str, msgspec.Meta(max_length=100_000)]  # as ``open``'s (server.max_prompt_chars is tighter)


class Save(_Msg, tag="save"):
    """Save the session at its next chunk boundary (owner only); answered by ``saved`` once every file is written."""

    req: int
    session: SessionId


class Stats(_Msg, tag="stats"):
    req: int


class Heartbeat(_Msg, tag="heartbeat"):
    req: int = 0
    session: SessionId | None = None  # resume: a reconnecting client re-attaches to a session it still owns


class Watch(_Msg, tag="watch"):
    """Spectate a running session read-only from its next chunk, with the token its owner got in ``opened``."""

    req: int
    session: SessionId
    token: Annotated[str, msgspec.Meta(max_length=128)]  # the session's watch token (unguessable)


class Unwatch(_Msg, tag="unwatch"):
    """Stop watching: the watcher's stream of the session ends with a ``closed`` (reason "unwatched")."""

    req: int
    session: SessionId


# ----------------------------------------------------------------------------------------------------------------
# coordinator -> client


class _Stream(_Msg):
    """What a client needs to show a session's stream: the answer to its ``open`` or ``watch`` (never sent as such)."""

    req: int
    session: str
    height: int  # this session's frame size (fixed by the server, or derived from the start image)
    width: int
    fps: float
    frames_first_chunk: int  # video frames of chunk 0 (the first latent frame gives one frame)
    frames_per_chunk: int  # video frames of every later chunk
    num_chunks: int | None


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
    frames: bytes  # uint8 RGB, row-major [n, height, width, 3]
    shape: tuple[int, int, int, int]
    facts: ChunkFacts  # index, the control applied, the times on one timeline (rank-0 clock), spans per stage

    def __post_init__(self) -> None:  # on decode too: a reader never reshapes bytes into a shape they are not
        n, height, width, channels = self.shape
        if min(self.shape) < 0 or channels != 3 or n * height * width * 3 != len(self.frames):
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


ClientMessage = Union[Open, Control, ControlState, Close, Stats, Heartbeat, SetPrompt, Watch, Unwatch,  # noqa: UP007
                      Save]
ServerMessage = Union[  # noqa: UP007
    Opened, Accepted, Chunk, Closed, Error, StatsReply, HeartbeatAck, PromptScheduled, Watching, Missed, Saved,
    Migrated,
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
    held: int = 0  # bytes the sessions' caches hold on this rank now, as its stages count them


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


_encoder = msgspec.msgpack.Encoder()  # maps keep their order (a summary lists releases in the order they happened)
_decoders = {
    "client": msgspec.msgpack.Decoder(ClientMessage),
    "server": msgspec.msgpack.Decoder(ServerMessage),
    "worker": msgspec.msgpack.Decoder(WorkerMessage),
    "coordinator": msgspec.msgpack.Decoder(CoordinatorMessage),
    "replica": msgspec.msgpack.Decoder(Register),  # what a replica sends its router
    "router": msgspec.msgpack.Decoder(Registered),  # what a router answers a replica
}


def encode(message: _Msg | ControlState) -> bytes:
    return _encoder.encode(message)


def to_builtins(value: Any) -> Any:
    """A message or value as JSON-able builtins, e.g. a chunk's facts for a JSON file. Sets (a control's keys)
    become sorted lists, so the same facts always read the same."""
    return msgspec.to_builtins(value, order="deterministic")


class Head(msgspec.Struct, frozen=True):
    """The fields every message is read by before its body, each type-checked (unknown fields are skipped here and
    judged by the body's own read): a value of another type is a ``ProtocolViolation``, never a crash in the code
    that looks at it (an array for ``v`` once ended the job: it is unhashable)."""

    type: str | None = None
    v: int = PROTOCOL_VERSION
    req: int | None = None


_head = msgspec.msgpack.Decoder(Head)


def read_as(decoder: msgspec.msgpack.Decoder[Any], data: Any, what: str) -> Any:
    """``data`` read by ``decoder`` (a struct with an int ``v`` field: a message's head, a stats reply read raw) in a
    version this side speaks, or ``ProtocolViolation`` naming ``what`` could not be read."""
    try:
        value = decoder.decode(data)
    except msgspec.DecodeError as error:
        raise ProtocolViolation(f"unreadable {what}: {error}") from None
    except (RecursionError, MemoryError, OverflowError, ValueError, TypeError) as error:
        raise ProtocolViolation(f"unreadable {what} ({type(error).__name__})") from None
    if value.v not in SUPPORTED_VERSIONS:
        raise ProtocolViolation(f"protocol version {value.v} is not supported (this side speaks {PROTOCOL_VERSION})",
                                getattr(value, "req", None))
    return value


def read_head(data: Any) -> Head:
    """The head of one message, typed (bounded first by ``scan`` where the bytes come from outside)."""
    head: Head = read_as(_head, data, "message head")
    return head


def decode(data: bytes | memoryview, direction: str, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """Decode one message read by ``direction`` ("client": what a client sends, "server": what it receives,
    "worker"/"coordinator" likewise inside the job). Raises ``ProtocolViolation`` naming the problem, and nothing
    else: the size, the nesting depth and item count (a list nested 2000 deep is a few kilobytes and would exhaust
    the decoder's recursion), and that it is one msgpack map are checked before it is decoded; then its head (type,
    version, request id, session: ``Head``) is read typed, and only then its body, so no field of any type reaches
    code that assumes another."""
    if len(data) > max_bytes:
        raise ProtocolViolation(f"message of {len(data)} bytes exceeds the limit of {max_bytes} bytes")
    keys = scan(data, max_items=MAX_ITEMS if direction == "client" else MAX_INTERNAL_ITEMS)
    head = read_head(data)
    if direction == "client" and "v" not in keys:
        raise ProtocolViolation("message has no protocol version field 'v'", head.req)
    try:
        return _decoders[direction].decode(data)
    except msgspec.DecodeError as error:
        raise _explain(head, error) from None
    except (RecursionError, MemoryError, OverflowError, ValueError, TypeError) as error:  # never out of decode
        raise ProtocolViolation(f"message could not be decoded ({type(error).__name__})", head.req) from None


_FIXED = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2,
          0xD2: 4, 0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}  # type byte -> payload bytes
_SIZED = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC7: 1, 0xC8: 2, 0xC9: 4}  # length-prefix bytes
_CONTAINERS = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}  # length bytes, items per entry


def scan(data: bytes | memoryview, max_depth: int = MAX_DEPTH, max_items: int = MAX_ITEMS) -> set[str]:
    """Walk a msgpack message's structure without building it (iteratively: bounded work, no recursion) and
    return the string keys of its top-level map. ``ProtocolViolation`` when it is not exactly one map, nests
    deeper than ``max_depth``, holds more than ``max_items`` items, or is truncated."""
    pos, items, keys = 0, 0, set()
    pending: list[int] = []  # items still to read in each open container, innermost last
    top_map = False
    end = len(data)
    while True:
        if pending and pending[-1] == 0:
            pending.pop()
            if not pending:
                break
            continue
        if pos >= end:
            raise ProtocolViolation("not a msgpack message (truncated)")
        is_key = top_map and len(pending) == 1 and pending[0] % 2 == 0
        if pending:
            pending[-1] -= 1
        items += 1
        if items > max_items:
            raise ProtocolViolation(f"message holds more than {max_items} items")
        head = data[pos]
        pos += 1
        children = 0
        if head <= 0x7F or head >= 0xE0:
            pass
        elif 0x80 <= head <= 0x8F:
            children = 2 * (head & 0x0F)
        elif 0x90 <= head <= 0x9F:
            children = head & 0x0F
        elif 0xA0 <= head <= 0xBF:
            size = head & 0x1F
            if is_key:
                keys.add(str(data[pos : pos + size], "utf-8", "replace"))
            pos += size
        elif head in _FIXED:
            pos += _FIXED[head]
        elif head in _SIZED:
            width = _SIZED[head]
            size = int.from_bytes(data[pos : pos + width], "big")
            if is_key and head in (0xD9, 0xDA, 0xDB):
                keys.add(str(data[pos + width : pos + width + size], "utf-8", "replace"))
            pos += width + size + (1 if head in (0xC7, 0xC8, 0xC9) else 0)  # ext: one type byte
        elif head in _CONTAINERS:
            width, per_entry = _CONTAINERS[head]
            children = per_entry * int.from_bytes(data[pos : pos + width], "big")
            pos += width
        else:
            raise ProtocolViolation("not a msgpack message")
        if children:
            if not pending:
                top_map = 0x80 <= head <= 0x8F or head == 0xDE or head == 0xDF
                if not top_map:
                    raise ProtocolViolation("a message must be a msgpack map, got an array")
            if len(pending) >= max_depth:
                raise ProtocolViolation(f"message nests deeper than {max_depth} levels")
            if items + children // 2 > max_items:
                raise ProtocolViolation(f"message holds more than {max_items} items")
            pending.append(children)
        elif not pending:
            if 0x80 <= head <= 0x8F or head in (0xDE, 0xDF):
                break  # an empty map
            if pos != end:
                raise ProtocolViolation("not a msgpack message")
            raise ProtocolViolation("a message must be a msgpack map, got " +
                                    ("an array" if 0x90 <= head <= 0x9F or head in (0xDC, 0xDD) else "a scalar"))
    if pos > end:
        raise ProtocolViolation("not a msgpack message (truncated)")
    if pos < end:
        raise ProtocolViolation("not a msgpack message (bytes after the message)")
    return keys


def _explain(head: Head, error: msgspec.DecodeError) -> ProtocolViolation:
    """The body's decode error in words, with the request id the (already checked) head carries."""
    if head.type is None:
        return ProtocolViolation("message has no 'type' field", head.req)
    if "UTF-8" in str(error):  # a prompt, say: the head was read past it, so its request id is known
        return ProtocolViolation("a string in the message is not valid UTF-8", head.req)
    text = str(error)
    if "Invalid value" in text and "$.type" in text:
        return ProtocolViolation(f"unknown message type {head.type!r}", head.req)
    return ProtocolViolation(f"invalid {head.type!r} message: {text}", head.req)
