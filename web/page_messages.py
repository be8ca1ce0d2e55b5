"""What the gateway says to the page, typed: one msgspec struct per text message, encoded to the JSON the page reads
(``web.page_protocol`` describes them; the keys are the page protocol's, version 1). ``hello`` tells the page what it
must not hard-code: the key names, the limits and the error codes it may see."""

from __future__ import annotations

from typing import Any

import msgspec

from ipc.error_codes import ErrorCode
from ipc.protocol import KEYS, MAX_MOUSE_DEGREES, MAX_REVISION, header_fields
from web import page_protocol as pp
from web.playout import Dropped

# Every code an ``error`` to the page may carry, with what it means for the person at the page (the page has its own
# wording for some; for the others it shows this). The gateway's own, the client library's, and the server's.
ERROR_CODES: dict[ErrorCode, str] = {
    # the page's message, refused by the gateway (nothing changed)
    ErrorCode.BAD_MESSAGE: "the page sent a message the gateway cannot read",
    ErrorCode.TOO_LARGE: "a message or upload beyond the gateway's limits",
    ErrorCode.UNKNOWN_KEYS: "a key the model has no control for",
    ErrorCode.BAD_REQUEST: "a request the gateway or the server refuses as asked",
    ErrorCode.BAD_IMAGE: "the start image cannot be used",
    ErrorCode.NO_SESSION: "no session is open in this tab",
    ErrorCode.NO_TRACE: "no chunk has arrived yet: nothing to trace",
    ErrorCode.WATCH_ONLY: "this tab watches another tab's session: only its player steers it",
    ErrorCode.BUSY: "no room for another session now; retry_after_s says when to try again",
    # the gateway's connection to the server
    ErrorCode.SERVER_UNREACHABLE: "the worldstream server does not answer",
    ErrorCode.UNAUTHORIZED: "the server refused the gateway's client token",
    ErrorCode.SERVER_GONE: "the server stopped answering or restarted",
    ErrorCode.OUTBOX_FULL: "the server is not taking input now; the next input goes again",
    ErrorCode.BAD_REPLY: "the server answered something the gateway cannot read",
    # the server
    ErrorCode.MALFORMED: "a live input the server cannot take (its check's words say which field)",
    ErrorCode.BAD_CONTROL: "a control this session does not take",
    ErrorCode.REJECTED_CONTROL: "the server did not take this input (its words say why); the next one goes again",
    ErrorCode.CONTROL_BACKPRESSURE: "the server is not taking input now (a migration, or a full queue); "
                                    "retry_after_s says when",
    ErrorCode.STALE_REVISION: "a live input not newer than the last one the server took (it changed nothing)",
    ErrorCode.UNKNOWN_SESSION: "the server no longer holds this session",
    ErrorCode.CLOSING: "the session is closing",
    ErrorCode.NOT_READY: "the server is still starting",
    ErrorCode.BAD_SNAPSHOT: "the snapshot cannot be restored",
    ErrorCode.SAVE_FAILED: "the save did not complete; the session streams on",
    ErrorCode.PROMPT_BACKPRESSURE: "too many prompt changes wait; retry_after_s says when to try again",
    ErrorCode.PROMPT_FAILED: "the new prompt could not be encoded; the session keeps its prompt",
    ErrorCode.FAILED: "a stage failed for this session; the server closed it",
    ErrorCode.INTERNAL: "the server failed on this request",
    ErrorCode.RANK_FAILED: "a rank of the server failed: the job is ending",
    ErrorCode.SHUTDOWN: "the server is shutting down",
    ErrorCode.DRAINING: "the server is stopping: this session was saved and ends here; open it again to go on",
}


class PageLimits(msgspec.Struct, frozen=True):
    """What the gateway and the server accept from a page (it checks before sending what it can)."""

    max_upload_bytes: int  # the whole open message (header + image)
    max_text_bytes: int = pp.MAX_TEXT_BYTES  # one text message
    max_header_bytes: int = pp.MAX_HEADER_BYTES  # an open message's JSON header
    max_mouse_degrees: float = MAX_MOUSE_DEGREES  # each axis of one state's mouse motion
    max_revision: int = MAX_REVISION  # a state's revision (from 0, strictly increasing)


class _Out(msgspec.Struct, frozen=True, tag_field="type"):
    pass


class Hello(_Out, tag="hello"):
    version: int
    format: str  # the frames' picture format
    limits: PageLimits
    max_sessions: int  # the gateway's session limit
    keys: tuple[str, ...] = tuple(sorted(KEYS))  # the key names a state may hold or tap
    errors: dict[str, str] = msgspec.field(default_factory=lambda: dict(ERROR_CODES))  # code -> what it means


class Error(_Out, tag="error"):
    code: str
    message: str
    retry_after_s: float | None = None
    session: str | None = None


# the stream's header (``ipc.protocol.StreamHeader``) and the frames' picture format
Watching = msgspec.defstruct("Watching", [*header_fields(), ("format", str)], bases=(_Out,), tag="watching",
                             module=__name__)


class Opened(Watching, tag="opened"):
    watch_token: str  # the page's share link carries it
    first_chunk: int  # a restored session's first chunk (its snapshot's), else 0
    restored: str | None  # the snapshot id it was restored from


class Chunk(_Out, tag="chunk"):
    """One chunk's facts as the page shows them (``web.chunks.page_chunk`` builds it from the SDK's ``ChunkResult``)."""

    session: str
    index: int
    frames: int
    keys: list[str]  # the applied control: held keys and the taps this chunk consumed, sorted
    mouse: tuple[float, float]  # applied yaw, pitch degrees over the chunk
    revision: int  # the last input revision the applied control folded in (-1: none yet)
    prompt_revision: int
    control_to_output_s: float | None  # server clock: control accepted -> frames emitted
    steps: int  # denoising steps it ran (quality, for the HUD)
    steps_changed: str | None
    gateway_input_to_photon_s: dict[str, float]  # gateway clock: revision sent -> this chunk received
    dropped: Dropped  # the gateway's playout counters
    missed: int  # chunks the server dropped for a slow watcher right before this one


class Prompt(_Out, tag="prompt"):
    session: str
    revision: int
    chunk: int


class Saved(_Out, tag="saved"):
    session: str
    snapshot: str
    chunk: int
    bytes: int
    files: int
    pause_s: float
    write_s: float
    wait_s: float


class Migrated(_Out, tag="migrated"):
    session: str
    chunk: int
    replica: str


class Draining(_Out, tag="draining"):
    """The server stops: the session was saved as ``snapshot`` at ``chunk`` and closes next (reason ``drained``);
    the page's fork link opens it again where a server serves."""

    session: str
    snapshot: str
    chunk: int


class Closed(_Out, tag="closed"):
    session: str
    reason: str | None
    error: str | None
    summary: dict[str, Any]


class Stats(_Out, tag="stats"):
    session: dict[str, Any] | None
    server: dict[str, Any]
    gateway: dict[str, int]


class Trace(_Out, tag="trace"):
    session: str
    trace: dict[str, Any]


PageMessage = Hello | Error | Opened | Watching | Chunk | Prompt | Saved | Migrated | Draining | Closed | Stats | Trace


def _builtin(value: Any) -> Any:
    if hasattr(value, "tolist"):  # a numpy value in a summary
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON")


_encoder = msgspec.json.Encoder(enc_hook=_builtin)


def encode(message: PageMessage) -> str:
    """The JSON text of a message (a NaN or infinity in a summary reads null: JSON has none)."""
    return _encoder.encode(message).decode()
