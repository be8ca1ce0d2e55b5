"""The coordinator loop on rank 0: the I/O shell around the coordinator core (``runtime.core``).

One thread owns both ROUTER sockets (clients, role workers). Each turn it drains what arrived, steps the core with
the rank-0 time, and carries out the outputs in order: messages to workers and clients, start images decoded on a
worker thread, each chunk's frames taken from the mailbox and sent. What it learns while doing so (a client gone,
a worker unreachable, frames missing, an image decoded) is an event of the next turn. Every rule lives in the core.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import zmq

from ipc import protocol
from ipc import tensor_plane as tp
from ipc.client_lines import ClientLines, Lost
from ipc.transport import send_or_why, send_to
from models import memory
from ranks import probe_server, prometheus
from ranks.memory import held_bytes
from ranks.processes import DeathHold, RankWatch
from ranks.worker import RankContext, memory_facts
from runtime import core_types as ct
from runtime.config import Config
from runtime.core import CoordinatorCore
from runtime.images import decode_image
from runtime.memory_admission import Cost, gib
from runtime.placement import placement_of
from runtime.probes import rank0_snapshot
from runtime.save_rate import SaveRate
from runtime.sizes import served_sizes
from runtime.snapshots import Budget, SnapshotStore, model_identity, read_manifest, remove_files, write_manifest
from runtime.warm_start import WarmStart
from runtime.watchers import Feeds

log = logging.getLogger(__name__)

POLL_MS = 5
TURN_BUDGET_S = 0.02  # client messages read per loop turn stop after this, so pings and workers are served
WORKER_MESSAGE_BYTES = 1 << 26
EMIT_WAIT_S = 1.0  # frames are in the mailbox before decode counts as done; a miss fails the session
SHUTDOWN_WAIT_S = 5.0
PROBE_S = 0.1  # how often the rank processes on this host are looked at (a few status reads: ~0.3 ms)
FATAL_HOLD_S = 0.5  # a peer's report of a broken collective waits this long for the dead rank to show


class Coordinator:
    def __init__(self, ctx: RankContext, config: Config, clients: zmq.Socket, workers: zmq.Socket) -> None:
        self.ctx, self.clients, self.workers = ctx, clients, workers
        self.server, self.timeouts = config.server, config.timeouts
        self.where = placement_of(config.layout)
        self.config = config  # handed out section by section to the core, once every worker reported in
        self.core: CoordinatorCore | None = None
        self.stopping = False  # set by a signal handler
        self.draining = False  # for the drain to set (issue 32): /ready answers 503 while it holds; never set yet
        self.fatal: str | None = None  # set from another thread of this rank that cannot go on
        self.decoding: dict[int, Future[object]] = {}  # start images being decoded, by ticket
        self.image_decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="image-decode")
        self.reading: dict[int, Future[tuple[object, str]]] = {}  # restores' manifests being read, by ticket
        self.listing: list[tuple[str, Future[list[object]]]] = []  # the folder listed for the budget, after a save
        self.manifest_reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="manifest-read")
        self.file_remover = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot-remove")
        self.carried: list[ct.Event] = []  # learnt while carrying out outputs: events of the next turn
        self.next_memory = 0.0
        self.next_probe = 0.0
        self.hold = DeathHold(FATAL_HOLD_S)
        self.fatal_reported = False
        self.exporter = prometheus.start(config.metrics.prometheus_port)
        # up before warm-up ends: /health answers and /ready says why not while the ranks warm
        self.probes = probe_server.start(config.metrics.prometheus_host, config.metrics.prometheus_port, "rank0",
                                         None if self.exporter is None else self.exporter.registry,
                                         what="metrics.prometheus_host/_port")
        self.watch = RankWatch()  # the rank processes on this host, from the workers' hellos
        self.rooms: dict[int, int] = {}  # rank -> bytes it can give to sessions, from the workers' hellos
        self.warm_start = WarmStart(self.where, served_sizes(config.stream))  # from the hellos too
        # each watcher's outbox of chunks (``runtime.watchers``): emission never waits for a watcher
        self.feeds = Feeds(config.server.watch_queue, config.server.client_timeout_s)
        # replies and chunks that met a client's full queue wait in its line (``ipc.client_lines``), never vanish
        self.lines = ClientLines(lambda who, data: send_or_why(self.clients, who, data, copy=False),
                                 config.server.max_waiting)
        self._publish()  # no rank in yet

    def run(self, port: int) -> int:
        """Serve until shutdown or a lost rank; returns the process exit code. A failed job ends the other ranks on
        this host before it returns, so no frozen rank holds the job (and its GPUs) open."""
        code = self._serve(port)
        if code != ct.EXIT_OK:
            self.watch.end_others()
        return code

    def _serve(self, port: int) -> int:
        if not self._await_workers():
            return ct.EXIT_FAILED
        c = self.config
        session_cost = self._session_cost()  # seconds of meta-device runs: before the core's heartbeat clock starts
        self.core = CoordinatorCore(c.layout, c.server, c.stream, c.scheduler, c.timeouts, c.metrics,
                                    self.ctx.backend.geometry, time.monotonic(),
                                    observers=() if self.exporter is None else (self.exporter,),
                                    intrinsics=c.controls.intrinsics, rooms=self.rooms,
                                    session_cost=session_cost, warm_start=self.warm_start, capacity=c.capacity,
                                    snapshots=SnapshotStore(c.snapshots.dir, Budget.of(c.snapshots.max_gb,
                                                                                         c.snapshots.max_count),
                                                            SaveRate(c.snapshots.saves_per_minute,
                                                                     c.snapshots.save_burst)),
                                    model=model_identity(c.model.kind, c.model.preset, c.model.checkpoint_dir,
                                                         c.model.weights_seed))
        log.info("warm-up: %s", self.warm_start.describe())
        self._publish()
        self.core.admitting.memory.unservable_sizes.update(self.warm_start.failures())  # a rank out of memory at a size
        for reason in self.core.admitting.memory.unservable(served_sizes(c.stream)):
            log.warning("%s", reason)
        port_file = os.environ.get("WORLDSTREAM_PORT_FILE")  # written once serving: tests and scripts wait on it
        if port_file:
            with open(f"{port_file}.tmp", "w") as f:
                f.write(str(port))
            os.replace(f"{port_file}.tmp", port_file)
        log.info("serving on tcp://%s:%d: %d ranks, layout %s", self.server.host, port, c.layout.world_size,
                 c.layout.name)
        poller = zmq.Poller()
        poller.register(self.clients, zmq.POLLIN)
        poller.register(self.workers, zmq.POLLIN)
        while True:
            if self.stopping:
                self._publish()  # not ready from now on
                dead = self._dead_ranks()  # under torchrun a rank's death reaches rank 0 as a SIGTERM: name it
                if dead:
                    code = self._carry_out(self.core.step(dead, time.monotonic()))
                    if code is not None:
                        return code
                return self._shutdown()
            ready = dict(poller.poll(POLL_MS))
            # Workers first, and their tasks sent before clients are read: the ranks never wait on a client flood.
            code = self._carry_out(self.core.step(self._gather(self.workers in ready), time.monotonic()))
            if code is None and self.clients in ready:
                code = self._carry_out(self.core.step(list(self._drain_clients()), time.monotonic()))
            if code is not None:
                return code

    def _await_workers(self) -> bool:
        expected = set(self.where.all)
        deadline = time.monotonic() + self.timeouts.startup_s
        while expected:
            if time.monotonic() > deadline:
                log.error("job failed: workers %s did not report in within %.0f s",
                          sorted(i.decode() for i in expected), self.timeouts.startup_s)
                return False
            if self.workers.poll(100):
                identity, data = self.workers.recv_multipart()
                hello = protocol.decode(data, "worker", max_bytes=WORKER_MESSAGE_BYTES)
                if isinstance(hello, protocol.Hello):
                    expected.discard(identity)
                    self.watch.add(hello.rank, hello.pid, hello.host)
                    self.rooms[hello.rank] = hello.room
                    self.warm_start.add(hello.rank, hello.warm_up)
                    self._publish()
        return True

    def _session_cost(self) -> Cost | None:
        """What one more session costs each rank at a frame size (``models.memory``): every served size is priced
        here, before the port opens (a meta-device run takes about a second per size for a full-size model), so no
        session waits for it on rank 0's loop."""
        device = self.ctx.groups.device.type
        if not memory.priced(self.config, device):
            return None
        config = self.config
        priced = {size: memory.session_costs(config, *size, device) for size in served_sizes(config.stream)}
        for (height, width), cost in priced.items():
            log.info("a %dx%d session costs %s", height, width,
                     ", ".join(f"rank {r} {gib(n)}" for r, n in cost.items()))

        def cost(height: int, width: int) -> Mapping[int, int]:
            known = priced.get((height, width))
            return known if known is not None else memory.session_costs(config, height, width, device)

        return cost

    def _publish(self) -> None:
        """What the probe server answers from until the next call: built here, on the loop, from the loop's state."""
        if self.probes is None:
            return
        core, world = self.core, self.config.layout.world_size
        self.probes.publish(rank0_snapshot(
            world_size=world, ranks_in=len(self.rooms), warm=self.warm_start.warm, serving=core is not None,
            draining=self.draining, stopping=self.stopping,
            rooms=None if core is None else {r: core.admitting.memory.stats(r) for r in range(world)},
            open_sessions=0 if core is None else len(core.sessions), restored=0 if core is None else core.restored))

    # ---------------------------------------------------------------------------------------------- inputs

    def _gather(self, workers: bool) -> list[ct.Event]:
        """Everything but client messages: what the last turn learnt, workers' messages, decoded images, timers."""
        carried, self.carried = self.carried, []
        now = time.monotonic()
        arrived = list(self._drain_workers()) if workers else []
        if self.fatal is not None and not self.fatal_reported:
            self.fatal_reported = True
            arrived.insert(0, ct.RankLost(f"rank {self.ctx.rank}: {self.fatal}"))
        # a failed send to a rank is a job-ending report too: it waits for the dead rank like a peer's report
        dead, arrived = self.hold.sift([*carried, *arrived], self._dead_ranks, now)
        events: list[ct.Event] = [*dead, *arrived]
        for ticket in [t for t, future in self.decoding.items() if future.done()]:
            future = self.decoding.pop(ticket)
            error = future.exception()
            events.append(ct.ImageDecoded(ticket, None, str(error)) if error is not None  # BadImage says why
                          else ct.ImageDecoded(ticket, future.result()))  # type: ignore[arg-type]
        for ticket in [t for t, future in self.reading.items() if future.done()]:
            read = self.reading.pop(ticket)
            error = read.exception()  # a bug in the read costs this restore, never the loop
            events.append(ct.ManifestRead(ticket, None, f"the snapshot cannot be read ({type(error).__name__})")
                          if error is not None else ct.ManifestRead(ticket, *read.result()))  # type: ignore[arg-type]
        while self.listing and self.listing[0][1].done():  # in order: each after its save
            written, listed = self.listing.pop(0)
            if listed.exception() is not None:  # a save that succeeded never fails for it: the budget waits
                log.warning("the snapshot folder could not be listed: %r", listed.exception())
            stored = None if listed.exception() is not None else tuple(listed.result())
            events.append(ct.SnapshotsListed(written, stored))  # type: ignore[arg-type]
        if now >= self.next_memory:  # rank 0 has no heartbeat thread of its own
            self.next_memory = now + self.timeouts.heartbeat_s
            events.append(ct.MemorySampled(self.ctx.rank, *memory_facts(), held=held_bytes(self.ctx.backend)))
            events.append(ct.WatchDropped(self.feeds.dropped))
            self._publish()
        if now >= self.next_probe:  # often: a dead rank is named before the launcher tears the others down
            self.next_probe = now + PROBE_S
            events.extend(self._dead_ranks())
        events.append(ct.Tick())
        return events

    def _dead_ranks(self) -> list[ct.Event]:
        """The first rank found dead (the core ends the job on the first ``RankLost``; more would say nothing)."""
        return [ct.RankLost(f"rank {rank} ({', '.join(self.config.layout.roles_of(rank))}) died: {why}")
                for rank, why in self.watch.dead()[:1]]

    def _drain_workers(self) -> Iterator[ct.Event]:
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
            if not isinstance(message, protocol.Hello | protocol.ShutdownDone):
                yield ct.WorkerSent(message)

    def _drain_clients(self) -> Iterator[ct.Event]:
        began = time.monotonic()
        while time.monotonic() - began < TURN_BUDGET_S:  # bounded per turn: pings and workers are served too
            try:
                identity, *frames = self.clients.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 1:  # a DEALER sends one frame per message; anything else is answered, not dropped
                yield ct.ClientUnreadable(identity, f"a message is one ZeroMQ frame, got {len(frames)}", None)
                continue
            try:
                yield ct.ClientSent(identity, protocol.decode(frames[0], "client",
                                                              max_bytes=self.server.max_message_bytes))
            except protocol.ProtocolViolation as error:
                yield ct.ClientUnreadable(identity, str(error), error.req)

    # ---------------------------------------------------------------------------------------------- outputs

    def _carry_out(self, outputs: list[ct.Output]) -> int | None:
        """Do what the core asked, in order; the exit code once it asks to stop."""
        unreachable: set[tuple[bytes, str]] = set()
        for output in outputs:
            if isinstance(output, ct.ToWorker):
                if not send_to(self.workers, output.identity, output.message):
                    rank, role = output.identity.decode().split(":", 1)
                    self.carried.append(ct.RankLost(f"rank {rank} is unreachable (its {role} worker disconnected)"))
            elif isinstance(output, ct.ToClient):
                self._to_client(output.identity, output.message, output.session, unreachable)
            elif isinstance(output, ct.EmitChunk):
                self._emit(output, unreachable)
            elif isinstance(output, ct.EndWatch):
                self.feeds.end(output.identity, output.session, output.closed, output.keep, time.monotonic())
            elif isinstance(output, ct.DecodeImage):
                self.decoding[output.ticket] = self.image_decoder.submit(decode_image, output.data, output.max_pixels)
            elif isinstance(output, ct.ReadManifest):  # off the loop: a shared folder may hold anything
                assert self.core is not None
                self.reading[output.ticket] = self.manifest_reader.submit(read_manifest, self.core.snapshots,
                                                                          output.snapshot)
            elif isinstance(output, ct.WriteManifest):  # a small JSON file, as before the core stopped writing it
                assert self.core is not None
                error = write_manifest(self.core.snapshots, output.manifest)
                self.carried.append(ct.ManifestWritten(output.manifest.id, error))
            elif isinstance(output, ct.ListSnapshots):  # reads every manifest: never on the loop
                assert self.core is not None
                self.listing.append((output.written, self.manifest_reader.submit(self.core.snapshots.listing)))
            elif isinstance(output, ct.DropTensors):
                self.ctx.frames.drop_session(output.session)
            elif isinstance(output, ct.DropSnapshotFiles):
                self._drop_snapshot_files(output.snapshot, output.expired)
            elif isinstance(output, ct.Stop):
                self._lost(self.lines.flush(), unreachable)  # what the clients can still take before the end
                self._flush_feeds()  # what the watchers can still take (their closed) before the end
                return output.code
        self._lost(self.lines.flush(), unreachable)  # every turn: a client whose queue was full may have read since
        self._flush_feeds()  # every turn: a watcher whose queue was full may have read since
        return None

    def _drop_snapshot_files(self, snapshot: str, expired: bool) -> None:
        """Delete a failed save's folder (it has no manifest) or a snapshot over the budget (its manifest first);
        one it cannot delete costs disk, never the server."""
        assert self.core is not None
        try:
            folder = self.core.snapshots.unlist(snapshot)
            self.file_remover.submit(remove_files, folder)  # gigabytes: never on the loop that serves the streams
        except (OSError, ValueError) as error:
            log.warning("could not delete the files of %s snapshot %s: %s", "expired" if expired else "failed",
                        snapshot, error)

    def _flush_feeds(self) -> None:
        """Send each watcher what its feed holds, as far as its queue takes it now (never waiting)."""
        gone = self.feeds.flush(lambda who, item: send_or_why(self.clients, who, item, copy=False),
                                time.monotonic())
        self.carried.extend(ct.ClientUnreachable(who, sid, "gone") for who, sid in gone)

    def _to_client(self, identity: bytes, message: object, session: str | None,
                   unreachable: set[tuple[bytes, str]], chunk: bool = False) -> None:
        data = message if isinstance(message, bytes) else protocol.encode(message)
        self._lost(self.lines.send(identity, data, session, chunk), unreachable)

    def _lost(self, lost: list[Lost], unreachable: set[tuple[bytes, str]]) -> None:
        for event in lost:
            if (event.identity, event.session) not in unreachable:
                unreachable.add((event.identity, event.session))  # reported once per turn
                self.carried.append(ct.ClientUnreachable(event.identity, event.session, event.why))

    def _emit(self, output: ct.EmitChunk, unreachable: set[tuple[bytes, str]]) -> None:
        index = output.facts.index
        try:  # present by now (decode counts as done once they arrived): never stall on them
            frames = self.ctx.frames.take((output.session, index), EMIT_WAIT_S)
        except (TimeoutError, tp.Dropped) as error:
            self.carried.append(ct.FramesMissing(output.session, index, str(error)))
            return
        if output.to is None and not output.watchers:
            return
        data = protocol.encode(protocol.Chunk(session=output.session, frames=frames.numpy().tobytes(),
                                              shape=tuple(frames.shape), facts=output.facts))  # once for all
        if output.to is not None:
            self._to_client(output.to, data, output.session, unreachable, chunk=True)
        for who in output.watchers:
            self.feeds.put(who, output.session, data)

    # ---------------------------------------------------------------------------------------------- ending

    def _shutdown(self) -> int:
        """Order every worker to stop, let the core tell every client, wait (briefly) for the acknowledgements."""
        assert self.core is not None
        waiting = {i for i in self.where.all if send_to(self.workers, i, protocol.Shutdown())}
        lost = sorted({int(i.decode().split(":")[0]) for i in set(self.where.all) - waiting})
        code = self._carry_out(self.core.step([ct.ShutdownRequested(tuple(lost))], time.monotonic()))
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        while waiting and time.monotonic() < deadline:
            if self.workers.poll(50):
                identity, data = self.workers.recv_multipart()
                message = protocol.decode(data, "worker", max_bytes=WORKER_MESSAGE_BYTES)
                if isinstance(message, protocol.ShutdownDone):
                    waiting.discard(identity)
        if waiting:
            log.warning("workers %s did not acknowledge shutdown", sorted(i.decode() for i in waiting))
        self.image_decoder.shutdown(wait=False, cancel_futures=True)
        self.manifest_reader.shutdown(wait=False, cancel_futures=True)
        self.file_remover.shutdown(wait=True)  # a snapshot's files half removed would be left for ever
        return ct.EXIT_OK if code is None else code

