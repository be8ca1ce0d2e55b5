"""What the play page and the gateway say to each other over one WebSocket (version 1).

Page -> gateway:
- one **binary** message opens a session: ``u32 n`` (little-endian), ``n`` bytes of JSON ``{"type": "open",
  "prompt", "seed", "num_chunks", "live", "pause_when_idle", "restore"}``, then the start image (PNG or JPEG bytes).
  With ``restore`` (a snapshot id from a ``saved``: a fork) the session starts from the snapshot and the message
  ends after the header (no image: the snapshot holds the state; one sent anyway is refused). The sizes
  are checked before anything is decoded: the whole message against ``Limits.max_upload_bytes`` (aiohttp's own
  ``max_msg_size`` refuses larger frames before they are read), the JSON header against ``MAX_HEADER_BYTES``.
- **text** messages are JSON maps with a ``type``: ``state`` (the live input, ``protocol.InputState``, the shape
  both SDKs send and rank 0 folds in: ``keys`` held now, ``mouse`` motion [yaw, pitch] degrees since the previous
  state, ``taps`` pressed and released since, ``revision`` strictly increasing: rank 0 alone refuses a stale one,
  the gateway forwards its ``stale_revision`` error), ``prompt`` (a new prompt mid-session: ``prompt``), ``save``
  (save the tab's session at its next chunk boundary: answered ``saved``), ``close``, ``stats``, ``trace`` (the
  session's Chrome trace), ``watch`` (``session``, ``token``: watch another tab's session read-only, from a share link;
  ``close`` ends the watch). Each is at most ``MAX_TEXT_BYTES``.

Gateway -> page (typed in ``web.page_messages``):
- **text** JSON maps: ``hello`` (frame format, the limits, the key names, the error codes the page may see),
  ``opened`` (with the ``watch_token`` a share link carries,
  ``first_chunk``: a restored session's first chunk index, its snapshot's chunk, else 0, and ``restored``: the
  snapshot id or null), ``saved`` (``snapshot``: the id a fork opens with, ``chunk``: the boundary, ``bytes``,
  ``files``, ``pause_s``, ``write_s``, ``wait_s``: what the save cost),
  ``watching`` (as ``opened``, for a watch), ``chunk`` (per chunk: the applied control, the prompt revision it used,
  control-to-output latency, drop counters, ``missed``: chunks the server dropped for a slow watcher; always sent,
  never dropped), ``prompt`` (a new prompt's ``revision`` and the first ``chunk`` that uses it), ``closed`` (reason
  and the server's session summary), ``stats``, ``trace``, ``error`` (``code``, ``message``, ``retry_after_s``).
- **binary** frames: a 16-byte header (``FRAME_HEADER``) and one encoded picture. Only the newest frames are
  sent (``playout``); the header names the chunk, the frame in it and the input revision the chunk applied, so the
  page times input-to-photon on its own clock.

Every page message is validated here (types by msgspec, then ranges; a state by ``protocol.check_input_state``,
the check rank 0 runs for every client) and a bad one raises ``PageError`` naming the problem; the bridge answers
it with an ``error`` and changes nothing.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Annotated, Any, Union

import msgspec

from ipc.error_codes import ErrorCode
from ipc.protocol import InputState, InputStateError, check_input_state, clip
from runtime.snapshots import ID_PATTERN

PAGE_PROTOCOL_VERSION = 1
MAX_TEXT_BYTES = 9000  # a state is ~100 bytes; a prompt message holds the server's 2000 characters (UTF-8: 8000 bytes)
MAX_HEADER_BYTES = 8192  # the open header: a prompt of the server's 2000 characters fits several times over
# Every number a page sends is range-checked here before anything uses it (a Python int has no size: unchecked, a
# huge one overflows the frame header's int32 or msgpack's 64 bits far from the message that carried it).
MAX_EXACT = 2**53 - 1  # JavaScript's largest exact integer: a number the page shows is the number the server uses
MAX_SEED = MAX_EXACT
MAX_NUM_CHUNKS = MAX_EXACT  # the server then holds it to its own server.max_chunks (its error names the field)
MIN_UPLOAD_BYTES = 64 * 1024  # the smallest upload limit a gateway starts with (a start image must fit)

FRAME_HEADER = struct.Struct("<BBHIHHi")  # kind, format, header length, chunk, frame, frames in chunk, revision
FRAME_KIND = 1
FORMATS = {"jpeg": 1, "webp": 2}


class PageError(ValueError):
    """A page message is invalid; ``code`` is machine-readable, the text says what is wrong for people."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Limits:
    """Sizes the gateway accepts from a page, checked before decoding."""

    max_upload_bytes: int = 8 * 1024 * 1024  # the whole open message (header + image)

    def __post_init__(self) -> None:
        # aiohttp reads max_msg_size=0 as "no limit": a bound of 0 (or less than a start image) is refused, never
        # silently turned into none.
        if self.max_upload_bytes < MIN_UPLOAD_BYTES:
            raise ValueError(f"the upload limit must be at least {MIN_UPLOAD_BYTES} bytes "
                             f"({MIN_UPLOAD_BYTES / 2**20:g} MiB), got {self.max_upload_bytes}")


class _PageMsg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type"):
    pass


class OpenRequest(_PageMsg, tag="open"):
    prompt: str = ""
    seed: int = 0
    num_chunks: int | None = None  # None: until the page stops it (bounded by the server's max_chunks)
    live: bool = True  # the page drives live sessions only; indexed controls are for scripts (scripts/client.py)
    pause_when_idle: bool = False
    restore: str | None = None  # a snapshot id (``saved``): the session starts from it, no image is sent


class StateRequest(InputState, _PageMsg, tag="state"):
    """The live input (``protocol.InputState``) as the page sends it: the gateway forwards it as it is."""


class PromptRequest(_PageMsg, tag="prompt"):
    prompt: str  # the server holds it to its server.max_prompt_chars (its error names the limit)


class CloseRequest(_PageMsg, tag="close"):
    pass


class SaveRequest(_PageMsg, tag="save"):
    pass


class StatsRequest(_PageMsg, tag="stats"):
    pass


class TraceRequest(_PageMsg, tag="trace"):
    pass


class WatchRequest(_PageMsg, tag="watch"):
    session: Annotated[str, msgspec.Meta(max_length=64)]
    token: Annotated[str, msgspec.Meta(max_length=128)]


TextRequest = Union[StateRequest, CloseRequest, StatsRequest, TraceRequest, PromptRequest,  # noqa: UP007
                    WatchRequest, SaveRequest]
_text = msgspec.json.Decoder(TextRequest)
_open = msgspec.json.Decoder(OpenRequest)


def parse_text(data: str) -> (StateRequest | CloseRequest | StatsRequest | TraceRequest | PromptRequest | WatchRequest
                             | SaveRequest):
    """A text message from the page, validated (raises ``PageError``)."""
    raw = data.encode()
    if len(raw) > MAX_TEXT_BYTES:
        raise PageError(ErrorCode.TOO_LARGE,
                        f"a text message of {len(raw)} bytes exceeds the limit of {MAX_TEXT_BYTES}")
    try:
        message = _text.decode(raw)
    except msgspec.ValidationError as error:
        if "$.type" in str(error) or "`type`" in str(error):
            raise PageError(ErrorCode.BAD_MESSAGE, f"unknown or missing message type: {error}") from None
        raise PageError(ErrorCode.BAD_MESSAGE, f"invalid message: {error}") from None
    except msgspec.DecodeError:
        raise PageError(ErrorCode.BAD_MESSAGE, "a text message must be a JSON map") from None
    if isinstance(message, StateRequest):
        check_state(message)
    return message


def check_state(state: StateRequest) -> None:
    """Rank 0's check of a live input, run here too so a bad one costs no round trip; its refusal is the same
    words under the page protocol's code (``malformed`` is a page's ``bad_message``). Staleness is rank 0's."""
    try:
        check_input_state(state)
    except InputStateError as error:
        code = ErrorCode.BAD_MESSAGE if error.reason == ErrorCode.MALFORMED else error.reason
        raise PageError(code, error.message) from None


def check_range(name: str, value: int, low: int, high: int, code: str = ErrorCode.BAD_REQUEST) -> None:
    """``value`` within ``low..high``, or a ``PageError`` naming the field (its value clipped: it can be 400
    digits long)."""
    if not low <= value <= high:
        raise PageError(code, f"{name} must be in {low}..{high}, got {clip(str(value), 40)}")


def parse_open(data: bytes, limits: Limits) -> tuple[OpenRequest, bytes]:
    """The binary open message: its request and the image bytes, sizes checked before decoding."""
    if len(data) > limits.max_upload_bytes:
        raise PageError(ErrorCode.TOO_LARGE, f"an upload of {len(data)} bytes exceeds the limit of "
                                     f"{limits.max_upload_bytes} bytes")
    if len(data) < 4:
        raise PageError(ErrorCode.BAD_MESSAGE, "a binary message must start with the length of its JSON header")
    (length,) = struct.unpack_from("<I", data)
    if length > MAX_HEADER_BYTES or 4 + length > len(data):
        raise PageError(ErrorCode.BAD_MESSAGE, f"the open header claims {length} bytes; at most {MAX_HEADER_BYTES} and "
                                       f"within the {len(data) - 4} bytes sent")
    try:
        request = _open.decode(data[4:4 + length])
    except msgspec.ValidationError as error:
        raise PageError(ErrorCode.BAD_MESSAGE, f"invalid open header: {error}") from None
    except msgspec.DecodeError:
        raise PageError(ErrorCode.BAD_MESSAGE, "the open header must be a JSON map") from None
    image = data[4 + length:]
    if request.restore is not None:
        # checked here, not only by the server: the id is a file name there, and a page's bad link gets its answer
        # before a slot is taken
        if not ID_PATTERN.fullmatch(request.restore):
            raise PageError(ErrorCode.BAD_REQUEST, "open.restore must be a snapshot id (22 characters of A-Z a-z 0-9 "
                                                   f"_ -), got {clip(repr(request.restore), 40)}")
        if image:
            raise PageError(ErrorCode.BAD_REQUEST, "open.restore starts from a snapshot: send no start image with it")
    elif not image:
        raise PageError(ErrorCode.BAD_IMAGE, "no start image: pick or drop a PNG or JPEG")
    if not request.live:
        raise PageError(ErrorCode.BAD_REQUEST, "the play page drives live sessions only; for indexed controls use "
                                       "scripts/client.py")
    check_range("open.seed", request.seed, 0, MAX_SEED)
    if request.num_chunks is not None:
        check_range("open.num_chunks", request.num_chunks, 1, MAX_NUM_CHUNKS)
    return request, bytes(image)


def open_message(request: dict[str, Any], image: bytes) -> bytes:
    """The binary open message as the page builds it (for tests and non-browser clients)."""
    header = json.dumps({"type": "open", **request}).encode()
    return struct.pack("<I", len(header)) + header + image


def frame_message(fmt: str, chunk: int, frame: int, frames: int, revision: int, picture: bytes) -> bytes:
    return FRAME_HEADER.pack(FRAME_KIND, FORMATS[fmt], FRAME_HEADER.size, chunk, frame, frames, revision) + picture


def read_frame(data: bytes) -> dict[str, int]:
    """A frame message's header fields (what the page reads; for tests and non-browser clients)."""
    kind, fmt, size, chunk, frame, frames, revision = FRAME_HEADER.unpack_from(data)
    return {"kind": kind, "format": fmt, "header": size, "chunk": chunk, "frame": frame, "frames": frames,
            "revision": revision}
