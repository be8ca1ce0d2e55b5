"""The drain on rank 0, as a part (``runtime.parts``): stop without losing a player. Sans-io, ``now`` passed in.

A stop signal (the first; ``DrainRequested``) or an operator's ``drain`` starts it, once. From then on:

- **No new session**: every ``open`` (a restore too) is refused ``busy`` naming the drain (a router places it on
  another replica).
- **Every session is saved** at its next chunk boundary k (``SaveSession``: the saves' machinery, its last save
  here, so chunk k is never denoised here and no chunk is streamed twice). A session that cannot be saved yet (still
  opening, a client's save in flight) is asked again ``RETRY_S`` later; one that started its last chunk runs out.
- **Handed off**: once its snapshot exists and every chunk below k left rank 0, its client gets a ``draining``
  notice naming the snapshot (a router takes it and restores the session on another replica; a client opens it
  elsewhere with ``restore``), then the session is closed here (reason ``drained``).
- **The end** (``DrainEnded``): every session it began with (and each restore that opened meanwhile) is closed, or
  ``server.drain_s`` is up; the shell then stops as on a stop signal (what is still open is closed ``shutdown``).
  A snapshot nobody restores is deleted by the folder's budget as any other.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Mapping

from ipc import auth, protocol
from ipc.error_codes import ErrorCode
from runtime.core_types import ClientError, DrainEnded
from runtime.parts import Answer, CloseSession, Hold, Part, SaveSession, ToOwner

log = logging.getLogger(__name__)

RETRY_S = 0.05  # a session that cannot be saved yet is asked again this much later (a loop turn or so)
FAILED_RETRY_S = 1.0  # a drain save that failed (a disk error) is tried again this much later ...
SAVE_TRIES = 2  # ... this many times in all; then the session streams on here until the drain's end
FIRST_REQ = -(2**40)  # the drain's saves' request ids: far below a router's own (negative, counting down from -1)
RETRY_AFTER_S = 1.0  # hint to an open refused while draining (a router tries another replica at once)
# what a save refusal means for the drain: try again later, or leave the session to run out (nothing left to save)
AGAIN = frozenset({ErrorCode.NOT_READY, ErrorCode.BUSY, ErrorCode.SAVE_FAILED})


class Drain(Part):
    """See the module docstring. ``active`` once started; ``left`` the sessions it waits for."""

    def __init__(self, drain_s: float, operator_token: str | None = None) -> None:
        self.drain_s = drain_s
        self.operator_token = operator_token  # what a ``drain`` request must carry; None: only a stop signal drains
        self.deadline: float | None = None
        self.began = 0  # sessions open when it started
        self.left: set[str] = set()  # sessions not closed yet
        self.due: dict[str, float] = {}  # sessions to save, by when the next attempt may go
        self.saving: dict[str, int] = {}  # sessions whose drain save is in flight, by its request id
        self.saved: dict[str, protocol.Saved] = {}  # saved: told once every chunk below the boundary left rank 0
        self.failures: dict[str, int] = {}  # drain saves that failed, by session
        self.handed = 0  # sessions told where to go on
        self.ended = False
        self.reqs = itertools.count(FIRST_REQ, -1)

    @property
    def active(self) -> bool:
        return self.deadline is not None

    def start(self, sessions: Iterable[str], now: float, req: int | None = None) -> protocol.Draining:
        """Begin (a repeat changes nothing): every open session is due for its save now. The answer to an
        operator's ``drain`` (``req``)."""
        if self.active:
            return self.reply(req, now)
        self.deadline = now + self.drain_s
        self.left = set(sessions)
        self.began = len(self.left)
        self.due = dict.fromkeys(self.left, now)
        log.warning("draining: %d sessions to hand off within %.1f s; no new session", self.began, self.drain_s)
        return self.reply(req, now)

    def asked(self, message: protocol.Drain, sessions: Iterable[str], now: float) -> protocol.Draining:
        """An operator's ``drain``: started (or answered, when already draining) only with the operator token;
        any other client is refused ``unauthorized`` and nothing changes."""
        if self.operator_token is None or not auth.accepts(self.operator_token, message.operator):
            raise ClientError(ErrorCode.UNAUTHORIZED, auth.REFUSAL_MESSAGE)
        return self.start(sessions, now, message.req)

    def reply(self, req: int | None, now: float) -> protocol.Draining:
        return protocol.Draining(req=req, sessions=self.began, left_s=max(0.0, (self.deadline or now) - now))

    def refusal(self) -> ClientError:
        return ClientError(ErrorCode.BUSY, "the server is draining (it stops soon): open the session on another server",
                           retry_after_s=RETRY_AFTER_S)

    # ---- lifecycle

    def opened(self, sid: str, now: float) -> list[Answer]:
        if self.active:  # a restore whose manifest was being read when the drain began
            self.left.add(sid)
            self.due[sid] = now
        return []

    def closed(self, sid: str, now: float, reason: str = "") -> list[Answer]:
        self.left.discard(sid)
        self.due.pop(sid, None)
        self.saving.pop(sid, None)
        self.saved.pop(sid, None)
        self.failures.pop(sid, None)
        return []

    # ---- the saves' answers

    def takes(self, sid: str, message: object) -> bool:
        """Whether ``message`` answers this part's save of ``sid`` (then it is the drain's, never the client's)."""
        req = getattr(message, "req", None)
        return req is not None and self.saving.get(sid) == req

    def answered(self, sid: str, message: protocol.Saved | protocol.Error, now: float) -> list[Answer]:
        del self.saving[sid]
        if isinstance(message, protocol.Saved):
            self.saved[sid] = message
            return []
        return self.refused(sid, ClientError(message.code, message.message), now)

    def refused(self, sid: str, error: ClientError, now: float) -> list[Answer]:
        """The save could not start (or failed): asked again later, or the session runs out here. A failed save
        (its tasks went out: the session's next chunk is held) is tried ``SAVE_TRIES`` times in all; after the last,
        the hold ends and the session streams on here until the drain's end."""
        self.saving.pop(sid, None)
        if error.code == ErrorCode.SAVE_FAILED:
            self.failures[sid] = self.failures.get(sid, 0) + 1
            if self.failures[sid] < SAVE_TRIES:
                self.due[sid] = now + FAILED_RETRY_S
                return []
        elif error.code in AGAIN:
            self.due[sid] = now + RETRY_S
            return []
        log.info("session %s is not saved for the drain (%s: %s); it runs out here", sid, error.code, error)
        return [Hold(sid, False)]

    # ---- timers

    def tick(self, now: float, emitted: Mapping[str, int]) -> list[Answer]:
        """``emitted``: each saved session's next chunk to leave rank 0."""
        if not self.active or self.ended:
            return []
        assert self.deadline is not None
        if now >= self.deadline or not self.left:
            self.ended = True
            why = (f"every session handed off ({self.handed} of {self.began})" if not self.left else
                   f"server.drain_s ({self.drain_s:.1f} s) is up with {len(self.left)} sessions still open")
            log.warning("drain over: %s", why)
            return [DrainEnded(why)]
        out: list[Answer] = []
        for sid, at in list(self.due.items()):
            if at <= now:
                del self.due[sid]
                self.saving[sid] = next(self.reqs)
                out.append(SaveSession(sid, self.saving[sid]))
        for sid, saved in list(self.saved.items()):
            if emitted.get(sid, saved.chunk) >= saved.chunk:  # every chunk below the boundary is out before it
                del self.saved[sid]
                self.handed += 1
                notice = protocol.Draining(session=sid, snapshot=saved.snapshot, chunk=saved.chunk)
                out += [ToOwner(sid, notice, b""), CloseSession(sid, "drained")]
        return out
