"""A replica's registration with its router: one small thread on rank 0, started by ``launch.py`` when the config
sets ``replica.router``. Nothing else of the job changes: the router reaches the replica as a client of its server.

The thread first asks its own server for its id (a client heartbeat to its client endpoint: the id every
heartbeat ack of this job carries), then owns one DEALER to the router's registration socket and sends
``register`` (name, client endpoint, ``server.max_sessions``, layout, that id as its incarnation) every
``replica.heartbeat_s``: a router that starts (or restarts) after the replica learns of it within one period, and a
requeued job under the same name takes its old place. The router tells the job behind an endpoint by the id its
heartbeats answer with, so the incarnation a registration names is the one the router sees there. The router answers
each with ``registered``; a refusal (wrong token, limit reached) is logged once per distinct reason. Sends never
block: while the router is unreachable nothing is queued.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading

import msgspec
import zmq

from ipc import protocol, tolerant
from runtime.config import ReplicaConfig, ServerConfig, client_token

log = logging.getLogger(__name__)

WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "*", "::"})


def advertised(replica: ReplicaConfig, server: ServerConfig, port: int) -> tuple[str, str]:
    """(name, client endpoint) this replica registers under."""
    host = replica.advertise_host or (socket.getfqdn() if server.host in WILDCARD_HOSTS else server.host)
    return replica.name or f"{host}:{port}", f"tcp://{host}:{port}"


def start_registration(replica: ReplicaConfig, server: ServerConfig, port: int, layout: str,
                       context: zmq.Context, stop: threading.Event) -> threading.Thread:
    name, endpoint = advertised(replica, server, port)
    message = protocol.Register(name=name, endpoint=endpoint, max_sessions=server.max_sessions, layout=layout,
                                incarnation="", token=replica.token)
    own = f"tcp://{'127.0.0.1' if server.host in WILDCARD_HOSTS else server.host}:{port}"
    token = client_token(server)  # its own server requires it of every client, this thread included

    def run() -> None:
        incarnation = server_id(own, context, stop, replica.heartbeat_s, token)
        if incarnation is not None:
            _register(replica, msgspec.structs.replace(message, incarnation=incarnation), context, stop)

    thread = threading.Thread(target=run, name="registration", daemon=True)
    thread.start()
    log.info("registering as replica %s (%s) with the router at %s", name, endpoint, replica.router)
    return thread


def server_id(endpoint: str, context: zmq.Context, stop: threading.Event, every_s: float,
              token: str | None = None) -> str | None:  # fmt: skip
    """The id the server at ``endpoint`` answers heartbeats with (asked every ``every_s`` until it answers, with the
    client ``token`` it requires), or None when ``stop`` is set first."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        while not stop.is_set():
            sock.send(protocol.encode(protocol.Heartbeat(req=1, auth=msgspec.UNSET if token is None else token)))
            if sock.poll(int(every_s * 1000)):
                with contextlib.suppress(protocol.ProtocolViolation):
                    answer = tolerant.decode(sock.recv(), "server")
                    if isinstance(answer, protocol.HeartbeatAck) and answer.server:
                        return answer.server
        return None
    finally:
        sock.close()


def _register(replica: ReplicaConfig, message: protocol.Register, context: zmq.Context,
              stop: threading.Event) -> None:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 1)
    sock.setsockopt(zmq.IMMEDIATE, 1)  # an unreachable router gets nothing queued: the next beat is fresh
    sock.setsockopt(zmq.MAXMSGSIZE, 1 << 16)
    sock.connect(replica.router)
    data = protocol.encode(message)
    said: str | None = None  # the last answer logged
    try:
        while not stop.is_set():
            with contextlib.suppress(zmq.Again):  # the router is unreachable: the next beat is fresh
                sock.send(data, flags=zmq.NOBLOCK)
            if not sock.poll(int(replica.heartbeat_s * 1000)):
                continue
            try:
                answer = tolerant.decode(sock.recv(), "router", max_bytes=1 << 16)
            except protocol.ProtocolViolation as error:
                answer = protocol.Registered(ok=False, message=f"unreadable answer: {error}")
            if isinstance(answer, tolerant.Unknown):  # a newer router's message this version does not know
                continue
            text = "ok" if answer.ok else answer.message
            if text != said:
                said = text
                (log.info if answer.ok else log.error)("router %s: registration %s", replica.router,
                                                       "accepted" if answer.ok else f"refused: {answer.message}")
            stop.wait(replica.heartbeat_s)
    finally:
        sock.close()
