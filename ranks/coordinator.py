"""The coordinator loop on rank 0: the I/O shell around the scheduler, the control service and the metrics.

One thread owns both ROUTER sockets (clients, role workers). Each turn it drains what arrived, feeds the events
to the pure ``runtime`` state machines with the rank-0 time, and carries out the actions they return:
commands to role workers (the tensor plane moves what they announce), chunks and errors to clients. Timers in
the same loop ping every rank (liveness both ways and clock offsets), close sessions whose clients went silent,
and end the job with a non-zero exit when a rank is dead or a task overran its deadline.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec
import numpy as np
import zmq
from PIL import Image

from ipc import protocol
from ipc.transport import send_or_why, send_to
from models.controls import ChunkControl
from ranks import prometheus, workers_of
from ranks.client_sessions import ClientSession, facts_of, spans_from_worker
from ranks.worker import RankContext, memory_facts
from runtime import scheduler as sch
from runtime.clock import ClockSync
from runtime.control_service import ControlState, ControlStateError, LiveControls
from runtime.metrics import ChunkRecord, ServerMetrics

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
POLL_MS = 5
TURN_BUDGET_S = 0.02  # client messages handled per loop turn stop after this, so pings and workers are served
WORKER_MESSAGE_BYTES = 1 << 26
EMIT_WAIT_S = 1.0  # frames are in the mailbox before decode counts as done; a miss fails the session
BACKPRESSURE_RETRY_S = 0.002  # hint to clients whose control met a full edge


class JobFailed(Exception):
    """A rank died or hung: the job must end with a non-zero exit."""


class Coordinator:
    def __init__(self, ctx: RankContext, clients: zmq.Socket, workers: zmq.Socket) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.clients = clients
        self.workers = workers
        self.geometry = ctx.backend.geometry
        self.ids = workers_of(self.config.layout)
        cfg = self.config.scheduler
        self.scheduler = sch.Scheduler(
            mode=sch.Mode(cfg.mode),
            capacities=sch.Capacities(control=cfg.control_capacity, latent=cfg.latent_capacity,
                                      output=cfg.output_capacity),
        )
        now = time.monotonic()
        self.metrics = ServerMetrics(started_at=now)
        self.clock = ClockSync()
        self.sessions: dict[str, ClientSession] = {}
        self.last_beat: dict[int, float] = {}
        self.memory: dict[int, dict[str, int]] = {}
        self.outstanding: dict[tuple[bytes, str, str, int], float] = {}  # task -> when sent, for deadlines
        self.peers: dict[bytes, float] = {}  # client identity -> last heard (for fatal notices)
        self.ping_seq = 0
        self.next_ping = now
        self.stopping = False
        self.fatal: str | None = None  # set from another thread of this rank that cannot go on
        self.image_decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="image-decode")
        self.opening: deque[tuple[bytes, protocol.Open, Future[bytes]]] = deque()  # images being decoded
        self.exporter = prometheus.start(self.config.metrics.prometheus_port)

    # ---------------------------------------------------------------------------------------------- main loop

    def run(self, port: int) -> int:
        """Serve until shutdown; returns the process exit code."""
        try:
            self._await_workers()
            port_file = os.environ.get("WORLDSTREAM_PORT_FILE")  # written once serving: tests and scripts wait on it
            if port_file:
                tmp = f"{port_file}.tmp"
                with open(tmp, "w") as f:
                    f.write(str(port))
                os.replace(tmp, port_file)
            log.info("serving on tcp://%s:%d: %d ranks, layout %s", self.config.server.host, port,
                     self.config.layout.world_size, self.config.layout.name)
            poller = zmq.Poller()
            poller.register(self.clients, zmq.POLLIN)
            poller.register(self.workers, zmq.POLLIN)
            while not self.stopping:
                if self.fatal is not None:
                    raise JobFailed(f"rank {self.ctx.rank}: {self.fatal}")
                events = dict(poller.poll(POLL_MS))
                if self.workers in events:
                    self._drain_workers()
                if self.clients in events:
                    self._drain_clients()
                if self.opening:
                    self._finish_opens()
                self._timers(time.monotonic())
            self._shutdown("shutdown", "the server is shutting down")
            return EXIT_OK
        except JobFailed as error:
            log.error("job failed: %s", error)
            self._notify_all("rank_failed", str(error))
            return EXIT_FAILED

    def _await_workers(self) -> None:
        expected = set(self.ids.all)
        deadline = time.monotonic() + self.config.timeouts.startup_s
        while expected:
            if time.monotonic() > deadline:
                raise JobFailed(f"workers {sorted(i.decode() for i in expected)} did not report in within "
                                f"{self.config.timeouts.startup_s:.0f} s")
            if self.workers.poll(100):
                identity, data = self.workers.recv_multipart()
                message = protocol.decode(data, "worker", max_bytes=WORKER_MESSAGE_BYTES)
                if isinstance(message, protocol.Hello):
                    expected.discard(identity)
        now = time.monotonic()
        for rank in self.ids.heartbeat_ranks:
            self.last_beat[rank] = now

    def _timers(self, now: float) -> None:
        if now >= self.next_ping:
            self.next_ping = now + self.config.timeouts.heartbeat_s
            for rank in self.ids.heartbeat_ranks:
                self._send_worker(self.ids.heartbeat(rank), protocol.Ping(seq=self.ping_seq, sent=now))
            self.ping_seq += 1
            rss, peak, cuda = memory_facts()  # rank 0 has no heartbeat of its own
            self.memory[0] = {"rss": rss, "peak_rss": peak, "cuda_peak": cuda}
            if self.exporter is not None:
                self.exporter.update(len(self.sessions), self.memory)
        dead_after = self.config.timeouts.rank_dead_s
        for rank, seen in self.last_beat.items():
            if now - seen > dead_after:
                raise JobFailed(f"rank {rank} stopped answering (silent for {now - seen:.1f} s)")
        stage_s = self.config.timeouts.stage_s
        for (identity, op, session, index), sent in self.outstanding.items():
            if now - sent > stage_s:
                raise JobFailed(f"{identity.decode()} did not finish {op} of {session}/{index} within {stage_s:.0f} s")
        timeout = self.config.server.client_timeout_s
        for sid, session in list(self.sessions.items()):
            if not session.closing and now - session.last_heard > timeout:
                log.info("session %s: client silent for %.1f s, closing", sid, now - session.last_heard)
                self._guarded(sid, lambda sid=sid: self._close(sid, "disconnect", now))

    # ---------------------------------------------------------------------------------------------- workers

    def _send_worker(self, identity: bytes, message: Any, track: bool = False) -> None:
        if not send_to(self.workers, identity, message):
            rank, role = identity.decode().split(":", 1)
            raise JobFailed(f"rank {rank} is unreachable (its {role} worker disconnected)")
        if track and isinstance(message, protocol.Task):
            self.outstanding[(identity, message.op, message.session, message.index)] = time.monotonic()

    def _task(self, identity: bytes, op: str, session: str = "", index: int = -1, track: bool = True,
              **fields: Any) -> None:
        self._send_worker(identity, protocol.Task(op=op, session=session, index=index, **fields), track=track)
        if session in self.sessions:
            self.sessions[session].queued[(op, index)] = time.monotonic()

    def _drain_workers(self) -> None:
        while True:
            try:
                identity, data = self.workers.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = protocol.decode(data, "worker", max_bytes=WORKER_MESSAGE_BYTES)
            except protocol.ProtocolViolation as error:  # our own ranks: a bug, not a reason to end the job
                log.error("unreadable message from %s: %s", identity.decode(errors="replace"), error)
                continue
            now = time.monotonic()
            if isinstance(message, protocol.Beat):
                self.last_beat[message.rank] = now
                with contextlib.suppress(ValueError):  # an impossible sample (clock step): keep the estimate
                    self.clock.add(message.rank, message.echo, message.received, message.sent, now)
                self.memory[message.rank] = {"rss": message.rss, "peak_rss": message.peak_rss,
                                             "cuda_peak": message.cuda_peak}
            elif isinstance(message, protocol.Done):
                self.outstanding.pop((identity, message.op, message.session, message.index), None)
                try:
                    self._on_done(message, now)
                except JobFailed:
                    raise
                except Exception as error:  # a bug must cost the session it concerns, never the server
                    log.exception("internal error handling %s/%s", message.role, message.op)
                    self._contain(message.session or None, None, None, error)

    def _on_done(self, done: protocol.Done, now: float) -> None:
        if done.info.get("fatal"):
            raise JobFailed(f"rank {done.rank} {done.role}: {done.error}")
        session = self.sessions.get(done.session)
        if session is None:
            return  # a late answer for a session already gone
        for span in spans_from_worker(done, self.clock, session.queued.get((done.op, done.index), now)):
            session.add_span(done.index, span)
        stage = {"condition": sch.Stage.ENCODE, "dit": sch.Stage.DENOISE, "decode": sch.Stage.DECODE}.get(done.role)
        try:
            if done.op == "release" and stage is not None:
                ranks = len(self.ids.dit) if stage is sch.Stage.DENOISE else 1
                if not done.ok or session.release_joined(stage.value, done.rank, ranks):
                    self._execute(self.scheduler.release_done(done.session, stage, done.ok, now, done.error or None))
            elif not done.ok:
                index = None if done.op == "init" else done.index
                self._execute(self.scheduler.stage_failed(done.session, stage or sch.Stage.DECODE, index,
                                                          f"{done.role} {done.op}: {done.error}", now))
            elif done.op == "init" and stage is not None:
                self._execute(self.scheduler.init_done(done.session, stage, now))
            elif done.op == "encode":
                for identity in self.ids.condition_edges:  # moves now, overlapping the DiT's current chunk
                    self._task(identity, "edge_condition", done.session, done.index, track=False)
                self._execute(self.scheduler.encode_done(done.session, done.index, now))
            elif done.op == "denoise" and done.rank == self.config.layout.dit_leader:
                self._execute(self.scheduler.denoise_done(done.session, done.index, now))
            elif done.op in ("decode", "expect_frames") and session.decode_joined(
                done.index, done.op, frames_remote=self.ids.frames is not None
            ):
                    self._execute(self.scheduler.decode_done(done.session, done.index, now))
        except sch.SchedulerError as error:
            log.warning("ignored %s/%s from rank %d for %s: %s", done.role, done.op, done.rank, done.session, error)

    # ---------------------------------------------------------------------------------------------- actions

    def _execute(self, actions: list[sch.Action]) -> None:
        for action in actions:
            self._act(action)
        self._cut_live_controls()

    def _act(self, action: sch.Action) -> None:
        ids = self.ids
        if isinstance(action, sch.DitIdle):
            self.metrics.on_idle(action.start, action.end, action.cause)
            if self.exporter is not None:
                self.exporter.on_idle(action.end - action.start, action.cause)
            for sid, cause in action.blocked:  # each waiting session counts the idle time with its own cause
                if sid in self.sessions:
                    self.sessions[sid].metrics.on_idle(action.start, action.end, cause)
            return
        session = self.sessions[action.session]
        sid = action.session
        if isinstance(action, sch.InitCache):
            if action.stage is sch.Stage.ENCODE:
                self._task(ids.condition, "init", sid, seed=session.seed, prompt=session.prompt, image=session.image)
            elif action.stage is sch.Stage.DECODE:
                self._task(ids.decode, "init", sid)
            else:
                for identity in ids.condition_edges:  # the context moves to the DiT ranks, then they init
                    self._task(identity, "edge_context", sid, track=False)
                for i, identity in enumerate(ids.dit):
                    self._task(identity, "init", sid, seed=session.seed, prompt=session.prompt, track=i == 0)
        elif isinstance(action, sch.RunEncode):
            self._task(ids.condition, "encode", sid, action.index)
        elif isinstance(action, sch.RunDenoise):
            # The scheduler is built without a world-cache hook, so no denoise is a cache hit: the ranks hold no
            # world cache yet (the scheduler's branch and the stages' skip(latent=...) are ready for one).
            assert not action.cached, "world-cache hits are not wired on the ranks"
            control = session.controls[action.index].to_wire()
            if ids.latent_receiver is not None:
                self._task(ids.latent_receiver, "expect_latent", sid, action.index, track=False)
            for i, identity in enumerate(ids.dit):
                self._task(identity, "denoise", sid, action.index, control=control, track=i == 0)
        elif isinstance(action, sch.RunDecode):
            if ids.frames is not None:
                self._task(ids.frames, "expect_frames", sid, action.index)
            self._task(ids.decode, "decode", sid, action.index)
        elif isinstance(action, sch.Emit):
            self._emit(session, action)
        elif isinstance(action, sch.SessionReady):
            if self.exporter is not None:
                self.exporter.on_open()
            g = self.geometry
            self._to_client(session, protocol.Opened(
                req=session.open_req, session=sid, height=g.height, width=g.width, fps=self.config.stream.fps,
                frames_first_chunk=g.frames_in_chunk(0), frames_per_chunk=g.frames_in_chunk(1),
                num_chunks=session.num_chunks))
        elif isinstance(action, sch.Release):
            if action.stage is sch.Stage.ENCODE:
                self._task(ids.condition, "release", sid)
            elif action.stage is sch.Stage.DECODE:
                self._task(ids.decode, "release", sid)
            else:
                session.released.pop(sch.Stage.DENOISE.value, None)  # a retry counts confirmations afresh
                for identity in ids.dit:
                    self._task(identity, "release", sid)
        elif isinstance(action, sch.SessionFailed):
            self.metrics.on_error("stage_failed")
            self._to_client(session, protocol.Error(session=sid, code="failed", message=action.error))
        elif isinstance(action, sch.SessionClosed):
            now = time.monotonic()
            summary = self.metrics.close_session(sid, now)
            summary["clock_offsets"] = self.clock.to_dict()
            summary["released"] = session.released  # stage -> ranks that confirmed, in release order
            summary["leaked_caches"] = [s.value for s in action.leaked]
            summary["poisoned"] = action.poisoned
            self._to_client(session, protocol.Closed(session=sid, reason=action.reason, error=action.error,
                                                     summary=summary))
            self.ctx.frames.drop_session(sid)
            del self.sessions[sid]
            log.info("session %s closed (%s)", sid, action.reason)

    def _emit(self, session: ClientSession, action: sch.Emit) -> None:
        frames = self.ctx.frames.take((action.session, action.index), EMIT_WAIT_S)  # present by now: never stall
        control = session.controls.pop(action.index)
        for rank, mem in self.memory.items():
            session.metrics.on_memory(rank, max(mem["peak_rss"], mem["cuda_peak"]))
        record = ChunkRecord(action.index, frames.shape[0], action.times, control.to_wire(),
                             session.take_spans(action.index))
        self.metrics.on_chunk(action.session, record)
        if self.exporter is not None:
            period = None if session.last_emitted is None else action.times.emitted - session.last_emitted
            self.exporter.on_chunk(record.frames, action.times.control_to_output, period)
        session.last_emitted = action.times.emitted
        message = protocol.Chunk(session=action.session, index=action.index, frames=frames.numpy().tobytes(),
                                 shape=tuple(frames.shape), control=control.to_wire(),
                                 facts=facts_of(record))
        self._to_client(session, message)

    def _to_client(self, session: ClientSession, message: Any) -> None:
        if session.gone:
            return  # dropped until the owner resumes (or the client timeout closes the session)
        why = send_or_why(self.clients, session.client, message)
        if why == "gone":  # disconnected: it may reconnect and resume within server.client_timeout_s
            session.gone = True
            log.info("session %s: client disconnected; waiting %.0f s for a resume", session.id,
                     self.config.server.client_timeout_s)
        elif why == "full":  # connected but not reading: never buffer without bound
            session.gone = True
            log.info("session %s: client stopped reading, closing", session.id)
            self._close(session.id, "disconnect", time.monotonic())

    def _close(self, sid: str, reason: str, now: float) -> None:
        session = self.sessions.get(sid)
        if session is None:
            return
        session.closing = True
        try:
            self._execute(self.scheduler.close(sid, reason, now))
        except sch.SchedulerError as error:
            log.warning("close of %s: %s", sid, error)

    def _cut_live_controls(self) -> None:
        for sid, session in list(self.sessions.items()):
            if session.live is not None:
                self._guarded(sid, lambda sid=sid, session=session: self._cut_live(sid, session))

    def _guarded(self, sid: str, work: Callable[[], object]) -> None:
        """Run ``work`` for one session; an unexpected error fails that session only."""
        try:
            work()
        except JobFailed:
            raise
        except Exception as error:
            log.exception("internal error in session %s", sid)
            self._contain(sid, None, None, error)

    def _cut_live(self, sid: str, session: ClientSession) -> None:
        """The non-blocking path of live sessions: cut a snapshot when the scheduler can take one now and the DiT
        is about to need it (the session has no denoise running and no snapshot waiting)."""
        if session.live is None or session.closing or sid not in self.scheduler.sessions():
            return
        # As late as the DiT allows: a snapshot cut while this session's previous chunk still denoises, or
        # while another snapshot waits for the DiT, would only grow older before the model sees it.
        running = self.scheduler.role_task(sch.Stage.DENOISE)
        if self.scheduler.edges(sid).control > 0 or (
            running is not None and running.session == sid and running.kind is sch.TaskKind.RUN
        ):
            return
        index = self.scheduler.next_control_index(sid)
        if self.scheduler.can_submit(sid, index):
            snapshot = session.live.cut(index, self.scheduler.next_emit_index(sid))
            if snapshot is not None:
                self._accept(session, index, snapshot)

    def _accept(self, session: ClientSession, index: int, control: ChunkControl) -> list[sch.Action]:
        actions = self.scheduler.submit_control(session.id, index, time.monotonic(), payload=control)
        session.controls[index] = control
        for action in actions:
            self._act(action)
        return actions

    # ---------------------------------------------------------------------------------------------- clients

    def _drain_clients(self) -> None:
        limit = self.config.server.max_message_bytes
        began = time.monotonic()
        while time.monotonic() - began < TURN_BUDGET_S:  # bounded per turn: pings and workers are served too
            try:
                identity, data = self.clients.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:
                continue  # a frame count we do not speak: not a DEALER client
            now = time.monotonic()
            self._remember_peer(identity, now)
            try:
                message = protocol.decode(data, "client", max_bytes=limit)
            except protocol.ProtocolViolation as error:
                self._reject("bad_message")
                send_to(self.clients, identity, protocol.Error(code="bad_message", message=str(error)))
                continue
            try:
                self._on_client(identity, message, now)
            except ClientError as error:
                self._reject(error.code)
                send_to(self.clients, identity, protocol.Error(req=getattr(message, "req", None),
                                                               session=getattr(message, "session", None),
                                                               code=error.code, message=str(error),
                                                               retry_after_s=error.retry_after_s))
            except JobFailed:
                raise
            except Exception as error:  # a bug must cost one request (and its session), never the server
                log.exception("internal error handling %s", type(message).__name__)
                self._contain(getattr(message, "session", None), identity, getattr(message, "req", None), error)
            self._cut_live_controls()

    def _contain(self, sid: str | None, identity: bytes | None, req: int | None, error: Exception) -> None:
        """After an unexpected error: tell the requester and fail the session it concerns (caches released)."""
        self.metrics.on_error("internal")
        text = f"internal error: {type(error).__name__}: {error}"
        if identity is not None:
            send_to(self.clients, identity, protocol.Error(req=req, session=sid, code="internal", message=text))
        if sid in self.sessions and not self.sessions[sid].closing:
            session = self.sessions[sid]
            self._to_client(session, protocol.Error(session=sid, code="failed", message=text))
            try:
                self._close(sid, "failed", time.monotonic())
            except JobFailed:
                raise
            except Exception:  # the session cannot even close cleanly: forget it rather than stop serving
                log.exception("session %s could not be closed; dropping it", sid)
                self.sessions.pop(sid, None)

    def _reject(self, reason: str) -> None:
        self.metrics.on_reject(reason)
        if self.exporter is not None:
            self.exporter.on_reject(reason)

    def _remember_peer(self, identity: bytes, now: float) -> None:
        self.peers[identity] = now
        if len(self.peers) > 1024:  # bounded: forget the longest-silent peers
            for old in sorted(self.peers, key=self.peers.__getitem__)[:256]:
                del self.peers[old]

    def _owned(self, identity: bytes, sid: str) -> ClientSession:
        session = self.sessions.get(sid)
        if session is None or session.client != identity:
            raise ClientError("unknown_session", f"no session {sid!r} for this client")
        return session

    def _on_client(self, identity: bytes, message: Any, now: float) -> None:
        for session in self.sessions.values():
            if session.client == identity:
                session.last_heard = now
        if isinstance(message, protocol.Open):
            self._open(identity, message, now)
        elif isinstance(message, protocol.Control):
            session = self._owned(identity, message.session)
            if session.live is not None:
                raise ClientError("bad_control", "this session is live: send control_state, not indexed controls")
            try:
                control = ChunkControl(keys=frozenset(k.lower() for k in message.keys), mouse=message.mouse,
                                       poses=None if message.poses is None else tuple(map(tuple, message.poses)))
            except ValueError as error:
                raise ClientError("bad_control", str(error)) from None
            if message.poses is not None and len(message.poses) != self.geometry.frames_in_chunk(message.index):
                raise ClientError("bad_control", f"chunk {message.index} has "
                                  f"{self.geometry.frames_in_chunk(message.index)} video frames, got "
                                  f"{len(message.poses)} poses")
            try:
                self._accept(session, message.index, control)
            except sch.AdmissionError as error:
                if error.retryable:  # edge capacity: the same control will be accepted once work moves on
                    raise ClientError("control_backpressure", str(error), retry_after_s=BACKPRESSURE_RETRY_S) from None
                raise ClientError("rejected_control", str(error)) from None
            except sch.SchedulerError as error:
                raise ClientError("rejected_control", str(error)) from None
            send_to(self.clients, identity, protocol.Accepted(req=message.req, session=session.id,
                                                              index=message.index))
        elif isinstance(message, protocol.ControlState):
            session = self._owned(identity, message.session)
            if session.live is None:
                raise ClientError("bad_control", "this session takes indexed controls; open it with live=true")
            try:
                session.live.update(ControlState.from_wire(msgspec.structs.asdict(message)))
            except ControlStateError as error:
                raise ClientError(error.reason, str(error)) from None
        elif isinstance(message, protocol.Close):
            self._owned(identity, message.session)
            self._close(message.session, "client", now)
        elif isinstance(message, protocol.Stats):
            send_to(self.clients, identity, protocol.StatsReply(req=message.req, stats=self.stats(now)))
        elif isinstance(message, protocol.Heartbeat):
            if message.session is not None:
                session = self.sessions.get(message.session)
                if session is None or (session.owner_token != identity and session.client != identity):
                    raise ClientError("unknown_session", f"no session {message.session!r} to resume")
                session.client, session.gone, session.last_heard = identity, False, now
            send_to(self.clients, identity, protocol.HeartbeatAck(req=message.req, session=message.session))

    def _open(self, identity: bytes, message: protocol.Open, now: float) -> None:
        server = self.config.server
        if message.num_chunks is not None and not 1 <= message.num_chunks <= server.max_chunks:
            raise ClientError("bad_request", f"num_chunks must be in 1..{server.max_chunks}, got {message.num_chunks}")
        if len(message.prompt) > server.max_prompt_chars:
            raise ClientError("bad_request", f"prompt of {len(message.prompt)} characters exceeds the limit of "
                              f"{server.max_prompt_chars}")
        if len(self.sessions) + len(self.opening) >= server.max_sessions:
            raise ClientError("busy", f"the server is at its limit of {server.max_sessions} sessions",
                              retry_after_s=5.0)
        # Decoding a start image can take tens of milliseconds: off this thread, so no stream waits for it.
        future = self.image_decoder.submit(decode_image, message.image, server.max_image_pixels, self.geometry.width,
                                           self.geometry.height)
        self.opening.append((identity, message, future))

    def _finish_opens(self) -> None:
        """Sessions whose start image is decoded are created, in the order they were asked for."""
        while self.opening and self.opening[0][2].done():
            identity, message, future = self.opening.popleft()
            try:
                image = future.result()
            except ClientError as error:
                self._reject(error.code)
                send_to(self.clients, identity, protocol.Error(req=message.req, code=error.code, message=str(error)))
                continue
            self._guarded("", functools.partial(self._create, identity, message, image, time.monotonic()))

    def _create(self, identity: bytes, message: protocol.Open, image: bytes, now: float) -> None:
        server = self.config.server
        sid = uuid.uuid4().hex[:12]
        live = LiveControls(pause_when_idle=message.pause_when_idle) if message.live else None
        metrics = self.metrics.open_session(sid, now, self.config.stream.fps, self.config.metrics.warmup_chunks)
        self.sessions[sid] = ClientSession(
            id=sid, client=identity, owner_token=identity, open_req=message.req, seed=message.seed,
            prompt=message.prompt, image=image, num_chunks=message.num_chunks, live=live, metrics=metrics,
            last_heard=now)
        self._execute(self.scheduler.open(sid, message.num_chunks or server.max_chunks, now))

    def stats(self, now: float) -> dict[str, Any]:
        return {
            **self.metrics.to_dict(now),
            "open_sessions": len(self.sessions),
            "ranks": {str(r): m for r, m in sorted(self.memory.items())},
            "clock_offsets": self.clock.to_dict(),
            "layout": self.config.layout.name,
            "schedule": self.config.scheduler.mode,
        }

    # ---------------------------------------------------------------------------------------------- ending

    def _notify_all(self, code: str, message: str) -> None:
        """Tell every client we know of, sessions or not, before the job ends."""
        for identity in list(self.peers):
            session = next((s.id for s in self.sessions.values() if s.client == identity), None)
            send_to(self.clients, identity, protocol.Error(session=session, code=code, message=message))

    def _shutdown(self, code: str, message: str) -> None:
        """Order every worker to stop, tell every client, wait (briefly) for the workers' acknowledgements."""
        waiting = {i for i in self.ids.all if send_to(self.workers, i, protocol.Task(op="shutdown"))}
        lost = sorted({i.decode().split(":")[0] for i in set(self.ids.all) - waiting}, key=int)
        if lost:  # under torchrun a dead rank reaches rank 0 as a SIGTERM: say what really happened
            code, message = "rank_failed", f"rank {', '.join(lost)} is gone; the job is ending"
        self._notify_all(code, message)
        for sid, session in list(self.sessions.items()):
            self._to_client(session, protocol.Closed(session=sid, reason="shutdown", error=message,
                                                     summary=self.metrics.close_session(sid, time.monotonic())))
        deadline = time.monotonic() + 5.0
        while waiting and time.monotonic() < deadline:
            if self.workers.poll(50):
                identity, data = self.workers.recv_multipart()
                done = protocol.decode(data, "worker", max_bytes=WORKER_MESSAGE_BYTES)
                if isinstance(done, protocol.Done) and done.op == "shutdown":
                    waiting.discard(identity)
        if waiting:
            log.warning("workers %s did not acknowledge shutdown", sorted(i.decode() for i in waiting))


class ClientError(Exception):
    def __init__(self, code: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


def decode_image(data: bytes, max_pixels: int, width: int, height: int) -> bytes:
    """PNG/JPEG bytes -> raw uint8 RGB ``[height, width, 3]`` bytes, bicubic-resized to the stream geometry."""
    try:
        with Image.open(io.BytesIO(data), formats=["PNG", "JPEG"]) as img:  # no other decoder is reachable
            if img.width * img.height > max_pixels:
                raise ClientError("bad_image", f"image of {img.width}x{img.height} pixels exceeds the limit of "
                                  f"{max_pixels} pixels")
            rgb = img.convert("RGB")
            if rgb.size != (width, height):
                rgb = rgb.resize((width, height), Image.Resampling.BICUBIC)
            return np.asarray(rgb, dtype=np.uint8).tobytes()
    except ClientError:
        raise
    except Exception as error:
        raise ClientError("bad_image", f"the start image could not be decoded as PNG or JPEG: {error}") from None
