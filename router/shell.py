"""The router's process: the I/O shell around the router core (``runtime.router``).

    python -m router --config configs/router/router.toml [--router.key=value ...]

One thread owns every socket: the clients' ROUTER (the same socket, options and limits as a server's), one DEALER
per replica (the router is a client of each), and the registration ROUTER when ``router.register_bind`` is set.
Each turn it drains the replicas first (chunks are the latency path), steps the core, sends what it asked, then
does the same for the clients. Chunks are received and sent as ``zmq.Frame`` objects, a chunk's map and its frames
part (``ipc.chunk_wire``) as the tuple of both: they cross the router without a copy or a decode (``ipc.chunk_wire
.peek_chunk`` reads the session and checks the parts only). What a send teaches (a client gone
or full, a replica connection full) is an event of the next turn. Every rule lives in the core.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import zmq

from ipc import chunk_wire, protocol, relay, tolerant, transport
from ipc.client_lines import MAX_WAITING, ClientLines, Lost
from ranks import probe_server
from runtime import logs, replicas
from runtime import router_types as rt
from runtime.config import ConfigError
from runtime.metrics import StreamStat
from runtime.probes import router_snapshot
from runtime.router import RouterCore
from runtime.router_config import RouterConfig, load, replica_queue, tokens
from runtime.snapshots import SnapshotError, SnapshotStore, remove_files
from runtime.watchers import Feeds

log = logging.getLogger("worldstream.router")

TICK_S = 0.05  # timers (pings, stats, deadlines) are looked at this often
TIMES_S = 1.0  # the shell's own measures reach the core (and stats) this often
DRAIN_MAX = 256  # messages read from one socket per turn, so no socket starves the others
REGISTER_MESSAGE_BYTES = 1 << 16
SHUTDOWN_LINGER_MS = 500  # the closes sent to replicas at shutdown get this long to leave


@dataclass
class Link:
    """The connection to one replica."""

    sock: zmq.Socket
    generation: int


class RouterShell:
    def __init__(self, config: RouterConfig, context: zmq.Context | None = None) -> None:
        self.config = config
        self.section = config.router
        self.context = context or zmq.Context.instance()
        self.clients, self.port = transport.client_router(self.context, self.section.host, self.section.port,
                                                          self.section.send_hwm, self.section.max_message_bytes)
        self.registry: zmq.Socket | None = None
        self.register_endpoint = ""
        if self.section.register_bind:
            self.registry = self.context.socket(zmq.ROUTER)
            self.registry.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.registry.setsockopt(zmq.LINGER, 0)
            self.registry.setsockopt(zmq.MAXMSGSIZE, REGISTER_MESSAGE_BYTES)  # registrations are tiny
            self.registry.bind(self.section.register_bind)
            self.register_endpoint = self.registry.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.hwm_in, self.hwm_out, self.largest = replica_queue(self.section)  # each link bounded in bytes
        self.me = uuid.uuid4().hex[:8]  # in each connection's identity: a restarted router is a new client
        self.links: dict[str, Link] = {}
        self.names: dict[zmq.Socket, str] = {}
        self.poller = zmq.Poller()
        self.poller.register(self.clients, zmq.POLLIN)
        if self.registry is not None:
            self.poller.register(self.registry, zmq.POLLIN)
        self.carried: list[rt.Event] = []
        self.read_at: dict[int, float] = {}  # this turn's chunks: id(frame) -> when read off its replica's socket
        self.hold = StreamStat()  # a chunk's stay in the router: read -> queued for its client (reported in stats)
        self.stopping = False  # set by a signal handler
        # each watcher's outbox (``runtime.watchers``): a chunk's frame is queued for every watcher, never copied
        self.feeds = Feeds(self.section.watch_queue, self.section.client_timeout_s)
        # replies and chunks that met a client's full queue wait in its line (``ipc.client_lines``), never vanish
        self.lines = ClientLines(self._to_watcher, MAX_WAITING)
        client_token, self.replica_token = tokens(self.section)  # (``ipc.auth``) the clients', the replicas'
        self.rewrite = client_token is not None or self.replica_token is not None  # ``relay.upstream``
        self.core = RouterCore(self.section, config.replicas, time.monotonic(), router_id=f"router-{self.me}",
                               auth_token=client_token)
        self.file_remover = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot-remove")
        self.forwarded_bytes = 0  # bytes of replicas' messages sent on to clients and watchers (``/metrics``)
        self.probes = probe_server.start(self.section.metrics_host, self.section.metrics_port, "router",
                                         what="router.metrics_host/_port")

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.section.host}:{self.port}"

    def run(self) -> int:
        """Route until a signal asks to stop; the exit code."""
        port_file = os.environ.get("WORLDSTREAM_PORT_FILE")  # written once serving: tests and scripts wait on it
        code = self._carry_out(self.core.step([rt.Tick()], time.monotonic()))
        if port_file:
            with open(f"{port_file}.tmp", "w") as f:
                f.write(str(self.port))
            os.replace(f"{port_file}.tmp", port_file)
        log.info("routing on %s for %d listed replicas%s", self.endpoint, len(self.config.replicas),
                 f"; registrations on {self.register_endpoint}" if self.registry is not None else "")
        next_tick = next_times = time.monotonic() + TICK_S
        while code is None:
            if self.stopping:
                self._publish()  # not ready from now on
                return self._shutdown()
            now = time.monotonic()
            wait = 0 if self.carried else max(0.0, next_tick - now)
            ready = dict(self.poller.poll(int(wait * 1000) + (0 if self.carried else 1)))
            events, self.carried = self.carried, []
            for sock in ready:
                if sock in self.names:
                    events.extend(self._drain_replica(sock))
            if self.registry is not None and self.registry in ready:
                events.extend(self._drain_registry())
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + TICK_S
                events.append(rt.Tick())
                self._publish()
            if now >= next_times:  # its percentiles cost a little: once a second is fresh enough for stats
                next_times = now + TIMES_S
                events.append(rt.ShellTimes(self.hold.distribution(), self.feeds.dropped))
            if events:
                code = self._carry_out(self.core.step(events, now))
            if code is None and self.clients in ready:
                code = self._carry_out(self.core.step(list(self._drain_clients()), time.monotonic()))
        self._close()
        return code

    def _publish(self) -> None:
        """What the probe server answers from until the next tick: built here, on the loop."""
        if self.probes is None:
            return
        core = self.core
        self.probes.publish(router_snapshot(
            replicas={name: r.state is replicas.State.UP for name, r in core.replicas.items()},
            placements=core.sessions_total, migrations=core.migration.migrations, open_sessions=len(core.sessions),
            chunks_forwarded=core.chunks_forwarded, forwarded_bytes=self.forwarded_bytes, stopping=self.stopping))

    # ---------------------------------------------------------------------------------------------- inputs

    def _drain_replica(self, sock: zmq.Socket) -> Iterator[rt.Event]:
        name = self.names[sock]
        generation = self.links[name].generation
        for _ in range(DRAIN_MAX):
            try:
                parts = tuple(sock.recv_multipart(zmq.NOBLOCK, copy=False))
            except zmq.Again:
                return
            try:
                head = relay.peek(parts[0].buffer)
                if head.type == "chunk" and head.session is not None:
                    chunk_wire.peek_chunk([part.buffer for part in parts])  # its parts as its map says, or refused
                    self.read_at[id(parts)] = time.perf_counter()
                    yield rt.ReplicaSent(name, generation, rt.ChunkHead(head.session), parts)
                    continue
                frame = chunk_wire.one_message(parts, head.type or "replica's")
                if head.type == "stats_reply":  # its stats read by the core, as untrusted (``read_stats``)
                    yield rt.ReplicaSent(name, generation, replicas.stats_reply(frame.buffer, self.largest), frame)
                else:  # a newer replica's additions are skipped (``tolerant``); what it needs is read strictly
                    message = tolerant.decode(frame.buffer, "server", max_bytes=self.largest)
                    if isinstance(message, tolerant.Unknown):
                        log.debug("replica %s: skipped a message of a newer type %r", name, message.type[:64])
                        continue
                    yield rt.ReplicaSent(name, generation, message, frame)
            except protocol.ProtocolViolation as error:  # a replica of another version: say so, keep routing
                log.error("unreadable message from replica %s: %s", name, str(error)[:300])

    def _drain_clients(self) -> Iterator[rt.Event]:
        limit = self.section.max_message_bytes
        for _ in range(DRAIN_MAX):
            try:
                frames = self.clients.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity = frames[0].bytes
            if len(frames) != 2:
                yield rt.ClientUnreadable(identity, f"a message is one ZeroMQ frame, got {len(frames) - 1}")
                continue
            data = frames[1]
            try:
                yield rt.ClientSent(identity, protocol.decode(data.buffer, "client", max_bytes=limit), data)
            except protocol.ProtocolViolation as error:
                yield rt.ClientUnreadable(identity, str(error), error.req, error.answer_v)

    def _drain_registry(self) -> Iterator[rt.Event]:
        assert self.registry is not None
        for _ in range(DRAIN_MAX):
            try:
                frames = self.registry.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                continue
            peer, data = frames
            try:
                yield rt.RegisterSent(peer, protocol.decode(data, "replica", max_bytes=REGISTER_MESSAGE_BYTES))
            except protocol.ProtocolViolation as error:
                yield rt.RegisterUnreadable(peer, str(error)[:300])

    # ---------------------------------------------------------------------------------------------- outputs

    def _carry_out(self, outputs: list[rt.Output]) -> int | None:
        try:
            return self._carry_out_all(outputs)
        finally:
            self.read_at.clear()  # a chunk the core dropped is not held any more

    def _carry_out_all(self, outputs: list[rt.Output]) -> int | None:
        for output in outputs:
            if isinstance(output, rt.ToClient):
                self._to_client(output)
            elif isinstance(output, rt.ToReplica):
                self._to_replica(output)
            elif isinstance(output, rt.ToRegistrant):
                self._to_registrant(output)
            elif isinstance(output, rt.Connect):
                self._connect(output)
            elif isinstance(output, rt.Disconnect):
                self._disconnect(output.replica)
            elif isinstance(output, rt.ToWatchers):
                for who in output.watchers:
                    self.feeds.put(who, output.session, output.payload)
            elif isinstance(output, rt.EndWatch):
                self.feeds.end(output.identity, output.session, output.closed, output.keep, time.monotonic())
            elif isinstance(output, rt.DropSnapshot):
                self._drop_snapshot(output.snapshot)
            elif isinstance(output, rt.Stop):
                self._lost(self.lines.flush())
                self._flush_feeds()
                return output.code
        self._lost(self.lines.flush())  # every turn: a client whose queue was full may have read since
        self._flush_feeds()  # every turn (a tick at least): a watcher whose queue was full may have read since
        return None

    def _drop_snapshot(self, snapshot: str) -> None:
        """Delete a snapshot the router asked for and needs no more: its manifest here (never restored half gone),
        its files (gigabytes) on a thread of their own, never on the loop that forwards every chunk."""
        try:
            folder = SnapshotStore(self.section.snapshots_dir).unlist(snapshot)
            self.file_remover.submit(remove_files, folder)
        except (OSError, SnapshotError) as error:  # a folder it cannot delete costs disk, never the router
            log.warning("could not delete snapshot %s: %s", snapshot, error)

    def _flush_feeds(self) -> None:
        gone = self.feeds.flush(self._to_watcher, time.monotonic())
        self.carried.extend(rt.ClientUnreachable(who, sid, "gone") for who, sid in gone)

    def _to_watcher(self, identity: bytes, item: Any) -> str | None:
        """A non-blocking send to a watcher: None when queued, else "gone" or "full" (the feed keeps it)."""
        try:
            parts = _parts(item)
            self.clients.send_multipart([identity, *parts], flags=zmq.NOBLOCK, copy=False)
            if isinstance(item, tuple | zmq.Frame):
                self.forwarded_bytes += sum(len(part) for part in parts)
            return None
        except zmq.ZMQError as error:
            why = {zmq.EHOSTUNREACH: "gone", zmq.EAGAIN: "full"}.get(error.errno)
            if why is None:
                raise
            return why

    def _to_client(self, output: rt.ToClient) -> None:
        try:
            payload = _payload(output.message)
        except (TypeError, ValueError, OverflowError) as error:  # a bug costs this message, never the router
            log.exception("could not encode a %s for a client", type(output.message).__name__)
            payload = protocol.encode(protocol.Error(code="internal",
                                                     message=f"internal error: {type(error).__name__}"))
        chunk = isinstance(output.message, tuple)  # a replica's chunk, as received (its parts); the router makes none
        self._lost(self.lines.send(output.identity, payload, output.session, chunk))
        read_at = self.read_at.pop(id(payload), None)  # handed on (sent, or waiting in the client's line)
        if read_at is not None:
            self.hold.add(time.perf_counter() - read_at)

    def _lost(self, lost: list[Lost]) -> None:
        self.carried.extend(rt.ClientUnreachable(event.identity, event.session, event.why) for event in lost)

    def _to_replica(self, output: rt.ToReplica) -> None:
        link = self.links.get(output.replica)
        try:
            if link is None or link.generation != output.generation:
                raise zmq.Again()
            payload = output.raw if output.raw is not None and not self.rewrite else relay.upstream(
                output.message, self.replica_token, self.rewrite, self.section.max_message_bytes)
            link.sock.send(payload, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:  # no connection yet (ZMQ_IMMEDIATE), or its queue is full
            if output.origin is not None:
                self.carried.append(rt.ReplicaRefused(output.replica, output.generation, output.origin))

    def _to_registrant(self, output: rt.ToRegistrant) -> None:
        assert self.registry is not None
        with contextlib.suppress(zmq.ZMQError):  # it registers again within its heartbeat and is answered then
            self.registry.send_multipart([output.peer, protocol.encode(output.message)], flags=zmq.NOBLOCK)

    def _connect(self, output: rt.Connect) -> None:
        self._disconnect(output.replica)
        sock = self.context.socket(zmq.DEALER)
        # a secret part: a replica's port hands an identity over to whoever connects with it (ROUTER_HANDOVER), and
        # the router's id and a replica's name are no secrets (heartbeat acks, stats)
        link = f"router-{self.me}-{secrets.token_hex(16)}-{output.generation}:{output.replica}"
        sock.setsockopt(zmq.IDENTITY, link.encode()[:255])
        sock.setsockopt(zmq.LINGER, 0)  # what an old connection still queued is dropped with it
        sock.setsockopt(zmq.SNDHWM, self.hwm_out)  # client messages, each within router.max_message_bytes
        sock.setsockopt(zmq.RCVHWM, self.hwm_in)  # chunks, each within router.max_chunk_mb (+ its facts)
        sock.setsockopt(zmq.MAXMSGSIZE, self.largest)  # so the marks bound bytes: a larger message drops the link
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a replica that is not connected: refuse at once
        try:
            sock.connect(output.endpoint)
        except zmq.ZMQError as error:
            log.error("replica %s: cannot connect to %s: %s", output.replica, output.endpoint, error)
            sock.close()
            return
        self.links[output.replica] = Link(sock, output.generation)
        self.names[sock] = output.replica
        self.poller.register(sock, zmq.POLLIN)

    def _disconnect(self, name: str) -> None:
        link = self.links.pop(name, None)
        if link is not None:
            self.poller.unregister(link.sock)
            del self.names[link.sock]
            link.sock.close(linger=0)

    # ---------------------------------------------------------------------------------------------- ending

    def _shutdown(self) -> int:
        code = self._carry_out(self.core.step([rt.ShutdownRequested()], time.monotonic()))
        for link in self.links.values():
            link.sock.setsockopt(zmq.LINGER, SHUTDOWN_LINGER_MS)  # the closes leave before the sockets do
        self._close()
        return 0 if code is None else code

    def _close(self) -> None:
        self.file_remover.shutdown(wait=True)  # a snapshot's files half removed would be left for ever
        if self.probes is not None:
            self.probes.close()
        for link in list(self.links.values()):
            link.sock.close()
        self.links.clear()
        self.clients.close()
        if self.registry is not None:
            self.registry.close()


def _payload(message: Any) -> Any:
    """A typed message is encoded; a payload as received (bytes, ``zmq.Frame``, a chunk's parts) goes as it is."""
    return message if isinstance(message, bytes | zmq.Frame | tuple) else protocol.encode(message)


def _parts(message: Any) -> tuple[Any, ...]:
    """The ZeroMQ parts of a message to send: a chunk's map and frames as received, else the one (encoded) part."""
    payload = _payload(message)
    return payload if isinstance(payload, tuple) else (payload,)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m router", description="worldstream router: many replicas behind one client endpoint",
        epilog="Any [router] key can be overridden after the config as --router.key=value (the value read as TOML, "
               "e.g. --router.port=6000); the keys are listed in docs/configuration.md.")
    parser.add_argument("--config", required=True, help="a router TOML file, or a name from configs/router/ (router)")
    parser.add_argument("--log-level", default=os.environ.get("WORLDSTREAM_LOG", "INFO"),
                        help="DEBUG, INFO, WARNING or ERROR (default: $WORLDSTREAM_LOG, else INFO)")
    parser.add_argument("--log-format", choices=logs.FORMATS, default=logs.default_format(),
                        help="text lines, or one JSON object a line (default: $WORLDSTREAM_LOG_FORMAT, else text)")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    logs.configure("router", args.log_level, args.log_format)
    try:
        config = load(args.config, overrides)
    except ConfigError as error:
        log.error("%s", error)
        return 2
    shell = RouterShell(config)

    def stop(signum: int, _frame: object) -> None:
        log.info("signal %d: shutting down", signum)
        shell.stopping = True  # the loop wakes within one tick

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    return shell.run()


if __name__ == "__main__":
    sys.exit(main())
