"""ZeroMQ sockets of the control plane. One thread owns each socket; nothing here is shared across threads.

- ``client_router``: the coordinator's client-facing ROUTER, loopback by default, ``ROUTER_MANDATORY`` set so a
  message to a vanished or full peer raises instead of vanishing, ``ROUTER_HANDOVER`` so a reconnecting identity
  is heard at once, a bounded send queue per peer, and
  ``MAXMSGSIZE``: a frame larger than the message limit (plus a margin that still earns a ``bad_message`` reply)
  makes ZeroMQ drop the connection before buffering it, so a huge frame never costs rank 0 its size in memory.
  The limit is per frame (a message of many frames is buffered whole before it can be refused) and the receive
  queue is bounded in messages, not bytes: the port is for trusted clients, loopback unless exposed on purpose.
- ``worker_router``: the coordinator's ROUTER for the role workers of every rank.
- ``WorkerLink``: one worker thread's DEALER to the coordinator, identity ``"<rank>:<role>"``.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import zmq

from ipc import protocol

LINGER_MS = 200  # pending messages get this long to leave at close; never block shutdown


OVERSIZE_MARGIN = 1 << 20  # frames up to max_message_bytes + this are read and answered; larger ones drop the peer


def client_router(context: zmq.Context, host: str, port: int, send_hwm: int,
                  max_message_bytes: int) -> tuple[zmq.Socket, int]:  # fmt: skip
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    # A client that reconnects with its identity (to resume its session) takes the identity over at once; without
    # this ZeroMQ ignores the newcomer until it has noticed that the old connection is gone.
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + OVERSIZE_MARGIN)
    sock.setsockopt(zmq.SNDHWM, send_hwm)
    sock.setsockopt(zmq.RCVHWM, 100)  # per client; legitimate clients have a few requests in flight
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    if port == 0:
        port = sock.bind_to_random_port(f"tcp://{host}")
    else:
        sock.bind(f"tcp://{host}:{port}")
    return sock, port


def worker_router(context: zmq.Context, host: str) -> tuple[zmq.Socket, str]:
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDHWM, 10_000)  # bounded; commands are small and few per chunk
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    port = sock.bind_to_random_port(f"tcp://{host}")
    return sock, f"tcp://{host}:{port}"


def send_to(sock: zmq.Socket, identity: bytes, message: Any) -> bool:
    """Send to one ROUTER peer; False when the peer is gone or its queue is full (the message is not queued)."""
    return send_or_why(sock, identity, message) is None


def send_or_why(sock: zmq.Socket, identity: bytes, message: Any, copy: bool = True) -> str | None:
    """Send to one ROUTER peer: None when queued, "gone" (no such peer connected now: it may reconnect) or
    "full" (connected but not reading: its send queue reached the high-water mark). ``message``: typed, or bytes
    encoded already, or a tuple of a message's parts (a chunk's map and frames, ``ipc.chunk_wire``: made once for its
    player and its watchers; ``copy=False`` shares them)."""
    try:
        data = message if isinstance(message, bytes | tuple) else protocol.encode(message)
        sock.send_multipart([identity, *data] if isinstance(data, tuple) else [identity, data], flags=zmq.NOBLOCK,
                            copy=copy)
        return None
    except zmq.ZMQError as error:
        if error.errno == zmq.EHOSTUNREACH:
            return "gone"
        if error.errno == zmq.EAGAIN:
            return "full"
        raise


class WorkerLink:
    """A worker thread's connection to the coordinator. Create and use it in the owning thread only."""

    def __init__(self, context: zmq.Context, endpoint: str, rank: int, role: str, room: int = -1,
                 warm_up: tuple[protocol.WarmUp, ...] = ()) -> None:  # fmt: skip
        self.rank = rank
        self.role = role
        self.sock = context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"{rank}:{role}".encode())
        self.sock.setsockopt(zmq.LINGER, LINGER_MS)
        self.sock.connect(endpoint)
        self.send(protocol.Hello(rank=rank, role=role, pid=os.getpid(), host=socket.gethostname(), room=room,
                                 warm_up=warm_up))

    def send(self, message: Any) -> None:
        self.sock.send(protocol.encode(message))

    def recv(self, timeout_s: float) -> Any | None:
        """The next coordinator message, or None when nothing came within ``timeout_s``."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return protocol.decode(self.sock.recv(), "coordinator", max_bytes=1 << 30)

    def close(self) -> None:
        self.sock.close()
