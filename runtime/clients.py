"""The client front door both cores share (runtime/core.py, runtime/router.py): who the clients are, which sessions
each owns, and the rules that follow from it. Pure: no socket, no clock (``now`` comes with every call).

- **Remembered identities, bounded.** Every identity heard is remembered, for the job-wide notices (a shutdown, a
  failed rank reach clients without a session too). An identity that owns a live session is never forgotten: its
  sessions' chunks, timeout and notices depend on it, and such identities are bounded already (by the sessions the
  server or the router admits). The others are forgotten least recently heard first, one at a time, once the total
  passes ``max_peers``; so memory is at most ``max(max_peers, identities with sessions)`` and each message costs O(1)
  (no sort, no scan).
- **Ownership.** A session is reachable only by its client's identity (``owned``: else ``unknown_session``, the
  same words whether it never existed or belongs to another). Sessions are indexed by client: hearing from a client
  refreshes its sessions without a scan of every session.
- **Client timeout.** The last time each identity was heard is kept per identity (any message refreshes every
  session it owns; a new session counts as hearing from it). ``silent`` lists the sessions of identities silent
  past the timeout, oldest first, in time proportional to what it returns.
- **Gone and full.** A send that could not be queued marks the session's client gone (its messages are dropped)
  until the identity resumes it with a ``heartbeat`` naming it, while the session exists
  (closing or not: it then gets what is left, its ``closed`` included); a client that is connected but not reading
  (``full``) has its session closed at once, never buffered (``unreachable`` returns it).
- **The client token** (``unauthorized``): where one is required, a message without it is answered before
  anything above happens, so a stranger is neither heard nor remembered.
- **Job-wide notices** (``notices``): every session whose client is reachable gets the error naming it (and its
  ``closed``, when the core has one), every other remembered identity gets it without one.

What a core does with a silent or full client's session (close it through its scheduler, or ask its replica) stays
in that core.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from ipc import auth, protocol
from ipc.error_codes import ErrorCode
from runtime.client_types import ClientError, ClientSent, ClientUnreachable, ClientUnreadable, ToClient
from runtime.parts import Answer, Ending, Part

log = logging.getLogger(__name__)

MAX_PEERS = 1024  # identities remembered in all; those that own sessions are kept even beyond it


class Attached(Protocol):
    """What the front door reads and writes of a core's session."""

    id: str
    client: bytes  # the identity its messages go to
    owner: bytes  # the identity that opened it (a reconnect with it may resume)
    gone: bool  # its client cannot be reached: messages to it are dropped until it resumes


S = TypeVar("S", bound=Attached)


class Clients(Part, Generic[S]):
    """The sessions of one core by id and by client identity, and every identity heard (see the module docstring).
    ``server_id`` goes in every heartbeat ack: a client tells a restarted server apart. On rank 0 a part of each
    session (``runtime.parts``): its end removes it, after the core's last messages to its client."""

    def __init__(self, server_id: str, timeout_s: float, max_peers: int = MAX_PEERS) -> None:
        self.server_id = server_id
        self.timeout_s = timeout_s
        self.max_peers = max_peers
        self.sessions: dict[str, S] = {}
        self._of: dict[bytes, dict[str, None]] = {}  # identity -> its sessions, in the order they were added
        # identity with sessions -> last heard, oldest first
        self._with_sessions: OrderedDict[bytes, float] = OrderedDict()
        self._idle: OrderedDict[bytes, None] = OrderedDict()  # identities without a session, least recent first

    # ------------------------------------------------------------------------------------------ membership

    def heard(self, who: bytes, now: float) -> None:
        """Any message from ``who``: it is remembered, and its sessions' client timeout starts again."""
        if who in self._with_sessions:
            self._with_sessions[who] = now
            self._with_sessions.move_to_end(who)
            return
        self._idle[who] = None
        self._idle.move_to_end(who)
        self._trim()

    def add(self, session: S, now: float) -> None:
        """A new session of ``session.client`` (which counts as hearing from it)."""
        self.sessions[session.id] = session
        self._attach(session.client, session.id, now)

    def remove(self, sid: str) -> S | None:
        """The session ends; its client, once it owns no session, may be forgotten again."""
        session = self.sessions.pop(sid, None)
        if session is not None:
            self._detach(session.client, sid)
        return session

    def ending(self, sid: str, now: float, end: Ending) -> list[Answer]:
        """The session is removed; its client (unless gone) gets the core's ``farewell``."""
        session = self.remove(sid)
        if session is None or session.gone:
            return []
        return [ToClient(session.client, message, sid) for message in end.farewell]

    def of(self, who: bytes) -> list[S]:
        """The sessions ``who`` owns now, oldest first."""
        return [self.sessions[sid] for sid in self._of.get(who, ())]

    @property
    def peers(self) -> set[bytes]:
        """Every identity remembered (with sessions or not)."""
        return {*self._with_sessions, *self._idle}

    # ------------------------------------------------------------------------------------------ requests

    def owned(self, who: bytes, sid: str) -> S:
        session = self.sessions.get(sid)
        if session is None or session.client != who:
            raise ClientError(ErrorCode.UNKNOWN_SESSION, f"no session {sid!r} for this client")
        return session

    def heartbeat(self, who: bytes, message: protocol.Heartbeat, now: float) -> ToClient:
        """The answer to a ``heartbeat``: an ack with the server id; one naming a session resumes it first (its
        owner only: else ``unknown_session``): its messages go to ``who`` from now on."""
        sid = message.session
        if sid is None:
            return ToClient(who, protocol.HeartbeatAck(req=message.req, server=self.server_id))
        session = self.sessions.get(sid)
        if session is None or who not in (session.owner, session.client):
            raise ClientError(ErrorCode.UNKNOWN_SESSION, f"no session {sid!r} to resume")
        if session.client != who:
            self._detach(session.client, sid)
            session.client = who
            self._attach(who, sid, now)
        session.gone = False
        return ToClient(who, protocol.HeartbeatAck(req=message.req, session=sid, server=self.server_id))

    def refusal(self, who: bytes, error: ClientError, req: int | None, session: str | None = None,
                v: int | None = None) -> ToClient:
        """The ``error`` a refused request gets (with the request id it answers and the hint to retry; in version
        ``v`` for an SDK too old to read this one's)."""
        return ToClient(who, protocol.Error(req=req, session=session, code=error.code, v=v or protocol.PROTOCOL_VERSION,
                                            message=protocol.clip(str(error)), retry_after_s=error.retry_after_s))

    # ------------------------------------------------------------------------------------------ failures

    def unreachable(self, event: ClientUnreachable) -> S | None:
        """A send to a session's client could not be queued: the client is gone until it resumes. Returns the
        session when it must be closed now (``full``: connected but not reading, never buffered without bound)."""
        session = self.sessions.get(event.session)
        if session is None or session.client != event.identity or session.gone:
            return None
        session.gone = True
        if event.why == "gone":  # disconnected: it may reconnect and resume within the client timeout
            log.info("session %s: client disconnected; waiting %.0f s for a resume", session.id, self.timeout_s)
            return None
        log.info("session %s: client stopped reading, closing", session.id)
        return session

    def silent(self, now: float) -> list[S]:
        """The sessions of every client silent for longer than the client timeout, the longest silent first."""
        out: list[S] = []
        for who, heard in self._with_sessions.items():
            if now - heard <= self.timeout_s:
                break  # in order of last heard: every later one was heard more recently
            out += self.of(who)
        return out

    def notices(self, code: str, message: str,
                closed: Callable[[S], protocol.Closed] | None = None) -> list[ToClient]:  # fmt: skip
        """A job-wide error (``shutdown``, ``rank_failed``) for everyone: each session whose client is reachable
        gets it naming the session (then ``closed(session)`` when given), so every stream of a client ends; every
        other identity remembered (no session, or none reachable: it may have reconnected without resuming) gets it
        plain."""
        out: list[ToClient] = []
        told: set[bytes] = set()
        for session in self.sessions.values():
            if session.gone:
                continue
            told.add(session.client)
            out.append(ToClient(session.client, protocol.Error(session=session.id, code=code, message=message),
                                session.id))
            if closed is not None:
                out.append(ToClient(session.client, closed(session), session.id))
        out += [ToClient(who, protocol.Error(code=code, message=message))
                for who in (*self._with_sessions, *self._idle) if who not in told]
        return out

    # ------------------------------------------------------------------------------------------ the index

    def _attach(self, who: bytes, sid: str, now: float) -> None:
        self._idle.pop(who, None)
        self._of.setdefault(who, {})[sid] = None
        self._with_sessions[who] = now
        self._with_sessions.move_to_end(who)

    def _detach(self, who: bytes, sid: str) -> None:
        owned = self._of.get(who)
        if owned is None:
            return
        owned.pop(sid, None)
        if not owned:  # it owns nothing now: an ordinary remembered identity, the most recent one
            del self._of[who]
            del self._with_sessions[who]
            self._idle[who] = None
            self._trim()

    def _trim(self) -> None:
        while self._idle and len(self._idle) + len(self._with_sessions) > self.max_peers:
            self._idle.popitem(last=False)


# A control that met a full edge is accepted once the DiT moves on, about once per chunk period: its retry hint is
# an eighth of the session's latest period within these bounds, so an eager client does not cost rank 0 (and a
# router) a decode and a reply every 2 ms for the whole period (300 per chunk at a GPU's 0.6 s).
BACKPRESSURE_RETRY_MIN_S = 0.002
BACKPRESSURE_RETRY_MAX_S = 0.1
BACKPRESSURE_RETRY_COLD_S = 0.02  # before the session's second chunk (the cold start: nothing moves for a while)


def backpressure_retry_s(period: float | None) -> float:
    """The retry hint of ``control_backpressure`` for a session whose latest chunk period is ``period``."""
    if period is None:
        return BACKPRESSURE_RETRY_COLD_S
    return min(BACKPRESSURE_RETRY_MAX_S, max(BACKPRESSURE_RETRY_MIN_S, period / 8))


def unauthorized(token: str | None, event: ClientSent | ClientUnreadable) -> tuple[bytes, ClientError,
                                                                                   int | None] | None:  # fmt: skip
    """How a core that requires ``token`` refuses a client's message that lacks it: (client, ``unauthorized`` with
    no detail, request id), to be answered before any work; None: it goes on. An unreadable message has no token
    that could be checked, so it gets the same answer (no parser detail for a stranger)."""
    if token is None:
        return None
    if isinstance(event, ClientSent):
        if auth.accepts(token, event.message.auth):
            return None
        req: int | None = event.message.req
    else:
        req = event.req
    return event.identity, ClientError(ErrorCode.UNAUTHORIZED, auth.REFUSAL_MESSAGE), req


def checked_input(state: protocol.ControlState) -> protocol.ControlState:
    """A live input state as every trust boundary checks it (``protocol.check_input_state``): refused with its
    reason (``malformed``, ``unknown_keys``) before anything folds it into what it holds."""
    try:
        protocol.check_input_state(state)
    except protocol.InputStateError as error:
        raise ClientError(error.reason, str(error)) from None
    return state
