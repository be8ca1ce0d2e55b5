"""Vocabulary of the router core (runtime/router.py): the events it takes and the outputs it returns.

Plain data, no rules. An event is something that happened at the router (a client message, a replica message, a
registration, a send that could not be queued, a timer turn); an output is something the shell must do, in list
order (send to a client, a replica or a registering replica; open a fresh connection to a replica; log a replica
going up or down; stop). What concerns clients alone is ``runtime.client_types``, shared with the coordinator core
and re-exported here.

``Payload`` is what the shell received, kept as it came (bytes or a ``zmq.Frame``): the core never reads it, it
only hands it back in an output, so a chunk's frames cross the router without being decoded or copied.
"""

from __future__ import annotations

from dataclasses import dataclass

from ipc import protocol
from ipc.metrics_types import Distribution
from runtime.client_types import (  # the client side, shared with the coordinator core
    ClientSent,
    ClientUnreachable,
    ClientUnreadable,
    EndWatch,
    Payload,
    ShutdownRequested,
    Stop,
    Tick,
    ToClient,
    ToWatchers,
)
from runtime.replicas import ReplicaStatsReply

__all__ = ["ChunkHead", "ClientSent", "ClientUnreachable", "ClientUnreadable", "Connect", "Disconnect", "DropSnapshot",
           "EndWatch", "Event",
           "OpenOrigin", "Origin", "Output", "Payload", "RegisterSent", "RegisterUnreadable", "ReplicaDown",
           "ReplicaRefused", "ReplicaSent", "ReplicaUp", "SessionOrigin", "ShellTimes", "ShutdownRequested", "Stop",
           "Tick", "ToClient", "ToRegistrant", "ToReplica", "ToWatchers"]

# ---- events ----


@dataclass(frozen=True)
class ChunkHead:
    """A replica's ``chunk``, read only as far as its session (``ipc.relay.peek``)."""

    session: str


@dataclass(frozen=True)
class ReplicaSent:
    """A message from the connection ``generation`` to replica ``replica``: decoded in full, or a chunk's head."""

    replica: str
    generation: int
    message: protocol.ServerMessage | ReplicaStatsReply | ChunkHead  # a stats reply: its stats as they came
    raw: Payload


@dataclass(frozen=True)
class OpenOrigin:
    """An ``open`` the router forwarded under its own request id ``req``."""

    req: int


@dataclass(frozen=True)
class SessionOrigin:
    """A client's session message the router forwarded as it came."""

    identity: bytes
    req: int | None
    session: str
    kind: str  # the message type ("control", "control_state", "close")
    state: protocol.ControlState | None = None  # a control_state, decoded: one that meets a full link is folded


Origin = OpenOrigin | SessionOrigin


@dataclass(frozen=True)
class ReplicaRefused:
    """A message to a replica could not be queued (no connection, or its queue is full): nothing was sent."""

    replica: str
    generation: int
    origin: Origin


@dataclass(frozen=True)
class RegisterSent:
    """A registration (or its periodic repeat) from a replica's rank 0, on the registration socket."""

    peer: bytes  # the registration socket's identity of that replica
    message: protocol.Register


@dataclass(frozen=True)
class RegisterUnreadable:
    peer: bytes
    error: str


@dataclass(frozen=True)
class ShellTimes:
    """What the shell measured of itself, for ``stats``: how long a chunk stayed in the router, from the moment
    it was read off a replica's socket to the moment it was queued for its client (a distribution, seconds)."""

    hold_s: Distribution
    watch_dropped: int = 0  # chunks dropped for slow watchers so far (``runtime.watchers.Feeds``)


Event = (ClientSent | ClientUnreadable | ClientUnreachable | ReplicaSent | ReplicaRefused | RegisterSent
         | RegisterUnreadable | Tick | ShellTimes | ShutdownRequested)

# ---- outputs ----


@dataclass(frozen=True)
class ToReplica:
    replica: str
    generation: int  # the connection it was meant for: none other may carry it
    message: protocol.ClientMessage | Payload
    origin: Origin | None = None  # who is told when it cannot be queued (None: nobody, a deadline covers it)
    raw: Payload | None = None  # ``message`` exactly as its client sent it: sent as it is while no token is in use


@dataclass(frozen=True)
class ToRegistrant:
    peer: bytes
    message: protocol.Registered


@dataclass(frozen=True)
class Connect:
    """Open a fresh connection to ``endpoint`` for the replica (closing any older one, with whatever it still
    queued): nothing meant for an earlier incarnation of the replica reaches a later one. Messages from it carry
    ``generation``."""

    replica: str
    endpoint: str
    generation: int


@dataclass(frozen=True)
class Disconnect:
    """Close the replica's connection: it is forgotten."""

    replica: str


@dataclass(frozen=True)
class ReplicaUp:
    replica: str
    endpoint: str


@dataclass(frozen=True)
class ReplicaDown:
    replica: str
    reason: str
    sessions_lost: int


@dataclass(frozen=True)
class DropSnapshot:
    """Delete the snapshot ``snapshot`` the router asked for from ``router.snapshots_dir`` (superseded or its
    session ended)."""

    snapshot: str


Output = (ToClient | ToReplica | ToRegistrant | Connect | Disconnect | ReplicaUp | ReplicaDown | ToWatchers | EndWatch
          | Stop | DropSnapshot)
