"""The client side of both cores' vocabulary (runtime/core.py, runtime/router.py): the events and outputs they share.

Plain data, no rules. The coordinator core and the router core face clients alike (one ROUTER socket, the client
protocol of ``ipc.protocol``), so what a client did and what is sent to one is spelled once here;
``runtime.core_types`` and ``runtime.router_types`` add what only their core has (workers, images; replicas).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ipc import protocol

Payload = Any  # bytes, a zmq.Frame, or a chunk's parts (a tuple), forwarded as received (never decoded)

# ---- events ----


@dataclass(frozen=True)
class ClientSent:
    """A client message, decoded (``message``); ``raw``: as it came, for a core that forwards it unchanged (the
    router; None where nobody forwards it)."""

    identity: bytes  # the ROUTER identity it came from
    message: protocol.ClientMessage
    raw: Payload = None


@dataclass(frozen=True)
class ClientUnreadable:
    """A client message that did not decode (``protocol.ProtocolViolation``)."""

    identity: bytes
    error: str
    req: int | None = None  # when it could still be read: the error reaches the waiting request
    v: int | None = None  # the version to answer in: an SDK too old to read this one's (None: this one)


@dataclass(frozen=True)
class ClientUnreachable:
    """A message to a client's session could not be queued: the peer is ``gone`` (it may reconnect and resume) or
    ``full`` (connected but not reading: its session is closed, never buffered)."""

    identity: bytes
    session: str
    why: Literal["gone", "full"]


@dataclass(frozen=True)
class Tick:
    """A turn of the loop: timers (pings, liveness, deadlines, silent clients) are due."""


@dataclass(frozen=True)
class WatchDropped:
    """The shell's count of chunks dropped for slow watchers so far (``runtime.watchers.Feeds``), for stats."""

    total: int


@dataclass(frozen=True)
class ShutdownRequested:
    """Stop serving: every client is told, every session closed. ``lost``: ranks the coordinator's shell could not
    reach when it ordered its workers to stop (a router has none)."""

    lost: tuple[int, ...] = ()


# ---- outputs ----


@dataclass(frozen=True)
class ToClient:
    identity: bytes
    message: protocol.ServerMessage | Payload  # a typed message (encoded by the shell) or a payload as received
    session: str | None = None  # the session it belongs to: a failed send comes back as ``ClientUnreachable``


@dataclass(frozen=True)
class ToWatchers:
    """A chunk of ``session`` for its watchers: the shell queues ``payload`` (as received or encoded once) in each
    watcher's own feed (``runtime.watchers.Feeds``), never waiting for one."""

    session: str
    watchers: tuple[bytes, ...]
    payload: Payload


@dataclass(frozen=True)
class EndWatch:
    """A watcher's stream of ``session`` ends with ``closed``: after the chunks its feed holds (``keep``: the
    session's last ones) or instead of them."""

    identity: bytes
    session: str
    closed: protocol.Closed
    keep: bool


@dataclass(frozen=True)
class Stop:
    """End with this exit code, after sending the outputs before it."""

    code: int
    reason: str


class ClientError(Exception):
    """A client request cannot be served; ``code`` goes on the wire, the state is unchanged."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s
