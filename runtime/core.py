"""The coordinator core: everything rank 0 decides, as a sans-io state machine (DESIGN.md sections 5-8, 11).

``CoordinatorCore.step(events, now)`` takes what happened (client messages, worker completions with their rank,
finished image decodes and manifest reads and writes, failed sends, timer turns; ``runtime.core_types``) and returns
what the shell must do, in order. No socket, thread, clock or file inside: ``now`` comes with every step, each
session id comes from ``new_id``, and the snapshot folder is read, written and listed by the shell.

The core keeps routing (client message type -> handler or part) and each session's own path: open -> scheduler ->
dispatch -> join -> emit -> close, and the stats. What else a session has lives in its parts (``runtime.parts``),
each owning its per-session state and answering with outputs, never calling back: admission
(``runtime.admission``: length, prompt, session limit, frame size, memory, real time, the steps each chunk runs),
saves and restores' reads (``runtime.saving``), the drain (``runtime.drain``), clients (``runtime.clients``),
watchers (``runtime.watchers``) and metrics (``runtime.metrics``); rank health (``runtime.rank_health``: pings,
beats, clock, memory, deadlines) is job-wide. A close, and a drop of a session that cannot close, is one loop over
the parts.

- **Opening.** ``open`` is admitted, its image decoded off the loop, and sessions are created in request order once
  their images are there; a restore reads its manifest off the loop and is admitted by the same ``admit``.
- **Tasks.** Each scheduler action becomes per-rank tasks through the stage table (``runtime.placement.plan``); the
  action is finished when every completion it waits for arrived (the join), and only then does the scheduler hear
  of it. A completion that no join waits for only adds its spans.
- **Live controls** are cut when the scheduler wants them (``Scheduler.control_wanted``), after every event.
- **Clients** (``runtime.clients``, the front door shared with the router): the sessions of a client silent for
  ``server.client_timeout_s`` are closed ("disconnect"); a client that is gone is skipped until it resumes; one
  that stops reading is closed at once.
- **Containment.** A bad request gets a clear error and changes nothing; an unexpected error while handling an
  event costs the session it concerns (error to its client, caches released), never the server.
- Actions never re-enter: a scheduler event's actions become outputs only; consequences that need the scheduler
  again (a failed send, a missing chunk) come back as events of a later step.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from ipc import protocol
from ipc.metrics_types import RankStats, ServerStats
from ipc.protocol import ChunkFacts, ErrorCode, Phase, clip
from models.controls import OFFICIAL_INTRINSICS
from models.geometry import intrinsics_at
from runtime import scheduler as sch
from runtime.admission import Admission, Opening
from runtime.clients import Clients, backpressure_retry_s, unauthorized
from runtime.config import (
    CapacityConfig,
    LayoutConfig,
    MetricsConfig,
    SchedulerConfig,
    ServerConfig,
    StreamConfig,
    TimeoutsConfig,
)
from runtime.control_service import ControlStateError, LiveControls
from runtime.core_types import (
    EXIT_FAILED,
    EXIT_OK,
    ClientError,
    ClientSent,
    ClientUnreachable,
    ClientUnreadable,
    DrainRequested,
    DropTensors,
    EmitChunk,
    EndWatch,
    Event,
    FramesMissing,
    ImageDecoded,
    JobFailed,
    ManifestRead,
    ManifestWritten,
    MemorySampled,
    Output,
    RankLost,
    ShutdownRequested,
    SnapshotsListed,
    Stop,
    Tick,
    ToClient,
    WatchDropped,
    WorkerSent,
)
from runtime.drain import Drain
from runtime.memory_admission import Cost
from runtime.metrics import MetricsObserver, Observers, ServerMetrics, SessionMetrics, final_summary
from runtime.parts import Answer, CloseSession, Ending, Hold, Part, SaveSession, ToOwner
from runtime.placement import STAGES, NewPrompt, Placement, StageAction, join_of, key_of, placement_of, plan
from runtime.prompts import PromptBackpressure, PromptRevisions
from runtime.rank_health import RankHealth
from runtime.restores import restorable, restored_length
from runtime.saving import Saves
from runtime.session import Join, Session
from runtime.sizes import served_sizes
from runtime.snapshots import Identity, SnapshotStore, geometry_of
from runtime.warm_start import WarmStart
from runtime.watchers import Watchers

if TYPE_CHECKING:
    from models.geometry import StreamGeometry

log = logging.getLogger(__name__)


def _new_id() -> str:
    return uuid.uuid4().hex[:12]


def _live(scheduler: sch.Scheduler, sid: str) -> bool:
    """Open and not closing."""
    return scheduler.session_state(sid) in (sch.SessionState.INITIALIZING, sch.SessionState.READY)


class CoordinatorCore:
    """See the module docstring. Create it once every worker reported in; then ``step`` for every loop turn."""

    def __init__(self, layout: LayoutConfig, server: ServerConfig, stream: StreamConfig, scheduler: SchedulerConfig,
                 timeouts: TimeoutsConfig, metrics: MetricsConfig, geometry: StreamGeometry, now: float,
                 observers: tuple[MetricsObserver, ...] = (), new_id: Callable[[], str] = _new_id,
                 server_id: str | None = None,
                 intrinsics: tuple[float, float, float, float] = OFFICIAL_INTRINSICS,
                 rooms: dict[int, int] | None = None, session_cost: Cost | None = None,
                 warm_start: WarmStart | None = None, capacity: CapacityConfig | None = None,
                 snapshots: SnapshotStore | None = None, model: str = "",
                 auth_token: str | None = None, operator_token: str | None = None) -> None:  # fmt: skip
        self.layout, self.server, self.stream, self.timeouts, self.metrics_config = (layout, server, stream,
                                                                                      timeouts, metrics)
        self.geometry = geometry  # the backend's, at stream.height x stream.width
        self.where: Placement = placement_of(layout)
        self.sizes = served_sizes(stream)
        # the longest session: ``server.max_chunks``, or less when the model caps it (a "full" KV cache)
        self.max_chunks = server.max_chunks if geometry.max_chunks is None else min(geometry.max_chunks,
                                                                                    server.max_chunks)
        self.warm_start = warm_start or WarmStart(self.where, self.sizes)  # what the ranks' hellos reported
        self.scheduler = sch.Scheduler(
            mode=sch.Mode(scheduler.mode),
            capacities=sch.Capacities(control=scheduler.control_capacity, latent=scheduler.latent_capacity,
                                      output=scheduler.output_capacity))
        # the summaries and the stats reply; ``metrics`` feeds it and the other observers (Prometheus) each event once
        self.server_metrics = ServerMetrics(now, stream.fps, metrics.warmup_chunks)
        self.metrics = Observers(self.server_metrics, *observers)
        self.new_id = new_id
        self.server_id = server_id or _new_id()  # in every heartbeat ack: a client tells a restarted server apart
        self.intrinsics = intrinsics  # controls.intrinsics: the camera of sessions whose open gives none
        # the session's parts (``runtime.parts``): each keeps its own per-session state, forgotten on close and drop
        self.admitting = Admission(server, capacity or CapacityConfig(), stream, self.sizes, session_cost,
                                   dict(rooms or {}))
        self.clients: Clients[Session] = Clients(self.server_id, server.client_timeout_s)
        self.watchers = Watchers(server.max_watchers, server.client_timeout_s)  # spectators, beside the owners
        self.watch_dropped = 0  # chunks the shell dropped for slow watchers (``WatchDropped``)
        self.health = RankHealth(self.where.heartbeat_ranks, timeouts, now)  # pings, beats, clock, deadlines
        self.stopped = False
        self._out: list[Output] = []
        # saved sessions (``runtime.snapshots``): the folder, what a snapshot must match here, the saves in flight
        self.saving = Saves(snapshots or SnapshotStore("out/snapshots"), Identity.of(model, layout.name, self.where),
                            self.where, server, timeouts.stage_s)
        self.draining = Drain(server.drain_s, operator_token)  # a stop signal or ``drain``: hand every session off
        # in the order a close answers: a save in flight before the client's closed, the watchers' end after it
        self.parts: tuple[Part, ...] = (self.metrics, self.saving, self.admitting, self.draining, self.clients,
                                        self.watchers)
        self.restored = 0  # sessions restored from a snapshot so far (``/metrics``)
        self.auth_token = auth_token  # every request must carry it (``ipc.auth``); None: none required
        self.sessions: Mapping[str, Session] = self.clients.sessions  # by id (the front door indexes them by client)
        owned = self.clients.owned
        # the routing table: each client message type -> the part (or core handler) that owns it
        self.routes: dict[type, Callable[[bytes, Any, float], None]] = {
            protocol.Open: lambda who, m, now: self._answer(self.saving.read(who, m) if m.restore is not None else [
                self.admitting.ask(who, m, len(self.sessions), self.max_chunks, self.geometry.max_chunks)], now),
            protocol.Save: lambda who, m, now: self._save(owned(who, m.session), who, m, now),
            protocol.Control: lambda who, m, now: self._control(owned(who, m.session), m, now),
            protocol.ControlState: lambda who, m, now: self._control(owned(who, m.session), m, now),
            protocol.SetPrompt: lambda who, m, now: self._set_prompt(owned(who, m.session), m, now),
            protocol.Close: lambda who, m, now: self._close(owned(who, m.session), now),
            protocol.Stats: lambda who, m, now: self._out.append(
                ToClient(who, protocol.StatsReply(req=m.req, stats=self.stats(now, who)))),
            protocol.Heartbeat: lambda who, m, now: self._out.append(self.clients.heartbeat(who, m, now)),
            protocol.Watch: lambda who, m, now: self._out.append(  # its geometry now, its chunks from the next
                self.watchers.watching(who, m, self.sessions.get(m.session), self.stream.fps, now)),
            protocol.Unwatch: lambda who, m, now: self._out.append(self.watchers.unwatched(who, m.session)),
            protocol.Drain: lambda who, m, now: self._out.append(  # as a stop signal; answered with the counts
                ToClient(who, self.draining.asked(m, self.sessions, now))),
        }

    # ---------------------------------------------------------------------------------------------- step

    def step(self, events: Iterable[Event], now: float) -> list[Output]:
        """Handle ``events`` (all at rank-0 time ``now``); the outputs, in the order the shell must carry them out.
        After a ``Stop`` the core takes nothing more."""
        for event in events:
            if self.stopped:
                break
            try:
                self._handle(event, now)
                self._cut_live(now)
                for sid in self.saving.waiting():  # its session gone or closing (None), or quiet before its boundary
                    session = self.sessions.get(sid) if sid in self.sessions and _live(self.scheduler, sid) else None
                    quiet = session is not None and self.scheduler.quiet_before_denoise(sid)
                    self._answer(self.saving.advance(sid, session, quiet, now), now)
            except JobFailed as error:
                log.error("job failed: %s", error)
                self._out += self.clients.notices(ErrorCode.RANK_FAILED, str(error))
                self._out += self.watchers.ended_all("failed", str(error))
                self.stopped = True
                self._out.append(Stop(EXIT_FAILED, str(error)))
            except Exception:  # a bug outside any session (every session's work is guarded): keep serving
                log.exception("internal error handling %s", type(event).__name__)
        out, self._out = self._out, []
        return out

    def _handle(self, event: Event, now: float) -> None:
        match event:
            case ClientSent() | ClientUnreadable() if refused := unauthorized(self.auth_token, event):
                self._refuse(*refused)  # before anything: the client is not even heard
            case ClientSent(identity=who, message=message):
                self.clients.heard(who, now)
                self.watchers.heard(who, now)
                self._attempt(who, getattr(message, "req", None), getattr(message, "session", None),
                              lambda: self._request(who, message, now), now)
            case ClientUnreadable(identity=who, error=error, req=req, v=v):
                self.clients.heard(who, now)
                self._refuse(who, ClientError(ErrorCode.BAD_MESSAGE, error), req, v=v)
            case ImageDecoded():  # sessions are created in the order they were asked for
                for opening in self.admitting.decoded(event):
                    self._attempt(opening.identity, opening.message.req, None,
                                  lambda o=opening: self._create(o, now), now)
            case ManifestRead():  # checked in ``_restore_from``; a refusal or a bug costs this request only
                who, message = self.saving.reading.pop(event.ticket)
                self._attempt(who, message.req, None, lambda: self._restore_from(who, message, event, now), now)
            case ManifestWritten():
                self._answer(self.saving.written(event), now)
            case SnapshotsListed():
                restoring = {s.restore for s in self.sessions.values() if s.restore and not s.opened}
                self._answer(self.saving.listed(event, restoring, now), now)
            case WorkerSent(message=protocol.Beat() as beat):
                self.health.beat(beat, now)
                self.admitting.memory.report(beat.rank, beat.room, beat.cache_bytes)
            case WorkerSent(message=protocol.SaveCaptured() | protocol.SaveWritten() as saved):
                self._guarded(saved.session, lambda: self._answer(self.saving.progress(saved, now), now), now)
            case WorkerSent(message=protocol.TaskFailed(phase=Phase.SAVE) as failed):
                self._answer(self.saving.refused(failed, now), now)
            case WorkerSent(message=done):
                self._guarded(done.session, lambda: self._completion(done, now), now)  # type: ignore[arg-type]
            case ClientUnreachable():
                self._guarded(event.session, lambda: self._unreachable(event, now), now)
            case FramesMissing(session=sid, index=index, error=error):
                self._contain(sid, None, None, RuntimeError(f"frames of chunk {index} never reached rank 0: {error}"),
                              now)
            case MemorySampled(rank=rank, cache_bytes=cache_bytes):
                self.health.sampled(event)
                if cache_bytes is not None:
                    self.admitting.memory.measured[rank] = cache_bytes
            case Tick():
                self._timers(now)
            case RankLost(reason=reason):
                raise JobFailed(reason)
            case ShutdownRequested(lost=lost):
                self._shutdown(lost, now)
            case DrainRequested():
                self.draining.start(self.sessions, now)
            case WatchDropped(total=total):
                self.watch_dropped = total

    def _answer(self, answers: list[Answer], now: float) -> None:
        """Carry out what a part returned: outputs as they are, and what only the core may do."""
        for answer in answers:
            match answer:
                case Hold(session=sid, on=True):
                    self._run(self.scheduler.hold(sid, True, now), now)
                case Hold(session=sid):  # a closing session's hold ends with it
                    if sid in self.sessions and _live(self.scheduler, sid):
                        self._run(self.scheduler.hold(sid, False, now), now)
                case ToOwner(session=sid, message=message) if self.draining.takes(sid, message):
                    self._answer(self.draining.answered(sid, message, now), now)
                case SaveSession(session=sid, req=req):
                    try:
                        self._save(self.sessions[sid], None, protocol.Save(req=req, session=sid), now)
                    except ClientError as error:
                        self._answer(self.draining.refused(sid, error, now), now)
                case CloseSession(session=sid, reason=reason):
                    if sid in self.sessions and _live(self.scheduler, sid):  # (else closing already)
                        self._run(self.scheduler.close(sid, reason, now), now)
                case ToOwner(session=sid, message=message, owner=owner):
                    session = self.sessions.get(sid)
                    self._out.append(ToClient(session.client if session is not None else owner, message, sid))
                case _:
                    self._out.append(answer)

    def _to_client(self, session: Session, message: Any) -> None:
        if not session.gone:  # dropped until the owner resumes (or the client timeout closes the session)
            self._out.append(ToClient(session.client, message, session.id))

    # ---------------------------------------------------------------------------------------------- clients

    def _request(self, who: bytes, message: protocol.ClientMessage, now: float) -> None:
        if not isinstance(message, protocol.Watch | protocol.Unwatch | protocol.Heartbeat):
            self.watchers.refuse(who, getattr(message, "session", None), type(message).__struct_config__.tag)
        if isinstance(message, protocol.Open) and self.draining.active:
            raise self.draining.refusal()
        self.routes[type(message)](who, message, now)

    def _save(self, session: Session, who: bytes | None, message: protocol.Save, now: float) -> None:
        """A save of ``session``: its client's (``who``) or the drain's (None: the session's last here)."""
        sid = session.id
        self._answer(self.saving.save(session, who or session.client, message, self.scheduler.session_state(sid),
                                      self.scheduler.next_denoise_index(sid), self.admitting.capacity.seats.get(sid),
                                      self.admitting.steps_of(sid), now, last=who is None), now)

    def _close(self, session: Session, now: float) -> None:
        if not _live(self.scheduler, session.id):  # a repeated close: answered, and the one ``closed`` still follows
            raise ClientError(ErrorCode.CLOSING,
                              f"session {session.id} is already closing; its closed message follows")
        self._run(self.scheduler.close(session.id, "client", now), now)

    def _refuse(self, who: bytes, error: ClientError, req: int | None, session: str | None = None,
                v: int | None = None) -> None:
        self.metrics.on_reject(error.code)
        self._out.append(self.clients.refusal(who, error, req, session, v))

    def _attempt(self, who: bytes, req: int | None, sid: str | None, work: Callable[[], None], now: float) -> None:
        """A client's request, or an open whose off-loop part is done (its image decoded, its manifest read): a
        refusal or a bug costs this request (and the session it names) only, never the server."""
        try:
            work()
        except ClientError as error:
            self._refuse(who, error, req, sid)
        except JobFailed:
            raise
        except Exception as error:
            log.exception("internal error handling a request of %s", who)
            self._contain(sid, who, req, error, now)

    def _create(self, opening: Opening, now: float) -> None:
        result, message = opening.result, opening.message
        assert result is not None
        if result.image is None:
            raise ClientError(ErrorCode.BAD_IMAGE, result.error)
        if self.draining.active:  # asked before the drain began, its image decoded since
            raise self.draining.refusal()
        geometry = self.geometry.with_size(*self.admitting.frame_size(result.image.height, result.image.width))
        sid = self.admitting.admit(len(self.sessions), geometry, message.steps,
                                   message.min_steps, message.num_chunks, self.new_id)
        live = LiveControls(pause_when_idle=message.pause_when_idle) if message.live else None
        metrics = self._open_metrics(sid, now)
        self.clients.add(Session(
            id=sid, client=opening.identity, owner=opening.identity, open_req=message.req, seed=message.seed,
            prompt=message.prompt, geometry=geometry, live=live, metrics=metrics,
            num_chunks=message.num_chunks or (None if self.geometry.max_chunks is None else self.max_chunks),
            image=result.image, intrinsics=message.intrinsics or self.intrinsics), now)
        self._guarded(sid, lambda: self._run(self.scheduler.open(sid, message.num_chunks or self.max_chunks, now),
                                             now), now)

    def _open_metrics(self, sid: str, now: float) -> SessionMetrics:
        """The session exists: every part starts its state (the metrics first: the session's record)."""
        for part in self.parts:
            self._answer(part.opened(sid, now), now)
        return self.server_metrics.sessions[sid]

    def _control(self, session: Session, message: protocol.Control | protocol.ControlState, now: float) -> None:
        """A control: one chunk's (``control``), or a live session's input held now (``control_state``)."""
        if isinstance(message, protocol.ControlState):
            if session.live is None:
                raise ClientError(ErrorCode.BAD_CONTROL, "this session takes indexed controls; open it with live=true")
            try:
                session.live.update(message)
            except ControlStateError as error:
                raise ClientError(error.reason, str(error)) from None
            if message.steps is not None:  # from the next chunk cut
                session.asked[self.scheduler.next_control_index(session.id)] = message.steps
            return
        if session.live is not None:
            raise ClientError(ErrorCode.BAD_CONTROL, "this session is live: send control_state, not indexed controls")
        control, frames = message.control, session.geometry.frames_in_chunk(message.index)
        if control.poses is not None and len(control.poses) != frames:
            raise ClientError(ErrorCode.BAD_CONTROL, f"chunk {message.index} has {frames} video frames, got "
                              f"{len(control.poses)} poses")
        try:
            actions = self.scheduler.submit_control(session.id, message.index, now, payload=control)
        except sch.AdmissionError as error:
            if error.retryable:  # edge capacity: the same control will be accepted once work moves on
                raise ClientError(ErrorCode.CONTROL_BACKPRESSURE, str(error),
                                  retry_after_s=backpressure_retry_s(session.metrics.last_period)) from None
            raise ClientError(ErrorCode.REJECTED_CONTROL, str(error)) from None
        except sch.SchedulerError as error:
            raise ClientError(ErrorCode.REJECTED_CONTROL, str(error)) from None
        session.controls[message.index] = control
        if message.steps is not None:
            session.asked[message.index] = message.steps
        self._run(actions, now)
        self._out.append(ToClient(session.client, protocol.Accepted(req=message.req, session=session.id,
                                                              index=message.index), session.id))

    def _set_prompt(self, session: Session, message: protocol.SetPrompt, now: float) -> None:
        """Validate a new prompt and start its encode (``runtime.prompts``); answered once its context is encoded
        and announced to the DiT ranks (``_joined``), naming the first chunk that uses it."""
        if not _live(self.scheduler, session.id) or not session.opened:
            raise ClientError(ErrorCode.CLOSING, f"session {session.id} is closing; its prompt cannot change")
        self.admitting.check_prompt(message.prompt)
        try:
            revision = session.prompts.accept(message.req, message.prompt)
        except PromptBackpressure as error:
            raise ClientError(ErrorCode.PROMPT_BACKPRESSURE, str(error),
                              retry_after_s=backpressure_retry_s(session.metrics.last_period)) from None
        self._dispatch(NewPrompt(session.id, revision, message.prompt), now)

    def _prompt_scheduled(self, session: Session, revision: int, req: int) -> None:
        self._to_client(session, protocol.PromptScheduled(req=req, session=session.id, revision=revision,
                                                          chunk=self.scheduler.next_denoise_index(session.id)))

    def _cut_live(self, now: float) -> None:
        """The non-blocking path of live sessions: a snapshot is cut when the scheduler wants the control."""
        def cut(session: Session, live: LiveControls) -> None:
            index = self.scheduler.control_wanted(session.id)
            snapshot = None if index is None else live.cut(index, self.scheduler.next_emit_index(session.id))
            if snapshot is not None:
                actions = self.scheduler.submit_control(session.id, index, now, payload=snapshot)  # type: ignore[arg-type]
                session.controls[index] = snapshot  # type: ignore[index]
                self._run(actions, now)

        for session in list(self.sessions.values()):
            if session.live is not None:
                self._guarded(session.id, lambda s=session, live=session.live: cut(s, live), now)

    def _unreachable(self, event: ClientUnreachable, now: float) -> None:
        if self.watchers.remove(event.identity, event.session):
            return  # a watcher that disconnected: its feed is gone with it
        session = self.clients.unreachable(event)
        if session is not None:  # connected but not reading: never buffered without bound
            self._run(self.scheduler.close(session.id, "disconnect", now), now)

    # ---------------------------------------------------------------------------------------------- actions

    def _run(self, actions: list[sch.Action], now: float) -> None:
        """Carry out a batch of scheduler actions: outputs only, never another scheduler event."""
        for action in actions:
            if not isinstance(action, sch.DitIdle) and action.session not in self.sessions:
                log.warning("dropped %s of a session rank 0 no longer holds", action)
                continue
            match action:
                case sch.DitIdle():
                    # each waiting session counts the idle time with its own cause
                    self.metrics.on_idle(action.start, action.end, action.cause, action.blocked)
                case sch.Emit():
                    session = self.sessions[action.session]
                    control, spans = session.take_chunk(action.index)
                    steps, changed = session.chunk_steps.pop(action.index, (0, None))
                    facts = ChunkFacts(action.index, session.geometry.frames_in_chunk(action.index), control,
                                       action.times, spans, steps, changed,
                                       prompt_revision=session.prompts.emitted(action.index))
                    self.metrics.on_chunk(session.id, facts, self.health.memory)
                    self.admitting.emitted(session.id, facts, action.index < max(1, self.metrics_config.warmup_chunks))
                    self._out.append(EmitChunk(session.id, facts, None if session.gone else session.client,
                                               self.watchers.of(session.id)))
                case sch.SessionReady(session=sid):
                    self._ready(self.sessions[sid])
                case sch.SessionFailed(session=sid, error=error):
                    self.metrics.on_error("stage_failed")
                    session = self.sessions[sid]  # before it was opened, the failure is the answer to its open
                    answer = protocol.Error(session=sid, code=ErrorCode.FAILED, message=error) if session.opened else \
                        protocol.Error(req=session.open_req, code=ErrorCode.FAILED, message=error)  # (a router's too)
                    self._to_client(session, answer)
                case sch.SessionClosed():
                    self._closed(action, now)
                case _:
                    self._dispatch(action, now)

    def _dispatch(self, action: StageAction, now: float) -> None:
        """Send the per-rank tasks of a stage action (the table: ``runtime.placement.plan``) and start its join."""
        session = self.sessions[action.session]
        control, steps = None, None
        controlled = isinstance(action, sch.RunChunk) and STAGES[action.stage].controlled
        if controlled:  # the chunk that takes the client's control, its steps and the prompt
            control, steps = session.controls.get(action.index), self.admitting.chunk_steps(session, action.index)
            session.prompts.dispatched(action.index)  # the chunk takes the prompt announced last (plan names it)
        tasks = plan(action, session.facts(), self.where, control, steps)
        if controlled:  # a save's boundary chunk is out: prompts encoded meanwhile follow it
            for revision, req in session.prompts.unpin(action.index):
                self._prompt_scheduled(session, revision, req)
        if isinstance(action, sch.InitCache) and STAGES[action.stage].image:
            session.image = None  # the stage that takes it has it now
        if isinstance(action, sch.Release):
            session.released.pop(action.stage.value, None)  # a retry counts confirmations afresh
        self._out += session.handed(tasks.sends, now)
        session.joins[key_of(action)] = Join(set(tasks.waits), now, tasks.then)

    def _ready(self, session: Session) -> None:
        g = session.geometry
        session.opened = True
        self._to_client(session, protocol.Opened(
            req=session.open_req, **session.header(self.stream.fps).as_fields(),
            intrinsics=intrinsics_at(session.intrinsics or self.intrinsics, g.height, g.width),
            steps=self.admitting.steps_of(session.id), watch_token=self.watchers.grant(session.id),
            first_chunk=session.first_chunk))

    def _closed(self, action: sch.SessionClosed, now: float) -> None:
        session = self.sessions[action.session]  # present: _run skips actions of sessions dropped
        summary = msgspec.structs.replace(
            self.server_metrics.closing(session.id, now),  # read before the metrics part forgets the session
            clock_offsets=self.health.clock.offsets(),
            released=session.released,  # stage -> ranks that confirmed, in release order
            leaked_caches=[s.value for s in action.leaked], poisoned=action.poisoned)
        farewell = [protocol.Error(req=req, session=session.id, code=ErrorCode.CLOSING, message=(  # a set_prompt
            f"session {session.id} closed before its prompt revision {revision} was ready"))  # still encoding
            for revision, req in session.prompts.waiting().items()]
        farewell.append(protocol.Closed(session=session.id, reason=action.reason, error=action.error, summary=summary))
        end = Ending(action.reason, action.error, farewell=tuple(farewell))
        for part in self.parts:  # a save in flight is answered before the closed, the watchers' end after it
            self._answer(part.ending(session.id, now, end), now)
        self._out.append(DropTensors(session.id))
        log.info("session %s closed (%s)", session.id, action.reason)

    # ---------------------------------------------------------------------------------------------- workers

    def _completion(self, done: protocol.Completion, now: float) -> None:
        if isinstance(done, protocol.TaskFailed) and done.fatal:
            raise JobFailed(f"rank {done.rank} {done.role}: {done.error}")
        session = self.sessions.get(done.session)
        if session is None:
            return  # a late answer for a session already gone
        index = getattr(done, "index", -1)
        step = done.edge if isinstance(done, protocol.TransferDone) else done.stage
        if step is not None:
            session.add_spans(index, done.rank, done.role, done.spans, self.health.clock,
                              session.queued.get((step, index), now))
        try:
            if isinstance(done, protocol.TaskFailed):
                self._failed(session, done, now)
            else:
                self._joined(session, done, now)
        except sch.SchedulerError as error:
            log.warning("ignored %s from rank %d for %s: %s", type(done).__name__, done.rank, done.session, error)

    def _joined(self, session: Session, done: protocol.Completion, now: float) -> None:
        key, part = join_of(done)
        join = None if key is None else session.joins.get(key)
        if key is None or join is None or part not in join.waiting:
            return  # an answer that carries spans only (a broadcast, a DiT rank other than the leader)
        join.waiting.discard(part)
        if isinstance(done, protocol.ReleaseDone):
            session.confirm_release(done.stage, done.rank)
        if join.waiting:
            return
        del session.joins[key]
        self._out += session.handed(join.then, now)
        stage, phase, index = key
        sid = session.id
        if phase is Phase.CHUNK and index < 0:  # a new prompt's encode (a NewPrompt; its context moves now)
            revision = protocol.revision_of(index)  # its context encoded and announced: the next denoise uses it
            req = session.prompts.encoded(revision)
            if req is not None:
                self._prompt_scheduled(session, revision, req)
        elif phase is Phase.INIT:
            self._run(self.scheduler.init_done(sid, stage, now), now)
        elif phase is Phase.RELEASE:
            self._run(self.scheduler.release_done(sid, stage, True, now), now)
        else:
            self._run(self.scheduler.chunk_done(sid, stage, index, now), now)

    def _failed(self, session: Session, failed: protocol.TaskFailed, now: float) -> None:
        """A stage task failed for this session only (fatal failures end the job before they get here)."""
        stage = failed.stage
        if stage is None:  # a transfer that failed leaves its edge out of step: nothing else can use it
            raise JobFailed(f"rank {failed.rank} {failed.role}: {failed.error}")
        index = failed.index if failed.phase is Phase.CHUNK else -1
        session.joins.pop((stage, failed.phase, index), None)
        error = f"{failed.role} {failed.phase.value}: {failed.error}"
        if failed.phase is Phase.CHUNK and index < 0:  # a new prompt's encode: the session keeps its text
            req = session.prompts.failed(protocol.revision_of(index))
            if req is not None:
                self._to_client(session, protocol.Error(req=req, session=session.id, code=ErrorCode.PROMPT_FAILED,
                                                        message=clip(f"the new prompt could not be encoded: {error}")))
            return
        if failed.phase is Phase.RELEASE:
            self._run(self.scheduler.release_done(session.id, stage, False, now, error), now)
        else:
            self._run(self.scheduler.stage_failed(session.id, stage, None if index < 0 else index, error, now), now)

    # ---------------------------------------------------------------------------------------------- timers

    def _timers(self, now: float) -> None:
        pings = self.health.pings(now)
        if pings:
            self._out += pings
            self.metrics.on_gauges(len(self.sessions), self.health.memory)
        self.health.check(self.sessions.values(), now)
        for who, sid in self.watchers.silent(now):
            log.info("session %s: a watcher silent for over %.1f s is dropped", sid, self.watchers.timeout_s)
            self._out.append(EndWatch(who, sid, protocol.Closed(session=sid, reason="disconnect",
                                                          error="the watcher was silent past the client timeout"),
                                keep=False))
        self._answer(self.saving.tick(now), now)
        self._answer(self.draining.tick(now, {sid: self.scheduler.next_emit_index(sid) for sid in self.draining.saved
                                              if sid in self.sessions}), now)
        for session in self.clients.silent(now):
            if _live(self.scheduler, session.id):
                log.info("session %s: client silent for over %.1f s, closing", session.id, self.clients.timeout_s)
                sid = session.id
                self._guarded(sid, lambda sid=sid: self._run(self.scheduler.close(sid, "disconnect", now), now), now)

    # ---------------------------------------------------------------------------------------------- snapshots

    def _restore_from(self, who: bytes, message: protocol.Open, event: ManifestRead, now: float) -> None:
        manifest = restorable(event.manifest, event.error, self.saving.identity, lambda h, w: geometry_of(
            self.geometry.with_size(h, w)) if (h, w) in self.sizes else None, self.max_chunks,
                              self.server.max_prompt_chars)
        g = manifest.geometry
        num_chunks = restored_length(manifest, message.num_chunks, self.max_chunks)
        # its steps setting and floor are the saved session's (the open's may change them, as a control would)
        geometry = self.geometry.with_size(g.height, g.width)
        sid = self.admitting.admit(len(self.sessions), geometry,
            message.steps or manifest.want or manifest.steps, message.min_steps or manifest.floor or None,
            None if num_chunks is None else num_chunks - manifest.chunk, self.new_id)  # what it has yet to run
        saved_live = manifest.live
        live = None  # an indexed restore of a live session takes the client's per-chunk controls (an exact replay)
        if saved_live is not None and not message.indexed:
            live = LiveControls.restored(saved_live.held, manifest.chunk, saved_live.pause_when_idle, saved_live.cut)
        metrics = self._open_metrics(sid, now)
        self.clients.add(Session(
            id=sid, client=who, owner=who, open_req=message.req, seed=manifest.seed, prompt=manifest.prompt,
            geometry=geometry, live=live, metrics=metrics, num_chunks=num_chunks, image=None,
            intrinsics=manifest.intrinsics, restore=manifest.id, first_chunk=manifest.chunk,
            last_steps=manifest.steps,  # its first chunk's steps_changed compares with the saved session's last
            prompts=PromptRevisions.starting(manifest.prompt_revision, manifest.prompt)), now)
        log.info("session %s: restoring snapshot %s at chunk %d", sid, manifest.id, manifest.chunk)
        self.restored += 1  # the probes' migrations: a router's move lands here as a restore
        self._guarded(sid, lambda: self._run(self.scheduler.open(sid, num_chunks or self.max_chunks, now,
                                                                 start=manifest.chunk), now), now)

    # ---------------------------------------------------------------------------------------------- failures

    def _guarded(self, sid: str | None, work: Callable[[], object], now: float) -> None:
        """Run ``work`` for one session; an unexpected error fails that session only."""
        try:
            work()
        except JobFailed:
            raise
        except Exception as error:
            log.exception("internal error in session %s", sid)
            self._contain(sid, None, None, error, now)

    def _contain(self, sid: str | None, who: bytes | None, req: int | None, error: Exception, now: float) -> None:
        """After an unexpected error: tell the requester and fail the session it concerns (caches released)."""
        self.metrics.on_error("internal")
        text = clip(f"internal error: {type(error).__name__}: {error}")
        if who is not None:
            self._out.append(ToClient(who, protocol.Error(req=req, session=sid, code=ErrorCode.INTERNAL, message=text)))
        session = self.sessions.get(sid or "")
        if session is None:
            return
        try:
            if not _live(self.scheduler, session.id):
                return
            self._to_client(session, protocol.Error(session=session.id, code=ErrorCode.FAILED, message=text))
            self._run(self.scheduler.close(session.id, "failed", now), now)
        except JobFailed:
            raise
        except Exception:  # the session cannot even close cleanly: forget it rather than stop serving
            log.exception("session %s could not be closed; dropping it", session.id)
            end = Ending("failed", text, dropped=True)
            for part in self.parts:  # each forgets what it keeps of the session
                with contextlib.suppress(Exception):
                    self._answer(part.ending(session.id, now, end), now)
            self._out.append(DropTensors(session.id))

    def _shutdown(self, lost: tuple[int, ...], now: float) -> None:
        code, message = ErrorCode.SHUTDOWN, "the server is shutting down"
        if lost:  # under torchrun a dead rank reaches rank 0 as a SIGTERM: say what really happened
            code, message = ErrorCode.RANK_FAILED, f"rank {', '.join(map(str, lost))} is gone; the job is ending"
        self._out += self.clients.notices(code, message, lambda session: protocol.Closed(
            session=session.id, reason="shutdown", error=message,
            summary=final_summary(self.server_metrics, self.metrics, session.id, now)))
        self._out += self.watchers.ended_all("shutdown", message)
        self.stopped = True
        self._out.append(Stop(EXIT_OK, message))

    # ---------------------------------------------------------------------------------------------- queries

    def stats(self, now: float, who: bytes | None = None) -> ServerStats:
        """Server-wide figures, and the sessions of client ``who`` only (None: every session, for operators)."""
        visible = None if who is None else {sid for sid, s in self.sessions.items() if who in (s.client, s.owner)}
        memory = self.health.memory
        ranks = {str(r): RankStats(**{**memory.get(r, {}), **self.admitting.memory.stats(r)})
                 for r in sorted({*memory, *range(self.where.world_size)})}
        # watch_dropped: chunks dropped for slow watchers so far (never the players'); warm: every stage ran at every
        # served size before the port opened; capacity: real-time factors, headroom, the ladder's steps
        return msgspec.structs.replace(
            self.server_metrics.stats(now, visible), open_sessions=len(self.sessions), watchers=self.watchers.count(),
            watch_dropped=self.watch_dropped, ranks=ranks, clock_offsets=self.health.clock.offsets(),
            layout=self.layout.name, schedule=self.scheduler.mode.value, warm=self.warm_start.warm,
            warm_up=self.warm_start.stages(), sizes=[tuple(size) for size in self.sizes],
            capacity=self.admitting.capacity.stats(visible), snapshots=self.saving.folder.stats(self.saving.store),
            draining=True if self.draining.active else msgspec.UNSET)

