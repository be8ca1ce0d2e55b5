"""The router core: many unchanged worldstream jobs (replicas) behind one client endpoint, as a sans-io state machine.

``RouterCore.step(events, now)`` takes what happened (client messages, replica messages, registrations, sends that
could not be queued, timer turns; ``runtime.router_types``) and returns what the shell must do, in order. No socket,
thread or clock inside. The router is one client of each replica: everything between them is the client protocol.
Rules that live here and nowhere else:

- **One server's protocol.** Clients see exactly what a server says. The shell decodes their messages with the same
  ``protocol.decode`` and limits, so bad input gets the same ``bad_message`` text; an unknown or foreign session gets
  the same ``unknown_session``. The router answers by itself: ``heartbeat`` (naming a session: a resume of a
  session this identity owns), ``stats`` (aggregated: ``stats``) and ``busy`` (every replica full or down, with
  ``router.busy_retry_s`` as the hint). ``open`` goes where ``runtime.replicas.choose`` says, under a router request
  id; its answer goes back with the client's. ``control``, ``control_state`` and ``close`` go to the session's
  replica exactly as they came, and so do the replies naming the session (``chunk``, ``accepted``, ``closed``,
  its errors): a chunk's frames are never decoded, copied or re-encoded.
- **Session ids are the replicas' own** (random, 12 hex digits), so nothing on the chunk path is rewritten (but for a
  migrated session, below). The router holds each id once: an ``opened`` whose id another replica's session already
  has is closed on its replica and the client told to open again. An ``opened`` nobody waits for any more is closed
  on its replica at once.
- **Sessions outlive their replica** (``router.snapshot_every = K``; a draining replica's ``draining`` notices):
  autosave, migration and prompt replay are the migration part's (``runtime.router_migration``). The core places
  a restore as any open and moves the session to its new replica; the part answers the rest.
- **Membership** (``runtime.replicas``: register, identify, up/down, reincarnation): the core carries out what a
  replica's record decides. A replica that goes down costs its sessions (each ends with an error naming the replica
  and a ``closed``, unless it migrates), its unanswered opens are placed elsewhere, and its connection is fresh.
- **Clients** (``runtime.clients``, the front door shared with the coordinator core): sessions of a client silent
  for ``router.client_timeout_s`` are closed on their replicas (the router keeps its replica connections alive with
  its own heartbeats, so this rule must live here; their client counts as gone: the replica's ``closed`` names the
  router's close, not the client's). A client that is gone has its chunks dropped until it resumes; one that stops
  reading has its session closed, never buffered. A message meeting a full replica link gets what a server would
  answer: a ``control`` ``control_backpressure``; a ``close`` nothing (sent again until the replica's ``closed``
  comes); a ``control_state`` nothing (checked, folded with later ones, sent when the link drains).
- **Spectators** are the router's own (``runtime.watchers``): it keeps each forwarded ``opened``'s watch token,
  answers ``watch``/``unwatch`` itself and hands each chunk, as received, to its watchers' feeds in the shell (a
  replica sends every chunk once). Sessions ending here end their watchers too.
- **Containment and bounds.** A bad request gets an error and changes nothing. Sessions and pending opens are bounded
  by the replicas' capacities, identities by ``MAX_PEERS``, replicas by ``max_replicas``, rejects by ``MAX_REASONS``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

import msgspec

from ipc import protocol
from ipc.error_codes import ErrorCode
from ipc.metrics_types import Distribution, PartialSummary, RouterCounters, ServerStats, SessionCounts
from runtime.chunk_claims import migration_problem, open_problem
from runtime.clients import Clients, checked_input, unauthorized
from runtime.core_types import EXIT_OK, ClientError
from runtime.replicas import (
    Replica,
    ReplicaStatsReply,
    State,
    UnusableStats,
    choose,
    read_stats,
    registration_problem,
    summary,
    totals,
)
from runtime.router_config import ReplicaEntry, RouterSection, chunk_limit
from runtime.router_migration import NOT_NOW, SESSION_RETRY_S, Migration, Moves
from runtime.router_sessions import PendingOpen, RoutedSession
from runtime.router_types import (
    ChunkHead,
    ClientSent,
    ClientUnreachable,
    ClientUnreadable,
    Connect,
    Disconnect,
    EndWatch,
    Event,
    OpenOrigin,
    Output,
    Payload,
    RegisterSent,
    RegisterUnreadable,
    ReplicaDown,
    ReplicaRefused,
    ReplicaSent,
    ReplicaUp,
    SessionOrigin,
    ShellTimes,
    ShutdownRequested,
    Stop,
    Tick,
    ToClient,
    ToRegistrant,
    ToReplica,
    ToWatchers,
)
from runtime.watchers import Watchers

log = logging.getLogger(__name__)

MAX_REASONS = 32  # distinct reject codes counted; more count as "other"
ENDING_CODES = frozenset({ErrorCode.RANK_FAILED, ErrorCode.SHUTDOWN})  # a replica says its whole job is ending


class RouterCore:
    """See the module docstring. ``step`` once per loop turn; the first returns the listed replicas' ``Connect``."""

    def __init__(self, config: RouterSection, listed: Sequence[ReplicaEntry], now: float,
                 new_req: Callable[[], int] | None = None, router_id: str = "", auth_token: str | None = None) -> None:
        self.config = config
        self.auth_token = auth_token  # every client request must carry it (``ipc.auth``); None: none required
        self.id = router_id  # in every heartbeat ack, as a server's id: a client sees a restarted router
        self.started = now
        self.replicas: dict[str, Replica] = {}
        self.clients: Clients[RoutedSession] = Clients(router_id, config.client_timeout_s)
        self.watchers = Watchers(config.max_watchers, config.client_timeout_s)  # fed by the router itself
        self.opens: dict[int, PendingOpen] = {}
        self.new_req = new_req or itertools.count(1).__next__
        self.sessions_total = 0
        self.chunks_forwarded = 0
        self.client_messages = 0
        self.hold_s = Distribution()  # the shell's measure of a chunk's stay in the router (``ShellTimes``)
        self.watch_dropped = 0  # chunks the shell dropped for slow watchers (``ShellTimes``)
        self.rejects: dict[str, int] = {}
        self.migration = Migration(config, self.new_req)  # autosave, migration, prompt replay: a part
        self.stopped = False
        self._out: list[Output] = []
        for entry in listed:
            self._add(entry.name, entry.endpoint, entry.max_sessions, True, now)

    # ---------------------------------------------------------------------------------------------- step

    def step(self, events: Iterable[Event], now: float) -> list[Output]:
        """Handle ``events`` (all at time ``now``); the outputs in the order the shell must carry them out."""
        for event in events:
            if self.stopped:
                break
            try:
                self._handle(event, now)
            except Exception:  # a bug outside any request (requests are guarded): keep routing
                log.exception("internal error handling %s", type(event).__name__)
        out, self._out = self._out, []
        return out

    def _handle(self, event: Event, now: float) -> None:
        match event:
            case ClientSent() | ClientUnreadable() if refused := unauthorized(self.auth_token, event):
                self._refuse(*refused)  # before anything: the client is not even heard
            case ClientSent():
                self._from_client(event, now)
            case ClientUnreadable(identity=who, error=error, req=req, v=v):
                self.clients.heard(who, now)
                self._refuse(who, ClientError(ErrorCode.BAD_MESSAGE, error), req, v=v)
            case ClientUnreachable():
                self._unreachable(event, now)
            case ReplicaSent():
                self._from_replica(event, now)
            case ReplicaRefused():
                self._refused(event, now)
            case RegisterSent(peer=peer, message=message):
                self._register(peer, message, now)
            case RegisterUnreadable(peer=peer, error=error):
                self._emit(ToRegistrant(peer, protocol.Registered(ok=False, message=error)))
            case Tick():
                self._timers(now)
            case ShellTimes(hold_s=hold, watch_dropped=dropped):
                self.hold_s, self.watch_dropped = hold, dropped
            case ShutdownRequested():
                self._shutdown(now)

    def _emit(self, output: Output) -> None:
        self._out.append(output)

    # ---------------------------------------------------------------------------------------------- clients

    def _from_client(self, event: ClientSent, now: float) -> None:
        who, message = event.identity, event.message
        self.client_messages += 1
        self.clients.heard(who, now)
        self.watchers.heard(who, now)
        req, sid = getattr(message, "req", None), getattr(message, "session", None)
        try:
            self._request(who, message, event.raw, now)
        except ClientError as error:
            self._refuse(who, error, req, sid)
        except Exception as error:  # a bug costs this request, never the router
            log.exception("internal error handling %s", type(message).__name__)
            self._refuse(who, ClientError(ErrorCode.INTERNAL, f"internal error: {type(error).__name__}"), req, sid)

    def _request(self, who: bytes, message: protocol.ClientMessage, raw: Payload, now: float) -> None:
        req = getattr(message, "req", None)
        if isinstance(req, int) and req < 0:  # the router's own requests to replicas (saves, prompts) are negative
            raise ClientError(ErrorCode.BAD_REQUEST, f"request ids must be >= 0, got {req}: negative are the router's")
        if not isinstance(message, protocol.Watch | protocol.Unwatch | protocol.Heartbeat):
            self.watchers.refuse(who, getattr(message, "session", None), type(message).__struct_config__.tag)
        if isinstance(message, protocol.ControlState):  # as a server checks it: never folded in unchecked
            checked_input(message)
        match message:
            case protocol.Open():
                self._open(who, message, now)
            case protocol.ControlState() if self.clients.owned(who, message.session).migration.migrating:
                session = self.sessions[message.session]  # live input waits for its restore, folded
                session.state = message if session.state is None else session.state.fold(message)
            case protocol.Control() | protocol.SetPrompt() | protocol.Save() \
                    if self.clients.owned(who, message.session).migration.migrating:
                raise self.migration.not_now(self.sessions[message.session], str(type(message).__struct_config__.tag))
            case protocol.Close() if self.clients.owned(who, message.session).migration.migrating:
                self._end_migrating(self.sessions[message.session], "client", None)
            case protocol.ControlState() if self.clients.owned(who, message.session).state is not None:
                session = self.sessions[message.session]  # earlier input waits for a full link: this goes after
                session.state = session.state.fold(message)  # type: ignore[union-attr]
                self._send_state(session)
            case (protocol.Control() | protocol.ControlState() | protocol.Close() | protocol.SetPrompt()
                  | protocol.Save()):
                session = self.clients.owned(who, message.session)
                if isinstance(message, protocol.Control):
                    self.migration.check_control(session, message.index)
                replica = self.replicas[session.replica]
                kind = type(message).__struct_config__.tag
                state = message if isinstance(message, protocol.ControlState) else None
                upstream = message if session.rid == session.id else \
                    msgspec.structs.replace(message, session=session.rid)
                self.migration.forwarding(session, message, str(kind))
                self._emit(ToReplica(replica.name, replica.generation, upstream, SessionOrigin(
                    who, message.req, session.id, str(kind), state), raw if upstream is message else None))
            case protocol.Stats():
                self._emit(ToClient(who, protocol.StatsReply(req=message.req, stats=self.stats(who, now))))
            case protocol.Drain():
                raise ClientError(ErrorCode.BAD_REQUEST, "a router does not drain: drain each replica")
            case protocol.Heartbeat():
                self._emit(self.clients.heartbeat(who, message, now))
            case protocol.Watch():
                session = self.sessions.get(message.session)
                self.watchers.watch(who, message.session, message.token, now,
                                    None if session is None else session.client)
                assert session is not None and session.opened is not None  # a token exists while it runs here
                header = protocol.StreamHeader.of(session.opened).as_fields()
                self._emit(ToClient(who, protocol.Watching(req=message.req, **header)))
            case protocol.Unwatch():
                self.watchers.unwatch(who, message.session)
                self._emit(EndWatch(who, message.session, protocol.Closed(session=message.session, reason="unwatched"),
                                    keep=False))

    def _end_migrating(self, session: RoutedSession, reason: str, error: str | None) -> None:
        """A session whose restore is on its way ends here (its client closed it, or no replica could restore it);
        a restore answered later is closed on its replica (nobody waits for it)."""
        self._remove_session(session)
        self._end_watchers(session.id, reason, error, keep=False)
        if not session.gone:
            if error is not None:
                self._emit(ToClient(session.client, protocol.Error(session=session.id, code=ErrorCode.RANK_FAILED,
                                                                   message=error), session.id))
            closed = protocol.Closed(session=session.id, reason=reason, error=error,
                                     summary=PartialSummary(replica=session.replica))
            self._emit(ToClient(session.client, closed, session.id))

    def _end_watchers(self, sid: str, reason: str, error: str | None, keep: bool) -> None:
        """The session ended here: each of its watchers gets a ``closed`` of its own (not the owner's summary)."""
        for who in self.watchers.end(sid):
            self._emit(EndWatch(who, sid, protocol.Closed(session=sid, reason=reason, error=error), keep))

    def _open(self, who: bytes, message: protocol.Open, now: float, tried: Iterable[str] = (),
              migrating: str | None = None) -> None:
        tried = set(tried)
        replica = choose(self.replicas.values(), now, exclude=tried)
        if replica is None:
            raise ClientError(ErrorCode.BUSY, f"every replica is at its session limit or down "
                              f"({summary(self.replicas.values())})", retry_after_s=self.config.busy_retry_s)
        req = self.new_req()
        self.opens[req] = PendingOpen(req, who, message, replica.name, now, tried | {replica.name}, migrating)
        replica.opening += 1
        self._emit(ToReplica(replica.name, replica.generation, msgspec.structs.replace(message, req=req),
                             OpenOrigin(req)))

    def _retry_open(self, pending: PendingOpen, now: float) -> None:
        """Place an open elsewhere (its replica was busy, unreachable or went down), or tell its client why not."""
        self._drop_open(pending)
        try:
            self._open(pending.client, pending.message, now, pending.tried, pending.migrating)
        except ClientError as error:
            self._open_refused(pending, error)

    def _open_refused(self, pending: PendingOpen, error: ClientError) -> None:
        """An open that cannot be placed or was refused: its client is told (a session being restored ends)."""
        session = self.sessions.get(pending.migrating or "")
        if pending.migrating is None:
            self._refuse(pending.client, error, pending.message.req)
        elif session is not None and session.migration.migrating:
            self._end_migrating(session, "failed", f"its replica {session.replica} went down and its restore "
                                f"failed ({error.code}: {error}); its session is lost: open a new one")

    def _drop_open(self, pending: PendingOpen) -> None:
        self.opens.pop(pending.req, None)
        replica = self.replicas.get(pending.replica)
        if replica is not None:
            replica.opening = max(0, replica.opening - 1)

    def _refuse(self, who: bytes, error: ClientError, req: int | None, session: str | None = None,
                v: int | None = None) -> None:
        code = error.code if error.code in self.rejects or len(self.rejects) < MAX_REASONS - 1 else "other"
        self.rejects[code] = self.rejects.get(code, 0) + 1
        self._emit(self.clients.refusal(who, error, req, session, v))

    def _unreachable(self, event: ClientUnreachable, now: float) -> None:
        if self.watchers.remove(event.identity, event.session):
            return  # a watcher that disconnected: its feed is gone with it
        session = self.clients.unreachable(event)
        if session is not None:  # connected but not reading: never buffered without bound
            self._close_on_replica(session, now)

    def _close_on_replica(self, session: RoutedSession, now: float) -> None:
        if session.migration.migrating:  # no replica holds it yet: it ends here (the restore is closed when it answers)
            self._end_migrating(session, "disconnect", None)
            return
        session.closing, session.close_due = True, now + self.config.replica_dead_s
        replica = self.replicas[session.replica]
        self._emit(ToReplica(replica.name, replica.generation,
                             protocol.Close(req=self.new_req(), session=session.rid)))

    def _send_state(self, session: RoutedSession) -> None:
        """Send a session's folded live input (it met a full link); a refusal folds it again (``_refused``)."""
        if session.migration.migrating:
            return  # sent once its restore is answered
        state, session.state = session.state, None
        if state is not None:
            replica = self.replicas[session.replica]
            upstream = msgspec.structs.replace(state, session=session.rid)
            self._emit(ToReplica(replica.name, replica.generation, upstream,
                                 SessionOrigin(session.client, state.req, session.id, "control_state", state)))

    def _add_session(self, session: RoutedSession, now: float) -> None:
        self.clients.add(session, now)
        self.replicas[session.replica].sessions.add(session.id)
        self.sessions_total += 1

    def _remove_session(self, session: RoutedSession) -> None:
        self._out += self.migration.ended(session)
        self.clients.remove(session.id)
        replica = self.replicas.get(session.replica)
        if replica is not None:
            replica.sessions.discard(session.id)

    # ---------------------------------------------------------------------------------------------- replicas

    def _from_replica(self, event: ReplicaSent, now: float) -> None:
        replica = self.replicas.get(event.replica)
        if replica is None or event.generation != replica.generation:
            return  # from a connection closed since: its job is gone for the router
        replica.last_heard = now  # alive; it is up only once a heartbeat ack said which process it is
        # a migrated session's messages go on under the id its client knows
        message, raw = self.migration.renamed(replica.name, event.message, event.raw)
        match message:
            case ChunkHead(session=sid):
                if self._to_session(replica, sid, raw):
                    self.chunks_forwarded += 1
                    watchers = self.watchers.of(sid)
                    if watchers:  # the same frame, never copied: each watcher's feed in the shell
                        self._emit(ToWatchers(sid, watchers, raw))
                    self._out += self.migration.forwarded(self.sessions[sid], replica)
            case protocol.Opened():
                self._opened(replica, message, now)
            case protocol.Error(code=code) if code in ENDING_CODES:
                self._down(replica, f"is ending: {message.message}", now, code)
            case protocol.Error(session=None):
                self._open_failed(replica, message, now)
            case protocol.Saved(session=sid) | protocol.Error(session=sid) if self._took(self.migration.autosaved(
                    self.sessions.get(sid or ""), replica.name, message)):
                pass  # the router's own save: answered to the router alone
            case protocol.PromptScheduled(session=sid) | protocol.Error(session=sid) \
                    if self.migration.replayed(self.sessions.get(sid or ""), replica.name, message):
                pass  # the router's own set_prompt after a migration: answered to the router alone
            case protocol.Draining(session=str() as sid):  # a draining replica's last save of a session: it moves
                replica.draining = True  # placed nowhere from now on
                kept = self.migration.drained(self.sessions.get(sid), replica.name, message)
                if kept is False or (kept and not self._migrate(self.sessions[sid], replica, "is draining", now)):
                    self._to_session(replica, sid, raw)  # nowhere to go: its client can restore it itself
            case protocol.Closed(session=sid):
                session = self.sessions.get(sid)
                if session is not None and session.replica == replica.name and not session.migration.migrating:
                    self._remove_session(session)
                    if not session.gone:
                        self._emit(ToClient(session.client, raw, sid))
                    self._end_watchers(sid, message.reason, message.error, keep=True)
            case (protocol.Accepted(session=sid) | protocol.Error(session=sid) | protocol.PromptScheduled(session=sid)
                  | protocol.Saved(session=sid)):
                session = self.sessions.get(sid or "")
                if isinstance(message, protocol.Saved):  # a client's own save is a place to resume from too
                    self.migration.snapshotted(session, replica.name, message)
                if session is not None and session.replica == replica.name:
                    self.migration.answered(session, message)
                self._to_session(replica, sid, raw)  # type: ignore[arg-type]
            case ReplicaStatsReply():
                self._stats_reply(replica, message, now)
            case protocol.HeartbeatAck(server=server):
                self._identify(replica, server, now)

    def _to_session(self, replica: Replica, sid: str, raw: Payload | protocol.ServerMessage) -> bool:
        session = self.sessions.get(sid)
        if session is None or session.replica != replica.name or session.migration.migrating:
            return False  # a late message of a session that ended here
        if not session.gone:
            self._emit(ToClient(session.client, raw, sid))
        return True

    # ---------------------------------------------------------------------------------------------- migration

    def _took(self, outputs: list[Output] | None) -> bool:
        """Whether a part took a message (``outputs`` not None): then its outputs are the core's."""
        if outputs is not None:
            self._out += outputs
        return outputs is not None

    def _migrate(self, session: RoutedSession, down: Replica, text: str, now: float) -> bool:
        """Restore ``session`` (its replica ``down`` is going down) from its latest snapshot on another replica
        chosen as for an open; False when it has none or no replica has room (it ends as before)."""
        message = self.migration.restore_open(session)
        if message is None or self.stopped:
            return False
        try:
            self._open(session.client, message, now, {down.name}, migrating=session.id)
        except ClientError as error:
            log.warning("session %s cannot move off replica %s: %s", session.id, down.name, error)
            return False
        down.sessions.discard(session.id)
        for req, error in self.migration.moving(session, down.name, text):
            self._refuse(session.client, error, req, session.id)
        return True

    def _migrated(self, replica: Replica, pending: PendingOpen, message: protocol.Opened) -> None:
        """The restore of a session whose replica went down is open on ``replica``: its client is told."""
        session = self.sessions.get(pending.migrating or "")
        taken = (message.session != pending.migrating and message.session in self.sessions) or \
            self.migration.taken(replica.name, message.session)
        moving = session is not None and session.migration.migrating
        wrong = None if session is None else migration_problem(message.first_chunk, session.migration.snapshot_chunk)
        if session is None or not moving or taken or wrong:
            self._emit(ToReplica(replica.name, replica.generation,
                                 protocol.Close(req=self.new_req(), session=message.session)))
            if session is not None and moving:  # its new id is in use here (random 48 bits: rare)
                self._end_migrating(session, "failed", f"session {session.id} could not be restored: " + (
                    wrong or f"the id {message.session} is in use") + "; open a new one")
            return
        session.replica = replica.name
        notice = self.migration.restored(session, replica.name, message)
        replica.sessions.add(session.id)
        if not session.gone:
            self._emit(ToClient(session.client, notice, session.id))
        watchers = self.watchers.of(session.id)
        if watchers:  # their chunks come again from the resume chunk too
            self._emit(ToWatchers(session.id, watchers, notice))
        self._out += self.migration.replay(session, replica)  # its prompt that is in no snapshot
        self._send_state(session)  # live input that came meanwhile

    def _opened(self, replica: Replica, message: protocol.Opened, now: float) -> None:
        pending = self.opens.get(message.req)
        if pending is not None and pending.replica == replica.name and pending.migrating is not None:
            self._drop_open(pending)
            self._migrated(replica, pending, message)
            return
        if pending is None or pending.replica != replica.name:
            log.info("replica %s opened %s for an open nobody waits for: closing it", replica.name, message.session)
            self._emit(ToReplica(replica.name, replica.generation,
                                 protocol.Close(req=self.new_req(), session=message.session)))
            return
        self._drop_open(pending)
        why = None
        if message.session in self.sessions:  # another replica's session has this id (random 48 bits: rare)
            why = f"session id {message.session} is in use on another replica; open again"
        elif (wrong := open_problem(message.first_chunk, message.num_chunks, pending.message.restore is not None)):
            why = f"replica {replica.name} answered the open wrongly: {wrong}"
        elif (size := 3 * message.height * message.width * max(message.frames_first_chunk,
                                                                message.frames_per_chunk)) > chunk_limit(self.config):
            why = (f"a chunk of this session ({message.height}x{message.width}) is {size / 2**20:.0f} MiB, more than "
                   f"the router forwards (router.max_chunk_mb = {self.config.max_chunk_mb}); open a smaller one")
        if why is not None:
            self._emit(ToReplica(replica.name, replica.generation,
                                 protocol.Close(req=self.new_req(), session=message.session)))
            self._refuse(pending.client, ClientError(ErrorCode.FAILED, why), pending.message.req)
            return
        # spectators are the router's own (a replica sends each chunk once, to the router): its replica's token,
        # or one of the router's when the replica predates spectators
        token = self.watchers.grant(message.session, message.watch_token or None)
        message = msgspec.structs.replace(message, req=pending.message.req, watch_token=token)
        self._add_session(RoutedSession(message.session, replica.name, pending.client, pending.client,
                                        opened=message, migration=Moves(first=message.first_chunk)), now)
        self._emit(ToClient(pending.client, message, message.session))

    def _open_failed(self, replica: Replica, error: protocol.Error, now: float) -> None:
        pending = self.opens.get(error.req) if error.req is not None else None
        if pending is None or pending.replica != replica.name:
            log.warning("replica %s: error for no request of the router: %s: %s", replica.name, error.code,
                        error.message[:200])
            return
        if error.code == ErrorCode.BUSY:  # other clients filled it since its last stats: try the others
            replica.refused_until = now + self.config.stats_interval_s
            self._retry_open(pending, now)
            return
        self._drop_open(pending)
        self._open_refused(pending, ClientError(error.code, error.message, error.retry_after_s))

    def _refused(self, event: ReplicaRefused, now: float) -> None:
        origin = event.origin
        if isinstance(origin, OpenOrigin):
            pending = self.opens.get(origin.req)
            if pending is not None and pending.replica == event.replica:
                self._retry_open(pending, now)
            return
        session = self.sessions.get(origin.session)
        if session is None or session.replica != event.replica:
            return  # it ended meanwhile: its client was told
        if origin.kind == "close":  # a server never refuses a close: the router sends it again on the next turn
            session.closing, session.close_due = True, now
        elif origin.kind == "control_state":  # nor valid live input: it is folded and sent when the link drains
            if origin.state is not None:
                session.state = origin.state if session.state is None else origin.state.fold(session.state)
        elif not self.migration.not_sent(session, origin.kind, origin.req):  # (the router's own: tried again)
            # what a server answers a control, a new prompt or a save it cannot take now
            code = NOT_NOW.get(origin.kind, ErrorCode.CONTROL_BACKPRESSURE)
            self._refuse(origin.identity, ClientError(code, f"the connection to replica "
                                                      f"{event.replica} is full; send it again",
                                                      retry_after_s=SESSION_RETRY_S), origin.req, origin.session)

    def _stats_reply(self, replica: Replica, reply: ReplicaStatsReply, now: float) -> None:
        if reply.req != replica.stats_req:
            return
        replica.stats_req = None
        try:
            stats, shown = read_stats(reply.stats)
        except UnusableStats as error:  # never trusted, never fatal: down (its sessions end) and held down a while
            why = f"sent unusable stats ({error})"
            self._down(replica, why, now)
            replica.down_reason, replica.down_until = why, now + self.config.replica_dead_s
            return
        if not replica.fold_stats(stats, shown, now):
            self._end_sessions(replica, "restarted (its uptime went back)", ErrorCode.RANK_FAILED, now)
            for pending in [p for p in self.opens.values() if p.replica == replica.name]:
                self._retry_open(pending, now)
        if replica.state is State.DOWN and replica.known and not replica.is_router and now >= replica.down_until:
            replica.move(State.UP, now)  # it answered as a known process and its load is read: it takes sessions
            log.info("replica %s is up at %s", replica.name, replica.endpoint)
            self._emit(ReplicaUp(replica.name, replica.endpoint))

    def _identify(self, replica: Replica, server: str, now: float) -> None:
        """A heartbeat ack named the process at the replica's endpoint (``Replica.identify`` decides)."""
        down, read = replica.identify(server, self.id, now, self.config.replica_dead_s)
        if down is not None:
            self._down(replica, down, now)
        elif read:
            self._poll_stats(replica, now)

    def _poll_stats(self, replica: Replica, now: float) -> None:
        replica.stats_req, replica.stats_sent = self.new_req(), now
        replica.next_stats = now + self.config.stats_interval_s
        self._emit(ToReplica(replica.name, replica.generation, protocol.Stats(req=replica.stats_req)))

    def _down(self, replica: Replica, reason: str, now: float, code: str = ErrorCode.RANK_FAILED) -> None:
        if replica.state is State.DOWN:
            return
        lost = self._end_sessions(replica, reason, code, now)
        replica.move(State.DOWN, now)
        replica.down_reason = reason
        for pending in [p for p in self.opens.values() if p.replica == replica.name]:
            self._retry_open(pending, now)
        self._connect(replica, now)
        log.warning("replica %s is down: %s (%d sessions lost)", replica.name, reason, lost)
        self._emit(ReplicaDown(replica.name, reason, lost))

    def _end_sessions(self, replica: Replica, reason: str, code: str, now: float) -> int:
        """A session with a snapshot moves to another replica (``_migrate``); another gets ``code``, then ``closed``."""
        text = f"replica {replica.name} ({replica.endpoint}) {reason}; its sessions are lost: open a new one"
        ending = [self.sessions[sid] for sid in sorted(replica.sessions)]
        lost = [s for s in ending if not self._migrate(s, replica, reason, now)]
        for session in lost:
            self._remove_session(session)
            self._end_watchers(session.id, "shutdown" if code == ErrorCode.SHUTDOWN else "failed", text, keep=False)
            if not session.gone:
                self._emit(ToClient(session.client, protocol.Error(session=session.id, code=code, message=text),
                                    session.id))
                self._emit(ToClient(session.client, protocol.Closed(
                    session=session.id, reason="shutdown" if code == ErrorCode.SHUTDOWN else "failed", error=text,
                    summary=PartialSummary(replica=replica.name)), session.id))
        return len(lost)

    def _add(self, name: str, endpoint: str, max_sessions: int, listed: bool, now: float) -> Replica:
        replica = Replica(name=name, endpoint=endpoint, max_sessions=max_sessions, listed=listed, since=now)
        self.replicas[name] = replica
        self._connect(replica, now)
        return replica

    def _connect(self, replica: Replica, now: float) -> None:
        replica.forget_connection()
        replica.last_heard = replica.next_ping = now
        self._emit(Connect(replica.name, replica.endpoint, replica.generation))

    # ---------------------------------------------------------------------------------------------- membership

    def _register(self, peer: bytes, message: protocol.Register, now: float) -> None:
        why = registration_problem(message, self.replicas, self.config)
        if why is not None:
            log.warning("registration refused: %s", why)
            self._emit(ToRegistrant(peer, protocol.Registered(ok=False, message=why)))
            return
        replica = self.replicas.get(message.name)
        if replica is None:
            log.info("replica %s registered at %s", message.name, message.endpoint)
            replica = self._add(message.name, message.endpoint, message.max_sessions, False, now)
        elif message.endpoint != replica.endpoint:
            if (why := replica.move_to(message.endpoint)) is None:
                self._connect(replica, now)
        elif message.incarnation != replica.incarnation:
            why = replica.reincarnation_problem(message.incarnation)
        if why is not None:
            log.warning("registration of %s at %s refused: %s", message.name, message.endpoint, why)
            self._emit(ToRegistrant(peer, protocol.Registered(ok=False, message=why)))
            return
        replica.registered(message, now)
        self._emit(ToRegistrant(peer, protocol.Registered(ok=True)))

    # ---------------------------------------------------------------------------------------------- timers

    def _timers(self, now: float) -> None:
        config = self.config
        for replica in list(self.replicas.values()):
            due = replica.due(now, config)
            if due.ping:
                self._emit(ToReplica(replica.name, replica.generation, protocol.Heartbeat(req=self.new_req())))
            if due.dead is not None:
                self._down(replica, due.dead, now)
            elif due.poll:
                self._poll_stats(replica, now)
            elif due.forget:
                log.info("replica %s forgotten (down for %.0f s)", replica.name, now - replica.since)
                del self.replicas[replica.name]
                self._emit(Disconnect(replica.name))
        for pending in list(self.opens.values()):
            if now - pending.sent > config.open_timeout_s:
                self._drop_open(pending)
                self._open_refused(pending, ClientError(ErrorCode.FAILED, f"replica {pending.replica} did not open the "
                                                        f"session within {config.open_timeout_s:.0f} s"))
        for who, sid in self.watchers.silent(now):
            log.info("session %s: a watcher silent for over %.1f s is dropped", sid, config.client_timeout_s)
            self._emit(EndWatch(who, sid, protocol.Closed(session=sid, reason="disconnect",
                                                          error="the watcher was silent past the client timeout"),
                                keep=False))
        timed_out: set[str] = set()
        for session in self.clients.silent(now):
            if not session.closing:
                log.info("session %s: client silent for over %.1f s, closing it on replica %s", session.id,
                         config.client_timeout_s, session.replica)
                session.gone = True
                self._close_on_replica(session, now)
                timed_out.add(session.id)
        for session in list(self.sessions.values()):
            if session.id in timed_out:
                continue  # closed just now: nothing more is sent for it
            if session.closing and now >= session.close_due:
                self._close_on_replica(session, now)  # no `closed` yet: the close (or its answer) was lost
            else:
                if session.state is not None:
                    self._send_state(session)  # live input that met a full link, folded: the link may have drained
                # the prompt sent again after a migration that met a full link
                self._out += self.migration.replay(session, self.replicas.get(session.replica))

    def _shutdown(self, now: float) -> None:
        message = "the router is shutting down"
        for session in list(self.sessions.values()):
            if not session.migration.migrating:  # (a restore on its way is closed by its replica's client timeout)
                self._close_on_replica(session, now)  # its replica releases its caches now, not after a client timeout
        self._out += self.clients.notices(ErrorCode.SHUTDOWN, message, lambda session: protocol.Closed(
            session=session.id, reason="shutdown", error=message))
        for sid in list(self.watchers.tokens):
            self._end_watchers(sid, "shutdown", message, keep=False)
        self.stopped = True
        self._emit(Stop(EXIT_OK, message))

    # ---------------------------------------------------------------------------------------------- queries

    @property
    def sessions(self) -> Mapping[str, RoutedSession]:
        return self.clients.sessions

    def stats(self, who: bytes, now: float) -> ServerStats:
        """The router's stats for client ``who``: totals over the up replicas (the counters a server has, summed), the
        router's own counters, every replica (its state, load and its own latest stats without per-session
        entries) and ``per_session`` for ``who``'s sessions only (with the replica each is on)."""
        mine = {}
        for session in sorted(self.clients.of(who), key=lambda s: s.id):
            stats = self.replicas[session.replica].stats
            own = stats.per_session.get(session.rid) if stats else None
            mine[session.id] = msgspec.structs.replace(own or PartialSummary(), replica=session.replica)
        total = totals(self.replicas.values(), self.rejects)
        return ServerStats(
            layout="router", uptime_s=now - self.started, open_sessions=total.open_sessions,
            sessions=SessionCounts(open=len(self.sessions), total=self.sessions_total),
            chunks_emitted=total.chunks_emitted, frames_emitted=total.frames_emitted, rejects=dict(self.rejects),
            total=total, router=RouterCounters(
                chunks_forwarded=self.chunks_forwarded, client_messages=self.client_messages,
                watchers=self.watchers.count(), watch_dropped=self.watch_dropped, opening=len(self.opens),
                sessions_total=self.sessions_total, chunk_hold_s=self.hold_s, autosaves=self.migration.autosaves,
                migrations=self.migration.migrations),
            replicas={name: r.describe(now) for name, r in sorted(self.replicas.items())}, per_session=mine)
