"""The coordinator loop on rank 0: the I/O shell around the coordinator core (``runtime.core``).

One thread owns both ROUTER sockets (clients, role workers). Each turn it drains what arrived, steps the core with
the rank-0 time, and carries out the outputs in order: messages to workers and clients, start images decoded on a
worker thread, each chunk's frames taken from the mailbox and sent. What it learns while doing so (a client gone,
a worker unreachable, frames missing, an image decoded) is an event of the next turn. Every rule lives in the core.
"""

from __future__ import annotations

import logging
import time

import zmq

from ipc import protocol
from ipc import tensor_plane as tp
from ipc.chunk_wire import chunk_parts
from ipc.client_lines import ClientLines, Lost
from ipc.transport import send_or_why, send_to
from ranks import probe_server, prometheus
from ranks.coordinator_inputs import await_hellos, await_shutdown_done, drain_clients, drain_workers
from ranks.coordinator_setup import build_core, probe_snapshot, write_port_file
from ranks.memory import cache_bytes
from ranks.offloop import OffLoop
from ranks.processes import DeathHold, RankWatch
from ranks.worker import RankContext, memory_facts
from runtime import core_types as ct
from runtime.config import Config
from runtime.core import CoordinatorCore
from runtime.placement import placement_of
from runtime.sizes import served_sizes
from runtime.warm_start import WarmStart
from runtime.watchers import Feeds

log = logging.getLogger(__name__)

POLL_MS = 5
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
        self.stopping = False  # set by a signal handler (the second) or the drain's end
        self.drain_asked = False  # set by a signal handler (the first): the core drains (``runtime.drain``)
        self.fatal: str | None = None  # set from another thread of this rank that cannot go on
        self.offloop = OffLoop()  # image decodes, manifest reads and writes, listings, file removal
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
        if not await_hellos(self.workers, set(self.where.all), self.timeouts.startup_s, self._hello):
            return ct.EXIT_FAILED
        c = self.config
        self.core = build_core(c, self.ctx.backend.geometry, self.ctx.groups.device.type, self.exporter, self.rooms,
                               self.warm_start)
        self._publish()
        write_port_file(port)
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
            if self.drain_asked and not self.core.draining.active:
                dead = self._dead_ranks()  # the signal may be torchrun's word of a dead rank: then no drain
                code = self._carry_out(self.core.step(dead or [ct.DrainRequested()], time.monotonic()))
                self._publish()  # not ready from now on
                if code is not None:
                    return code
            ready = dict(poller.poll(POLL_MS))
            # Workers first, and their tasks sent before clients are read: the ranks never wait on a client flood.
            code = self._carry_out(self.core.step(self._gather(self.workers in ready), time.monotonic()))
            if code is None and self.clients in ready:
                read = list(drain_clients(self.clients, self.server.max_message_bytes))
                code = self._carry_out(self.core.step(read, time.monotonic()))
            if code is not None:
                return code

    def signalled(self) -> str:
        """A stop signal (from a handler): the first drains when there is a drain time and the loop serves; a second
        (or one before the loop serves) stops at once. What it does, for the log."""
        if self.drain_asked or self.server.drain_s <= 0 or self.core is None or self.core.draining.active:
            self.stopping = True
            return "stopping"
        self.drain_asked = True
        return f"draining (server.drain_s {self.server.drain_s:.0f} s; a second signal stops at once)"

    def _hello(self, hello: protocol.Hello) -> None:
        self.watch.add(hello.rank, hello.pid, hello.host)
        self.rooms[hello.rank] = hello.room
        self.warm_start.add(hello.rank, hello.warm_up)
        self._publish()

    def _publish(self) -> None:
        """What the probe server answers from until the next call: built here, on the loop, from the loop's state."""
        if self.probes is None:
            return
        self.probes.publish(probe_snapshot(self.core, self.config.layout.world_size, len(self.rooms),
                                           self.warm_start.warm, self.stopping))

    # ---------------------------------------------------------------------------------------------- inputs

    def _gather(self, workers: bool) -> list[ct.Event]:
        """Everything but client messages: what the last turn learnt, workers' messages, decoded images, timers."""
        carried, self.carried = self.carried, []
        now = time.monotonic()
        arrived = list(drain_workers(self.workers)) if workers else []
        if self.fatal is not None and not self.fatal_reported:
            self.fatal_reported = True
            arrived.insert(0, ct.RankLost(f"rank {self.ctx.rank}: {self.fatal}"))
        # a failed send to a rank is a job-ending report too: it waits for the dead rank like a peer's report
        dead, arrived = self.hold.sift([*carried, *arrived], self._dead_ranks, now)
        events: list[ct.Event] = [*dead, *arrived]
        events += self.offloop.done()
        if now >= self.next_memory:  # rank 0 has no heartbeat thread of its own
            self.next_memory = now + self.timeouts.heartbeat_s
            events.append(ct.MemorySampled(self.ctx.rank, *memory_facts(), cache_bytes=cache_bytes(self.ctx.backend)))
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
            elif isinstance(output, ct.DecodeImage | ct.ReadManifest | ct.WriteManifest | ct.ListSnapshots
                            | ct.DropSnapshotFiles):
                assert self.core is not None
                self.offloop.start(output, self.core.saving.store)
            elif isinstance(output, ct.DropTensors):
                self.ctx.inbox[protocol.Edge.FRAMES].drop_session(output.session)
            elif isinstance(output, ct.DrainEnded):
                self.stopping = True  # stopped as on a stop signal on the next turn
            elif isinstance(output, ct.Stop):
                self._lost(self.lines.flush(), unreachable)  # what the clients can still take before the end
                self._flush_feeds()  # what the watchers can still take (their closed) before the end
                return output.code
        self._lost(self.lines.flush(), unreachable)  # every turn: a client whose queue was full may have read since
        self._flush_feeds()  # every turn: a watcher whose queue was full may have read since
        return None

    def _flush_feeds(self) -> None:
        """Send each watcher what its feed holds, as far as its queue takes it now (never waiting)."""
        gone = self.feeds.flush(lambda who, item: send_or_why(self.clients, who, item, copy=False),
                                time.monotonic())
        self.carried.extend(ct.ClientUnreachable(who, sid, "gone") for who, sid in gone)

    def _to_client(self, identity: bytes, message: object, session: str | None,
                   unreachable: set[tuple[bytes, str]], chunk: bool = False) -> None:
        data = message if isinstance(message, bytes | tuple) else protocol.encode(message)  # a tuple: a chunk's parts
        self._lost(self.lines.send(identity, data, session, chunk), unreachable)

    def _lost(self, lost: list[Lost], unreachable: set[tuple[bytes, str]]) -> None:
        for event in lost:
            if (event.identity, event.session) not in unreachable:
                unreachable.add((event.identity, event.session))  # reported once per turn
                self.carried.append(ct.ClientUnreachable(event.identity, event.session, event.why))

    def _emit(self, output: ct.EmitChunk, unreachable: set[tuple[bytes, str]]) -> None:
        index = output.facts.index
        try:  # present by now (decode counts as done once they arrived): never stall on them
            frames = self.ctx.inbox[protocol.Edge.FRAMES].take((output.session, index), EMIT_WAIT_S)
        except (TimeoutError, tp.Dropped) as error:
            self.carried.append(ct.FramesMissing(output.session, index, str(error)))
            return
        if output.to is None and not output.watchers:
            return
        data = chunk_parts(output.session, frames, output.facts)  # the tensor's buffer itself, for all of them
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
        await_shutdown_done(self.workers, waiting, SHUTDOWN_WAIT_S)
        self.offloop.shutdown()
        return ct.EXIT_OK if code is None else code

