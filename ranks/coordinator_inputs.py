"""What rank 0's loop reads, as the core's events: the workers' hellos before the core exists, then each turn the
workers' messages and a bounded read of the clients'. Frames only; nothing here decides anything."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import zmq

from ipc import protocol
from runtime import core_types as ct

log = logging.getLogger(__name__)

TURN_BUDGET_S = 0.02  # client messages read per loop turn stop after this, so pings and workers are served
WORKER_MESSAGE_BYTES = 1 << 26


def await_hellos(workers: zmq.Socket, expected: set[bytes], startup_s: float,
                 on_hello: Callable[[protocol.Hello], None]) -> bool:  # fmt: skip
    """Every worker of ``expected`` said hello within ``startup_s`` (False, logged, when not)."""
    deadline = time.monotonic() + startup_s
    while expected:
        if time.monotonic() > deadline:
            log.error("job failed: workers %s did not report in within %.0f s", sorted(i.decode() for i in expected),
                      startup_s)
            return False
        if workers.poll(100):
            identity, data = workers.recv_multipart()
            hello = protocol.decode(data, "worker", max_bytes=WORKER_MESSAGE_BYTES)
            if isinstance(hello, protocol.Hello):
                expected.discard(identity)
                on_hello(hello)
    return True


def drain_workers(workers: zmq.Socket) -> Iterator[ct.Event]:
    while True:
        try:
            identity, data = workers.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        try:
            message = protocol.decode(data, "worker", max_bytes=WORKER_MESSAGE_BYTES)
        except protocol.ProtocolViolation as error:  # our own ranks: a bug, not a reason to end the job
            log.error("unreadable message from %s: %s", identity.decode(errors="replace"), error)
            continue
        if not isinstance(message, protocol.Hello | protocol.ShutdownDone):
            yield ct.WorkerSent(message)


def drain_clients(clients: zmq.Socket, max_bytes: int) -> Iterator[ct.Event]:
    began = time.monotonic()
    while time.monotonic() - began < TURN_BUDGET_S:  # bounded per turn: pings and workers are served too
        try:
            identity, *frames = clients.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        if len(frames) != 1:  # a DEALER sends one frame per message; anything else is answered, not dropped
            yield ct.ClientUnreadable(identity, f"a message is one ZeroMQ frame, got {len(frames)}", None)
            continue
        try:
            yield ct.ClientSent(identity, protocol.decode(frames[0], "client", max_bytes=max_bytes))
        except protocol.ProtocolViolation as error:
            yield ct.ClientUnreadable(identity, str(error), error.req, error.answer_v)


def await_shutdown_done(workers: zmq.Socket, waiting: set[bytes], wait_s: float) -> None:
    """Wait (at most ``wait_s``) for each worker in ``waiting`` to acknowledge the shutdown; name the silent ones."""
    deadline = time.monotonic() + wait_s
    while waiting and time.monotonic() < deadline:
        if workers.poll(50):
            identity, data = workers.recv_multipart()
            message = protocol.decode(data, "worker", max_bytes=WORKER_MESSAGE_BYTES)
            if isinstance(message, protocol.ShutdownDone):
                waiting.discard(identity)
    if waiting:
        log.warning("workers %s did not acknowledge shutdown", sorted(i.decode() for i in waiting))
