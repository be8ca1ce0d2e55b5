"""Every machine-readable error code, spelled once: what the server sends in ``error.code``, what the SDK's
``ServerError`` subclasses stand for, what the gateway tells the page (``web.page_messages.ERROR_CODES`` says what
each means to a person). A ``StrEnum``, so a member is its wire string: the maps are byte-identical, and codes read
from the wire stay plain strings (a newer peer may send a code this one does not know)."""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    # a request refused as asked (nothing changed)
    BAD_MESSAGE = "bad_message"  # not a message of the protocol, or a field out of range
    BAD_REQUEST = "bad_request"
    BAD_IMAGE = "bad_image"  # undecodable, too many pixels, or too narrow for a frame size
    BAD_CONTROL = "bad_control"  # a control this session does not take
    BAD_SNAPSHOT = "bad_snapshot"  # a restore this server cannot do
    MALFORMED = "malformed"  # a live state with a field out of range
    UNKNOWN_KEYS = "unknown_keys"  # a live state with a key the model has no control for
    STALE_REVISION = "stale_revision"  # a live state not newer than the last one taken
    REJECTED_CONTROL = "rejected_control"  # an indexed control duplicate, skipped or out of order
    UNKNOWN_SESSION = "unknown_session"
    WATCH_ONLY = "watch_only"  # a watcher sent what only the owner may
    CLOSING = "closing"  # the session is already closing
    NOT_READY = "not_ready"  # the session's caches are still being initialised
    UNAUTHORIZED = "unauthorized"  # the client did not prove who it is
    # not now: retry (``retry_after_s`` says when where the server knows)
    BUSY = "busy"
    CONTROL_BACKPRESSURE = "control_backpressure"
    PROMPT_BACKPRESSURE = "prompt_backpressure"
    DRAINING = "draining"  # the server takes no new sessions while it drains
    # failures
    FAILED = "failed"  # a stage failed for this session
    PROMPT_FAILED = "prompt_failed"
    SAVE_FAILED = "save_failed"
    INTERNAL = "internal"
    RANK_FAILED = "rank_failed"  # the job is ending
    SHUTDOWN = "shutdown"  # the job is ending
    # found by the SDK itself
    SERVER_GONE = "server_gone"  # no reply for server_silent_s, or the server restarted
    OUTBOX_FULL = "outbox_full"
    BAD_REPLY = "bad_reply"  # a reply the client cannot read
    MIGRATED = "migrated"  # not an end: a router moved the session (``SessionMigrated``, from a ``migrated`` notice)
    # found by the web gateway
    TOO_LARGE = "too_large"
    NO_SESSION = "no_session"
    NO_TRACE = "no_trace"
    SERVER_UNREACHABLE = "server_unreachable"
