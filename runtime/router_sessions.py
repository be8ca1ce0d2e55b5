"""The router core's records (``runtime.router``): a routed session and an open on its way to a replica, and the
fold of a session's live input that waits for its replica link. Plain data and one pure rule; the core alone
changes these records (a session's ``migration`` is the migration part's, ``runtime.router_migration``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

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


def fold(a: protocol.ControlState, b: protocol.ControlState) -> protocol.ControlState:
    """Two live inputs of a session as one, as the server folds them: the later one's held keys and revision (and
    request id), the mouse motion of both (held to one state's limit, as the server clamps a cut's turn: a fold
    must not make two valid states one the server refuses), the taps of both, the later steps request given."""
    older, newer = (a, b) if a.revision <= b.revision else (b, a)
    taps = list(dict.fromkeys([*older.taps, *newer.taps]))[:16]
    limit = protocol.MAX_MOUSE_DEGREES
    mouse = (max(-limit, min(limit, older.mouse[0] + newer.mouse[0])),
             max(-limit, min(limit, older.mouse[1] + newer.mouse[1])))
    steps = newer.steps if newer.steps is not None else older.steps
    return msgspec.structs.replace(newer, mouse=mouse, taps=taps, steps=steps)
