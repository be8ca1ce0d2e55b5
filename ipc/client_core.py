"""The sans-io half of the SDK (``ClientCore``), shared by ``Client`` and ``AsyncClient``: every decision a client
makes, with no socket, thread, event loop or sleep inside.

Two kinds of decisions live here. What to do with each message from the server (``route``: replies to their
requests, chunks and session events to per-session queues, watch bookkeeping, the server's silence or restart). And
what a call does, written once as a *plan*: a generator that yields the steps it needs (``Ask`` a request and wait
for its reply, ``Start`` one without waiting, ``Tell`` a fire-and-forget one, ``Pause``, take the session's
``NextEvent``) and gets back each step's outcome, or its error thrown in where it was asked. The retry policy of
``control``, the until-closed and wait-closed rules, ``next_chunk`` and what ``chunks`` yields are plans. A
transport runs a plan with ``Running`` and performs its steps its own way (``Client`` blocks on futures and queues,
``AsyncClient`` awaits them): the two SDKs cannot drift, because neither decides anything.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, Union, cast

import msgspec

from ipc import auth, chunk_wire, protocol, tolerant
from ipc.client_bounds import MAX_SESSION_ID_CHARS, Strays
from ipc.client_errors import (
    BadRequest,
    ControlBackpressure,
    ServerError,
    ServerGone,
    SessionClosed,
    SessionDraining,
    SessionMigrated,
    closed_summary,
    outbox_room,
)
from ipc.client_requests import REPLIES, Requests, _tag
from ipc.client_results import ChunkResult, InputToPhoton, SessionInfo, session_info
from ipc.error_codes import ErrorCode
from ipc.metrics_types import SessionSummary
from ipc.newer_peer import PeerReader
from ipc.outgoing import Outgoing

MAX_OUTBOX = 1024  # a caller's messages waiting to leave the socket; one more is refused with ``OutboxFull``
KEEP_QUIET_REQS = 4096  # fire-and-forget request ids remembered, so their errors do not end a chunk stream
RETRY_PAUSE_S = 0.002  # a backpressured control is sent again after this when the server gave no hint
CLOSE_POLL_S = 0.05  # waiting for a closed: how often the refusal of its request and the server's silence are read
log = logging.getLogger("worldstream.client")

# ------------------------------------------------------------------------------------------------ plans and steps


@dataclass(frozen=True)
class Ask:
    """Send a request and wait at most ``timeout_s`` for its reply: the reply comes back, or its error (a
    ``TimeoutError`` when none came) is raised where the plan asked."""

    message: Any
    timeout_s: float


@dataclass(frozen=True)
class Start:
    """Send a request whose reply is not waited for here: its ``PendingReply`` comes back at once."""

    message: Any


@dataclass(frozen=True)
class Tell:
    """Send a fire-and-forget request: its error goes to ``error()``, never to the plan or a chunk stream."""

    message: Any


@dataclass(frozen=True)
class Pause:
    seconds: float


@dataclass(frozen=True)
class NextEvent:
    """The session's next event (``ChunkResult``, ``protocol.Closed`` or ``ServerError``) within ``timeout_s``."""

    session: str
    timeout_s: float

    def late(self) -> TimeoutError:
        """What the transport raises when no event came in time."""
        return TimeoutError(f"no chunk of session {self.session} within {self.timeout_s:.1f} s")


Step = Union[Ask, Start, Tell, Pause, NextEvent]  # noqa: UP007
T = TypeVar("T")
Plan = Generator[Step, Any, T]


class Running(Generic[T]):
    """A plan being run by a transport: ``step`` is what it asks for now; once ``done``, ``result`` is what it
    returned. An error the plan does not catch leaves ``answer`` (or the constructor) as it is."""

    def __init__(self, plan: Plan[T]) -> None:
        self._plan = plan
        self.done = False
        self._result: T | None = None
        self.step: Step = cast(Step, None)
        self._go(lambda: next(plan))

    def answer(self, outcome: Any, error: BaseException | None = None) -> None:
        """The outcome of ``step``, or the error performing it raised (thrown into the plan where it asked)."""
        self._go(lambda: self._plan.send(outcome) if error is None else self._plan.throw(error))

    @property
    def result(self) -> T:
        return cast(T, self._result)

    def _go(self, move: Callable[[], Step]) -> None:
        try:
            self.step = move()
        except StopIteration as stop:
            self.done, self._result = True, stop.value


class EventQueue(Protocol):
    """Where a session's events go: a ``queue.Queue`` (``Client``) or an ``asyncio.Queue`` (``AsyncClient``)."""

    def put_nowait(self, item: Any, /) -> None: ...

    def empty(self) -> bool: ...


class PendingReply(Protocol):
    """A request waiting for its reply: a ``concurrent.futures.Future`` (``Client``) or an ``asyncio.Future``
    (``AsyncClient``)."""

    def done(self) -> bool: ...

    def set_result(self, result: Any, /) -> None: ...

    def set_exception(self, exception: BaseException, /) -> None: ...

    def exception(self) -> BaseException | None: ...

    def cancel(self) -> bool: ...


Q = TypeVar("Q", bound=EventQueue)
F = TypeVar("F", bound=PendingReply)


@dataclass
class SessionState(Generic[Q]):
    events: Q  # ChunkResult, protocol.Closed or ServerError, in arrival order
    closed: protocol.Closed | None = None
    photon: InputToPhoton = field(default_factory=InputToPhoton)  # touched by the receiving side only
    missed: int = 0  # watching: chunks dropped for this client since the last one it got (``protocol.Missed``)
    migrated: protocol.Migrated | None = None  # a migrated notice not yet followed by a chunk
    draining: protocol.Draining | None = None  # the server drains: the session's snapshot to restore elsewhere


class ClientCore(Generic[Q, F]):
    """The I/O-free half shared by ``Client`` and ``AsyncClient``: the pending requests, the fire-and-forget
    request ids, the per-session state, and what is done with each message from the server (``route``).

    Chunks and ``closed`` go to their session's event queue (with input-to-photon bookkeeping), heartbeat acks are
    dropped, replies resolve the pending request with their ``req``. An error goes to its pending request; else,
    when it names a session and was not caused by a fire-and-forget request, it also ends that session's stream;
    it always reaches ``put_error`` then. The calls' decisions are plans (see the module docstring); the clients
    differ only in the queue type (``new_events``), the future type they register with ``expect``, ``put_error``,
    and how they perform a plan's steps. One lock guards the state, so the blocking client's callers and its I/O
    thread may share a core (the asyncio client uses it from its loop only)."""

    def __init__(self, new_events: Callable[[], Q], put_error: Callable[[ServerError], None],
                 clock: Callable[[], float] = time.monotonic,
                 close_orphan: Callable[[str], None] | None = None, token: str | None = None) -> None:
        self.token = token  # the client token every message carries as its ``auth`` (``ipc.auth``); None: none
        self.requests = Requests()  # every request either client sends, with its request id
        self._new_events = new_events
        self._put_error = put_error
        self._close_orphan = close_orphan  # sends ``close`` for a session opened after its caller stopped waiting
        self._clock = clock
        self._heard = clock()  # the last message from the server (any kind; heartbeat acks at least once a beat)
        self._server_id = ""  # from heartbeat acks: a different one means the server restarted
        self._gone = False
        self._lock = threading.Lock()
        self._pending: dict[int, F] = {}
        self._replies: dict[int, tuple[type, ...]] = {}  # req -> the kinds of reply its request takes
        self._quiet: OrderedDict[int, None] = OrderedDict()  # fire-and-forget reqs (bounded)
        self._sessions: dict[str, SessionState[Q]] = {}
        self._strays = Strays()  # the sessions only the server named (bounded: ``ipc.client_bounds``)
        self._reader = PeerReader("server", max_bytes=1 << 31)  # read by ``route`` only (the I/O side)

    # ------------------------------------------------------------------------------------------ plans

    def control(self, session: str, index: int, control: protocol.ChunkControl, wait: bool, steps: int | None,
                timeout_s: float) -> Plan[None]:
        """Send control[index] (``Client.control``; its keyword form is built by ``chunk_control``). The retry
        policy: a control that meets a full edge (``ControlBackpressure``) is sent again, as a new request, after the
        server's hint until it is accepted or ``timeout_s`` passed. Invalid steps raise ``BadRequest`` before
        anything is sent."""
        if (problem := protocol.steps_problem(steps)) is not None:
            raise BadRequest(ErrorCode.BAD_CONTROL, problem, session)
        deadline = self._clock() + timeout_s
        while True:
            message = self.requests.control(session, index, control, steps)
            if not wait:
                yield Tell(message)
                return
            try:
                yield Ask(message, max(0.0, deadline - self._clock()))
                return
            except ControlBackpressure as error:
                if self._clock() > deadline:
                    raise
                yield Pause(error.retry_after_s or RETRY_PAUSE_S)

    def watch(self, session: str, token: str, timeout_s: float) -> Plan[SessionInfo]:
        """Subscribe to another client's session (``Client.watch``): the session's geometry."""
        state = self.session(session)
        state.closed, state.missed = None, 0  # a session watched again after an unwatch
        return session_info((yield Ask(self.requests.watch(session, token), timeout_s)))

    def until_closed(self, message: protocol.Close | protocol.Unwatch, timeout_s: float) -> Plan[SessionSummary]:
        """Send a ``close`` or ``unwatch`` and return the session's summary once its ``closed`` came. An error
        answering the request ends the wait by raising it (see ``wait_closed``)."""
        if isinstance(message, protocol.Unwatch):
            self.session(message.session).closed = None  # the closed that ends this watch, not an earlier one
        refused = yield Start(message)
        try:
            return (yield from self.wait_closed(message.session, timeout_s, refused))
        finally:  # a reply that comes later finds no one waiting (and frees its in-flight slot)
            self.forget(message.req)
            if not refused.done():
                refused.cancel()

    def wait_closed(self, session: str, timeout_s: float, refused: PendingReply | None = None) -> Plan[SessionSummary]:
        """Discard chunks until the session's ``closed`` arrives: its summary. ``refused``: a request whose error ends
        the wait by raising it, except ``closing`` (the session was closing already: its closed follows). The
        server's end raises; a server this client finds silent raises ``ServerGone`` (no closed will come)."""
        deadline = self._clock() + timeout_s
        while True:
            error = refused.exception() if refused is not None and refused.done() else None
            if error is not None and getattr(error, "code", None) != ErrorCode.CLOSING:
                raise error
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise TimeoutError(f"session {session} not closed within {timeout_s:.1f} s")
            try:
                yield from self.next_chunk(session, min(remaining, CLOSE_POLL_S))
            except SessionClosed as closed:
                return closed_summary(closed.closed)
            except ServerGone as gone:
                if gone.code == ErrorCode.SERVER_GONE:  # found by this client: no closed will come
                    raise
            except TimeoutError:
                if self.silent:  # nothing queued, and the server no longer answers
                    raise ServerGone(ErrorCode.SERVER_GONE, f"no reply from the server: session {session} cannot be "
                                     "closed") from None
            except ServerError:
                continue

    def next_chunk(self, session: str, timeout_s: float) -> Plan[ChunkResult]:
        """The session's next chunk; ``SessionClosed`` at its end (at once when it ended and nothing is left), its
        errors raised, ``SessionMigrated`` once per move."""
        state = self.session(session)
        if state.closed is not None and state.events.empty():
            raise SessionClosed(state.closed)
        event = yield NextEvent(session, timeout_s)
        if isinstance(event, ChunkResult):
            return event
        if isinstance(event, protocol.Closed):
            raise SessionClosed(event)
        raise event

    def streamed(self, session: str, timeout_s: float) -> Plan[ChunkResult | SessionMigrated | None]:
        """What ``chunks`` does next: yield a chunk, hand a migration to ``on_migrated`` (no end: the chunks go on
        from its resume chunk), or end (``None``: the session closed); other errors raise."""
        try:
            return (yield from self.next_chunk(session, timeout_s))
        except SessionMigrated as moved:
            return moved
        except SessionClosed:
            return None

    def tell(self, message: Any) -> bytes:
        """A fire-and-forget request, encoded: its error will go to ``put_error`` only, never end a chunk stream."""
        self.quiet(message.req)
        return self.encode(message)

    def encode(self, message: Any) -> bytes:
        """A request as it leaves: with the client token, when there is one (else the very bytes of before)."""
        if self.token is not None:
            message = msgspec.structs.replace(message, auth=self.token)
        return protocol.encode(message)

    def live_state(self, session: str, state: protocol.InputState,
                   steps: int | None = None) -> tuple[bytes, tuple[str, int]]:  # fmt: skip
        """A live ``control_state`` (fire and forget), encoded, with the stamp that starts its revision's
        input-to-photon clock as it leaves the socket (``sent``)."""
        return self.tell(self.requests.control_state(session, state, steps)), (session, state.revision)

    # ------------------------------------------------------------------------------------------ state

    def session(self, session: str) -> SessionState[Q]:
        """The state of a session the caller asks for (made when new; the caller's from now on)."""
        with self._lock:
            self._strays.adopt(session)
            state = self._sessions.get(session)
            if state is None:
                state = self._sessions[session] = SessionState(self._new_events())
            return state

    def _named(self, session: str) -> SessionState[Q]:
        """The state of a session a server message names: a new one is a stray, the oldest past the bound
        dropped."""
        with self._lock:
            state = self._sessions.get(session)
            if state is None:
                state = self._sessions[session] = SessionState(self._new_events())
                if (given_up := self._strays.add(session)) is not None:
                    del self._sessions[given_up]
            return state

    def expect(self, req: int, future: F, request: type | None = None) -> F:
        """Register ``future`` to be resolved by the reply (or error) with request id ``req``; a reply of another
        kind than a ``request`` is answered with (``REPLIES``) fails it as ``bad_reply``."""
        with self._lock:
            self._pending[req] = future
            if request is not None:
                self._replies[req] = REPLIES.get(request, ())
        return future

    def forget(self, req: int) -> None:
        with self._lock:
            self._pending.pop(req, None)
            self._replies.pop(req, None)

    def quiet(self, req: int) -> None:
        """``req`` is fire-and-forget: its error goes to ``put_error`` only and does not end a chunk stream."""
        with self._lock:
            self._quiet[req] = None
            while len(self._quiet) > KEEP_QUIET_REQS:
                self._quiet.popitem(last=False)

    def sent(self, stamp: tuple[str, int] | None) -> None:
        """A message left the socket; a live ``stamp`` (session, revision) starts that revision's
        input-to-photon clock."""
        if stamp is not None:
            self.session(stamp[0]).photon.sent(stamp[1], self._clock())

    @property
    def silent(self) -> bool:
        """The server is silent past the limit now (``ServerGone`` was raised and nothing came since)."""
        return self._gone

    def check_server(self, silent_after_s: float) -> None:
        """Called by the I/O loop: a server silent for ``silent_after_s`` (no heartbeat ack, nothing) is gone."""
        silent = self._clock() - self._heard
        if not self._gone and silent > silent_after_s:
            self._server_gone(f"no reply from the server for {silent:.1f} s: it is down or unreachable")

    def _server_gone(self, why: str, fail_requests: bool = True) -> None:
        """Every open session's stream ends with ``ServerGone``, and every waiting request fails unless
        ``fail_requests`` is False (after a restart: those reached the new server, which will answer them)."""
        self._gone = True
        error = ServerGone(ErrorCode.SERVER_GONE, why)
        with self._lock:
            pending = list(self._pending.values()) if fail_requests else []
            if fail_requests:
                self._pending, self._replies = {}, {}
            open_sessions = [s for s in self._sessions.values() if s.closed is None]
        for future in pending:
            if not future.done():
                future.set_exception(error)
        for state in open_sessions:
            state.events.put_nowait(error)
        self._put_error(error)

    def route(self, parts: Sequence[Any] | bytes) -> None:
        """One message from the server: its ZeroMQ parts as received (``zmq.Frame``, bytes or any buffer; a chunk's
        frames are a part of their own, ``ipc.chunk_wire``), or the bytes of a message of one part. Whatever it holds,
        the I/O thread that calls this lives on: a message this client cannot act on is a ``bad_reply`` error, never
        the end of every later call."""
        try:
            self._route((parts,) if isinstance(parts, bytes | bytearray | memoryview) else parts)
        except Exception as error:
            log.exception("a reply from the server could not be handled")
            self._put_error(ServerError.of(ErrorCode.BAD_REPLY,
                                           f"a reply could not be handled ({type(error).__name__})"))

    def _route(self, parts: Sequence[Any]) -> None:
        self._heard = self._clock()
        self._gone = False  # answering again (a restart is told apart by its id below)
        try:
            message = self._reader.decode(memoryview(parts[0]))  # a newer server's additions skipped (no extra cost)
            if isinstance(message, protocol.Chunk):
                frames = chunk_wire.frames_of(message, parts)  # a view on the received part, no copy
            elif not isinstance(message, tolerant.Unknown):
                chunk_wire.one_message(parts, type(message).__struct_config__.tag)
        except protocol.ProtocolViolation as error:
            self._put_error(ServerError.of(ErrorCode.BAD_REPLY, str(error)))
            return
        if isinstance(message, tolerant.Unknown):
            return
        if len(getattr(message, "session", None) or "") > MAX_SESSION_ID_CHARS:  # names no session of ours
            self._put_error(ServerError.of(ErrorCode.BAD_REPLY, f"a {type(message).__name__} names a session id of "
                                           f"{len(message.session)} characters"))
            return
        if isinstance(message, protocol.HeartbeatAck) and message.server:
            if self._server_id and message.server != self._server_id:
                self._server_gone("the server restarted: the sessions of its previous run are gone",
                                  fail_requests=False)
                self._gone = False
            self._server_id = message.server
        if isinstance(message, protocol.Chunk):
            received = self._clock()
            state = self._named(message.session)
            facts = message.facts
            photon = state.photon.shown(facts.control.revision, received)
            missed, state.missed = state.missed, 0
            migrated, state.migrated = state.migrated, None
            state.events.put_nowait(ChunkResult(message.session, facts.index, frames, facts.control, facts,
                                                received, photon, missed, migrated))
            return
        if isinstance(message, protocol.Migrated):  # the session goes on: its stream says where from
            state = self._named(message.session)
            state.migrated = message
            state.events.put_nowait(SessionMigrated.of_notice(message))
            return
        if isinstance(message, protocol.Draining) and message.session is not None:  # its end here, and where next
            state = self._named(message.session)
            state.draining = message
            state.events.put_nowait(SessionDraining.of_notice(message))
            return
        if isinstance(message, protocol.Missed):
            self._named(message.session).missed += message.chunks
            return
        if isinstance(message, protocol.Closed):
            state = self._named(message.session)
            state.closed = message
            state.events.put_nowait(message)
            return
        if isinstance(message, protocol.HeartbeatAck) and message.req == 0:
            return
        req = getattr(message, "req", None)
        with self._lock:
            future = self._pending.pop(req, None) if req is not None else None
            replies = self._replies.pop(req, ()) if req is not None else ()
            quiet = req in self._quiet
            self._quiet.pop(req, None)
        if future is not None and future.done():  # an asyncio request that timed out or was cancelled meanwhile
            future = None
        if isinstance(message, protocol.Error):
            error = ServerError.from_wire(message)
            if future is not None:
                future.set_exception(error)
            elif message.session is not None and not quiet:
                # the session's own failure (or the server's end): it ends the session's chunk stream
                self._named(message.session).events.put_nowait(error)
                self._put_error(error)
            else:
                self._put_error(error)
            return
        if future is not None and replies and not isinstance(message, replies):
            future.set_exception(ServerError.of(ErrorCode.BAD_REPLY, f"a {_tag(type(message))!r} answered request "
                                                f"{req}, which takes {' or '.join(repr(_tag(r)) for r in replies)}"))
        elif future is not None:
            if isinstance(message, protocol.Opened):  # its chunks follow at once: the caller's before it reads
                self.session(message.session)
            future.set_result(message)
        elif isinstance(message, protocol.Opened) and self._close_orphan is not None:
            self._close_orphan(message.session)  # its open timed out or failed here: close it, never leak it


# ------------------------------------------------------------------------------------------------ settings


class ClientSettings:
    """What both transports are configured with, and the one outbox rule (``ipc.outgoing``): a caller's messages
    beyond ``max_outbox`` are refused with ``OutboxFull`` (never the client's own), live states take one slot a
    session. ``Client`` and ``AsyncClient`` build on it."""

    def __init__(self, endpoint: str, identity: bytes | None, timeout_s: float, heartbeat_s: float,
                 server_silent_s: float, max_outbox: int, name: str, token: str | None = None,
                 token_file: str | None = None) -> None:  # fmt: skip
        self.endpoint = endpoint
        # what a server or router beyond loopback requires (``auth.client_token``: the argument, the file, else
        # $WORLDSTREAM_TOKEN or $WORLDSTREAM_TOKEN_FILE); None: the client sends none
        self.token = auth.client_token(token, token_file)
        # random and long: a server hands an identity's connection to whoever connects with it (to resume at once)
        self.identity = identity or f"{name}-{uuid.uuid4().hex}".encode()
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.server_silent_s = server_silent_s  # no reply this long (heartbeats included): ``ServerGone``
        self.max_outbox = max_outbox  # messages of callers waiting to leave the socket: more raise ``OutboxFull``
        self._outbox = Outgoing(max_outbox, lambda waiting: outbox_room(waiting, max_outbox, endpoint))

    def _timeout(self, timeout_s: float | None) -> float:
        """A call's timeout: its own, or the client's."""
        return self.timeout_s if timeout_s is None else timeout_s
