"""The values of the control plane: the limits every message is held to, the field types, the shared vocabulary
(``Stage``, ``Edge``) and the values that travel inside messages (``ChunkControl``, ``InputState``, ``ChunkFacts``)
with the checks of their contents. Below both ``ipc.schemas`` (the messages) and ``ipc.metrics_types`` (the metrics
the messages carry), so neither imports the other's importer. Read through ``ipc.protocol``, which re-exports all.

The values that travel inside messages keep one shape from end to end: a ``ChunkControl`` is built by the SDK (or
cut by the live control service) and is what the DiT stage receives; a ``ChunkFacts`` is built on rank 0 and is
what a client stores in its trace file. The three stages of a session share one vocabulary, ``Stage``: the
condition stage (text + VAE encode of the condition chunks), the denoise stage (the DiT group), the decode stage.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Annotated, Any, Self

import msgspec

from ipc.error_codes import ErrorCode

# 2: controls and chunk facts are typed values (``ChunkControl``, ``ChunkFacts``); 3: fields appended with defaults
# (``open``'s intrinsics, steps, min_steps and restore; a control's steps; the facts' steps and prompt revision),
# new messages (``set_prompt``, ``watch``/``unwatch``, ``save``, ``migrated``), and clients read server messages
# tolerantly (unknown fields and message types are skipped, ``ipc.tolerant``); 4: a chunk's frames travel as a ZeroMQ
# frame of their own after its map (``Chunk.frames_part``, ``ipc.chunk_wire``), never copied into it
PROTOCOL_VERSION = 4
# the versions whose messages this one reads: a version-2 or -3 message is a version-4 message that uses no new field
SUPPORTED_VERSIONS = frozenset({2, 3, PROTOCOL_VERSION})
# the first version whose SDK reads a chunk's frames as a part of their own: an ``open`` or ``watch`` of an earlier one
# is refused (in its own version, which it reads), never answered with a stream it cannot read
CHUNK_PARTS_VERSION = 4
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
MAX_HELD_KEYS = 16  # keys or taps in one live input state
KeyList = Annotated[list[Key], msgspec.Meta(max_length=MAX_HELD_KEYS)]


def clip(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` cut to ``limit`` characters (an error text must not grow with the input that caused it)."""
    suffix = " ... (clipped)"
    return text if len(text) <= limit else text[: limit - len(suffix)] + suffix


class ProtocolViolation(ValueError):
    """A message from outside is malformed; the message text says what is wrong (clipped, never echoing unbounded
    input). ``req`` is the request id of the message when it could still be read, so the error reaches the caller
    waiting for it."""

    def __init__(self, message: str, req: int | None = None, answer_v: int | None = None) -> None:
        super().__init__(clip(message))
        self.req = req
        self.answer_v = answer_v  # the version to answer in, when the sender cannot read this one (None: this one)


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

    def fold(self, newer: Self) -> Self:
        """This input and ``newer`` as one state, the one rule rank 0 (``runtime.control_service``) and the router
        (live input that meets a full replica link) fold by: the later revision's held keys (and its own fields, a
        message's request id), the taps of both once each, the mouse motion of both held to ±``MAX_MOUSE_DEGREES``
        (as a cut's turn is: a fold must never make two valid states one the server refuses). Key names come out
        lower-case. The later revision is the newer whichever way round it is called (an equal one: ``newer``)."""
        older, later = (self, newer) if self.revision <= newer.revision else (newer, self)
        return msgspec.structs.replace(
            later, keys=list(dict.fromkeys(k.lower() for k in later.keys)),
            taps=list(dict.fromkeys(k.lower() for k in (*older.taps, *later.taps)))[:MAX_HELD_KEYS],
            mouse=(clamp_turn(older.mouse[0] + later.mouse[0]), clamp_turn(older.mouse[1] + later.mouse[1])),
            **later._folded_over(older),
        )

    def _folded_over(self, older: InputState) -> dict[str, Any]:
        """What else of ``older`` a fold keeps where this later state leaves it unsaid (a message's own fields)."""
        return {}


def clamp_turn(degrees: float) -> float:
    """A turn held to ±``MAX_MOUSE_DEGREES`` (more in one chunk is clamped, never an error on the model's path)."""
    return max(-MAX_MOUSE_DEGREES, min(MAX_MOUSE_DEGREES, degrees)) if math.isfinite(degrees) else 0.0


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
            raise InputStateError(ErrorCode.UNKNOWN_KEYS, f"{name}: unknown keys {clip(str(unknown), 80)}; valid "
                                                  f"{''.join(sorted(KEYS))}")
    for axis, value in zip(("yaw", "pitch"), state.mouse):
        if not math.isfinite(value) or abs(value) > MAX_MOUSE_DEGREES:
            raise InputStateError(ErrorCode.MALFORMED, f"mouse {axis} must be finite and within ±{MAX_MOUSE_DEGREES:g} "
                                               f"degrees, got {value!r}")
    if not 0 <= state.revision <= MAX_REVISION:
        raise InputStateError(ErrorCode.MALFORMED, f"revision must be in 0..{MAX_REVISION}, got "
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
