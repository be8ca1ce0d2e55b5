"""What the router knows of each replica, and the placement rule. Pure: the router core (runtime/router.py) alone
mutates these records, with times given in.

A replica is **up** once its current connection answered anything (a heartbeat ack, a stats reply) and **down**
before that and after it stopped answering, said it is ending (``rank_failed``/``shutdown``) or restarted. The
legal transitions are in ``TRANSITIONS``; the core moves a replica only through ``Replica.move``.

**Load** of a replica = the sessions the router holds there + the opens it sent there and that are not answered yet
+ the sessions of other clients (its own stats' open sessions minus the router's, as of the last stats reply).
**Placement** (``choose``) takes the up replica with room (load < max_sessions, and not refused with ``busy`` since
its last stats) with the most real-time headroom when every candidate reports one (``headroom``); otherwise, or on
a tie, the one whose share of its capacity after one more session, ``(load + 1) / max_sessions``, is smallest; then
the shorter recent chunk period per session (the replica that streams faster), then the name.

**Real-time headroom** = its stats' ``capacity.headroom`` (the share of the real-time budget its sessions leave,
``runtime.capacity``), less what the opens in flight there will take: each about the share one of its sessions
takes now, ``(1 - headroom) / open sessions`` (nothing known with no session open: the opens count 0). None from a
replica that does not report it (not measured yet, or an older server).

**Recent chunk period** per session (``fold_stats``) = the replica's open sessions x the time between two stats
replies / the chunks it emitted in between: the mean interval between two chunks of one of its sessions over the
last stats interval; None while it emits nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class State(str, Enum):
    DOWN = "down"  # not answering yet on its connection, or not any more
    UP = "up"  # answering: it takes sessions


TRANSITIONS = {State.DOWN: {State.UP}, State.UP: {State.DOWN}}


class IllegalTransition(RuntimeError):
    pass


@dataclass
class Replica:
    name: str
    endpoint: str
    max_sessions: int
    listed: bool  # from the config file (kept forever) or registered (forgotten after router.forget_after_s down)
    since: float  # when it entered its state
    layout: str = ""
    incarnation: str = ""  # of its latest registration ("" : listed and never registered)
    registered_at: float | None = None
    state: State = State.DOWN
    generation: int = 0  # of its current connection (``Connect``)
    last_heard: float = 0.0  # last message on the current connection
    next_ping: float = 0.0
    next_stats: float = 0.0
    stats_req: int | None = None  # the stats request in flight
    stats_sent: float = 0.0
    stats: dict[str, Any] | None = None  # its latest stats reply (per-session entries kept for their owners only)
    stats_at: float | None = None
    sessions: set[str] = field(default_factory=set)  # the router's sessions on it
    opening: int = 0  # opens sent, not answered
    external: int = 0  # sessions of other clients, from its stats
    refused_until: float = 0.0  # it answered busy: no placement before its next stats reply
    period_s: float | None = None  # recent chunk period per session
    down_reason: str = "not answering yet"
    _sample: tuple[float, int, float] | None = None  # (at, chunks_emitted, uptime_s) of the previous stats reply

    def move(self, to: State, now: float) -> None:
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"replica {self.name}: {self.state.value} -> {to.value} is not a transition")
        self.state, self.since = to, now

    @property
    def load(self) -> int:
        return len(self.sessions) + self.opening + self.external

    def has_room(self, now: float) -> bool:
        return self.state is State.UP and self.load < self.max_sessions and now >= self.refused_until

    def fold_stats(self, stats: dict[str, Any], now: float) -> bool:
        """Take a stats reply in. Returns False when its uptime went back: the replica restarted since the last
        one (its sessions are gone)."""
        uptime = _number(stats.get("uptime_s"))
        chunks = _number(stats.get("chunks_emitted"))
        open_sessions = _number(stats.get("open_sessions"))
        restarted = self._sample is not None and uptime is not None and uptime < self._sample[2]
        if uptime is not None and chunks is not None:
            if self._sample is not None and not restarted:
                at, before, _ = self._sample
                emitted = chunks - before
                if emitted > 0 and now > at:
                    self.period_s = max(1.0, open_sessions or 0.0) * (now - at) / emitted
                elif emitted == 0:
                    self.period_s = None
            self._sample = (now, int(chunks), uptime)
        if open_sessions is not None:
            self.external = max(0, int(open_sessions) - len(self.sessions))
        self.stats, self.stats_at, self.refused_until = stats, now, 0.0
        return not restarted

    def headroom(self) -> float | None:
        """Its real-time headroom (module docstring), or None when it reports none."""
        capacity = (self.stats or {}).get("capacity")
        headroom = _number(capacity.get("headroom")) if isinstance(capacity, dict) else None
        if headroom is None:
            return None
        present = _number((self.stats or {}).get("open_sessions")) or 0.0
        return headroom - (self.opening * (1.0 - headroom) / present if present else 0.0)

    def forget_connection(self) -> None:
        """A new connection: nothing measured on the old one carries over."""
        self.generation += 1
        self.stats_req = None
        self.opening = 0
        self.external = 0
        self.period_s = None
        self._sample = None

    def describe(self, now: float) -> dict[str, Any]:
        """This replica in the router's stats (its own stats without any session's entry)."""
        own = None
        if self.stats is not None:
            own = {k: v for k, v in self.stats.items() if k != "per_session"}
            if isinstance(own.get("capacity"), dict):  # its per-session entries name sessions: their owners' only
                own["capacity"] = {k: v for k, v in own["capacity"].items() if k != "sessions"}
        return {
            "state": self.state.value, "endpoint": self.endpoint, "source": "config" if self.listed else "registered",
            "layout": self.layout or (own or {}).get("layout", ""), "max_sessions": self.max_sessions,
            "sessions": len(self.sessions), "opening": self.opening, "external_sessions": self.external,
            "load": self.load, "chunk_period_s": self.period_s, "for_s": now - self.since,
            "down_reason": None if self.state is State.UP else self.down_reason,
            "stats_age_s": None if self.stats_at is None else now - self.stats_at, "stats": own,
        }


def choose(replicas: Iterable[Replica], now: float, exclude: Iterable[str] = ()) -> Replica | None:
    """The replica a new session goes to (see the module docstring), or None when none has room."""
    skip = set(exclude)
    candidates = [r for r in replicas if r.name not in skip and r.has_room(now)]
    if not candidates:
        return None
    room = {r.name: r.headroom() for r in candidates}
    by_headroom = all(h is not None for h in room.values())
    return min(candidates, key=lambda r: (-(room[r.name] or 0.0) if by_headroom else 0.0,
                                          (r.load + 1) / r.max_sessions,
                                          r.period_s if r.period_s is not None else 0.0, r.name))


def summary(replicas: Iterable[Replica]) -> str:
    """Each replica's load for a busy answer: ``a 2/2, b down``."""
    return ", ".join(f"{r.name} {r.load}/{r.max_sessions}" if r.state is State.UP else f"{r.name} down"
                     for r in replicas) or "no replica known"


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
