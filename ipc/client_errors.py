"""The SDK's errors: every error from the server is a ``ServerError`` (a subclass per code a caller may act on),
built by ``ServerError.of``; ``SessionClosed`` ends a session's stream. Shared by ``Client`` and ``AsyncClient``."""

from __future__ import annotations

import msgspec

from ipc import protocol
from ipc.client_bounds import MAX_CODE_CHARS, clipped
from ipc.error_codes import ErrorCode
from ipc.metrics_types import SessionSummary


class ServerError(Exception):
    """The server answered with an error. ``code`` is machine-readable, ``message`` says why for people,
    ``retry_after_s`` is set when trying again later can work. Subclasses exist per code a caller may act on;
    ``ServerError.of(code, ...)`` builds the right one (unknown codes give the base class)."""

    codes: tuple[ErrorCode, ...] = ()

    def __init__(self, code: str, message: str, session: str | None = None, retry_after_s: float | None = None,
                 req: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.session = session
        self.retry_after_s = retry_after_s
        self.req = req

    @staticmethod
    def of(code: str, message: str, session: str | None = None, retry_after_s: float | None = None,
           req: int | None = None) -> ServerError:
        return _ERROR_TYPES.get(code, ServerError)(code, message, session, retry_after_s, req)

    @staticmethod
    def from_wire(error: protocol.Error) -> ServerError:
        return ServerError.of(clipped(error.code, MAX_CODE_CHARS), clipped(error.message), error.session,
                              error.retry_after_s, error.req)


class Busy(ServerError):
    """The server is at its session limit; ``retry_after_s`` says when to try again."""

    codes = (ErrorCode.BUSY,)


class UnknownSession(ServerError):
    """No such session for this client (never opened, closed, timed out, or owned by another identity)."""

    codes = (ErrorCode.UNKNOWN_SESSION,)


class RejectedControl(ServerError):
    """An indexed control was refused (duplicate, skip, out of order or out of range); nothing changed."""

    codes = (ErrorCode.REJECTED_CONTROL,)


class ControlBackpressure(RejectedControl):
    """The control edge is full; the same control will be accepted once work moves on (``Client.control``
    retries these itself)."""

    codes = (ErrorCode.CONTROL_BACKPRESSURE,)


class BadRequest(ServerError):
    """The request itself is invalid: malformed message, bad image, bad control or live state, bad limits."""

    codes = (ErrorCode.BAD_MESSAGE, ErrorCode.BAD_REQUEST, ErrorCode.BAD_IMAGE, ErrorCode.BAD_CONTROL,
             ErrorCode.MALFORMED, ErrorCode.UNKNOWN_KEYS, ErrorCode.BAD_REPLY)


class StaleRevision(BadRequest):
    """A live ``control_state`` whose revision is not newer than the last one the server folded in."""

    codes = (ErrorCode.STALE_REVISION,)


class PromptBackpressure(ServerError):
    """Too many prompt changes of the session wait for their first chunk; ``retry_after_s`` says when to retry."""

    codes = (ErrorCode.PROMPT_BACKPRESSURE,)


class SessionFailed(ServerError):
    """A stage failed for this session; the server closes it and releases its caches."""

    codes = (ErrorCode.FAILED,)


class ServerGone(ServerError):
    """The server is shutting down or a rank died (codes from the server), or it stopped answering heartbeats or
    restarted (``server_gone``, found by the client itself): every session of it ends."""

    codes = (ErrorCode.SHUTDOWN, ErrorCode.RANK_FAILED, ErrorCode.SERVER_GONE)


class OutboxFull(ServerError):
    """Found by the client itself: ``max_outbox`` messages already wait to leave its socket (the server does not take
    them: down, unreachable, or slower than the caller). Nothing was sent and nothing queued; send again later (live
    input is never refused: its newest state waits in one slot per session)."""

    codes = (ErrorCode.OUTBOX_FULL,)


class WatchOnly(ServerError):
    """This client watches the session: it cannot send its controls or close it (only its owner can)."""

    codes = (ErrorCode.WATCH_ONLY,)


class SessionMigrated(ServerError):
    """Not an end: the session's replica went down and the router restored it on ``replica`` from its latest
    snapshot. Its chunks come again from ``chunk`` on (the same frames, given the same controls); its indexed
    controls go on from ``chunk`` (one below it is refused); live input goes on as it was."""

    codes = (ErrorCode.MIGRATED,)
    chunk: int = 0  # the chunk it resumes from: the next chunk and control index
    replica: str = ""  # the router's name of the replica it runs on now

    @staticmethod
    def of_notice(notice: protocol.Migrated) -> SessionMigrated:
        error = SessionMigrated(ErrorCode.MIGRATED, f"session {notice.session} resumed from chunk {notice.chunk} on "
                                f"replica {notice.replica} (its replica went down)", notice.session)
        error.chunk, error.replica = notice.chunk, notice.replica
        return error


class SessionDraining(ServerError):
    """The end of the session on this server, with where it goes on: the server drains (it stops soon) and saved
    the session as ``snapshot`` at ``chunk``; every chunk below ``chunk`` came before this. Open it on another server
    with ``open(restore=snapshot)`` (an indexed session sends its controls from ``chunk``): it goes on from there,
    the same frames given the same controls. The session's ``closed`` (reason ``drained``) follows here."""

    codes = (ErrorCode.DRAINING,)
    snapshot: str = ""
    chunk: int = 0  # the snapshot's boundary: the restored session's first chunk

    @staticmethod
    def of_notice(notice: protocol.Draining) -> SessionDraining:
        error = SessionDraining(ErrorCode.DRAINING, f"the server drains: session {notice.session} was saved as "
                                f"snapshot {notice.snapshot} at chunk {notice.chunk}; restore it on another server",
                                notice.session)
        error.snapshot, error.chunk = notice.snapshot or "", notice.chunk or 0
        return error


class SaveFailed(ServerError):
    """A ``save`` did not complete (a rank could not copy or write its state, or the session ended meanwhile): no
    snapshot; the session streams on."""

    codes = (ErrorCode.SAVE_FAILED,)


class BadSnapshot(BadRequest):
    """An ``open(restore=...)`` this server cannot do: the message names what differs (model, layout, DiT degree,
    frame size, format) or what is wrong with the files."""

    codes = (ErrorCode.BAD_SNAPSHOT,)


_ERROR_TYPES: dict[str, type[ServerError]] = {
    code: cls for cls in (Busy, UnknownSession, RejectedControl, ControlBackpressure, BadRequest, StaleRevision,
                          SessionFailed, ServerGone, OutboxFull, PromptBackpressure, WatchOnly, SaveFailed,
                          BadSnapshot, SessionDraining) for code in cls.codes
}
# The codes ``ServerError.of`` answers with the base class: nothing a caller would do differs from any other error
# (``internal``, ``closing``, ``not_ready``, ``prompt_failed``, ``unauthorized``), or the SDK never
# raises them (the web gateway's own, told to the page only). ``SessionMigrated`` is built from its notice.
BASE_CLASS_CODES: frozenset[ErrorCode] = frozenset({
    ErrorCode.INTERNAL, ErrorCode.CLOSING, ErrorCode.NOT_READY, ErrorCode.PROMPT_FAILED, ErrorCode.UNAUTHORIZED,
    ErrorCode.TOO_LARGE, ErrorCode.NO_SESSION, ErrorCode.NO_TRACE, ErrorCode.SERVER_UNREACHABLE,
})


class SessionClosed(Exception):
    """The session ended; ``summary`` holds its metrics."""

    def __init__(self, closed: protocol.Closed) -> None:
        super().__init__(f"session {closed.session} closed: {closed.reason}" + (f" ({closed.error})" if closed.error
                                                                                 else ""))
        self.closed = closed


def closed_summary(closed: protocol.Closed) -> SessionSummary:
    """A session's closing summary with its reason and error folded in (what ``wait_closed`` returns); a closed
    without a summary of its own (a watcher's) gives an empty one."""
    summary = closed.summary if isinstance(closed.summary, SessionSummary) else SessionSummary()
    return msgspec.structs.replace(summary, reason=closed.reason, error=closed.error)


def outbox_room(waiting: int, limit: int, endpoint: str) -> None:
    """``OutboxFull`` when ``waiting`` messages already wait to leave for ``endpoint`` (``limit`` at the most)."""
    if waiting >= limit:
        raise OutboxFull(ErrorCode.OUTBOX_FULL, f"{waiting} messages already wait to be sent to {endpoint}: the "
                         "server is not taking them (down, unreachable or slower than this client); nothing was sent")
