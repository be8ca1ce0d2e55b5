"""The router core's records (``runtime.router``): a routed session and an open on its way to a replica. Plain
data (a session's live input that waits for its replica link is folded by ``InputState.fold``); the core alone
changes these records (a session's ``migration`` is the migration part's, ``runtime.router_migration``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ipc import protocol
from runtime.router_migration import Moves


@dataclass
class RoutedSession:
    id: str  # the replica's id, unchanged
    replica: str
    client: bytes  # the identity its messages go to
    owner: bytes  # the identity that opened it (a reconnect with it may resume)
    gone: bool = False  # the client disconnected: its messages are dropped until it resumes
    closing: bool = False  # the router asked the replica to close it (client silent, not reading, or a close
    # that met a full link: the router sends it again by itself, as a server never refuses a close)
    close_due: float = 0.0  # when the close is sent (again) unless the replica said ``closed``
    state: protocol.ControlState | None = None  # live input that met a full link: folded, sent when it drains
    opened: protocol.Opened | None = None  # its replica's answer: the geometry a watcher is told
    migration: Moves = field(default_factory=Moves)  # the migration part's (``runtime.router_migration``)

    @property
    def rid(self) -> str:
        """Its id on its replica."""
        return self.migration.upstream or self.id


@dataclass
class PendingOpen:
    req: int  # the router's request id on the replica
    client: bytes
    message: protocol.Open  # as the client sent it (with its own request id)
    replica: str
    sent: float
    tried: set[str] = field(default_factory=set)  # replicas asked already (busy or unreachable)
    migrating: str | None = None  # the restore of this (client-facing) session after its replica went down

