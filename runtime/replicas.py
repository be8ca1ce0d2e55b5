"""What the router knows of each replica, its membership and the placement rule. Pure: the router core
(runtime/router.py) alone mutates these records, through their methods, with times given in.

A replica is **up** once its current connection answered a heartbeat as a known process, and **down** before that
and after it stopped answering, said it is ending (``rank_failed``/``shutdown``), restarted, or said nonsense. Its
**identity** is the server id its heartbeat acks carry (``server``): a different id at its endpoint is a new process
(the old one's sessions are gone), whatever registrations say and however long anything took. A listed replica is
known by any id it answers with; a registered one only by the id it registered (``incarnation``), so a restarted job
takes sessions only once its registration arrived. The legal transitions are in ``TRANSITIONS``; the core moves a
replica only through ``Replica.move``.

**Membership**: replicas from the config file and replicas that register (``register``, re-sent as a heartbeat,
naming the server id of the job as its ``incarnation``). Every replica is pinged every ``router.heartbeat_s`` on its
connection; anything it sends proves it alive, and each heartbeat ack names the process that answers
(``Replica.identify``). An up replica silent for ``router.replica_dead_s``, one that says it is ending
(``rank_failed``/``shutdown``), one that answers as another server id (a restarted job; whatever registrations say
and however long anything took) or whose stats uptime goes back, and one whose stats are not a server's (held down a
while, with the reason) goes down: the core ends or moves each of its sessions, places its unanswered opens
elsewhere and opens a fresh connection (nothing queued for the old job reaches a new one). It is up again once it
answered as a known process and its stats were read. A registration never ends sessions (``registration_problem``,
``Replica.move_to``, ``Replica.reincarnation_problem``): at the replica's endpoint it is refused when that endpoint
answers as another live server; at another endpoint it is refused while the replica answers (a rival under its
name) and moves it once it stopped. An endpoint that answers with the router's own id is the router itself: never
up, and registrations naming it are refused.

**Stats** are read as typed values with ranges (``read_stats``): a reply that is not one (a count beyond 2^53, a
float that is not a finite duration, a wrong type, nesting beyond ``MAX_STATS_DEPTH``) is ``UnusableStats``, and
the core marks its replica down with the reason. Nothing a replica says is used before it passed.

**Load** of a replica = the sessions the router holds there + the opens it sent there and that are not answered yet
+ the sessions of other clients: its stats' open sessions minus the sessions it shows the router (a server shows a
client its own sessions only, opens it already accepted included), as of the last stats reply. Exact: an open the
replica accepted before its stats were taken counts once, as the router's. **Placement** (``choose``) takes the up
replica with fresh stats (read on its current connection) and room (load < max_sessions, and not refused with
``busy`` since its last stats) with the most real-time headroom when every candidate reports one (``headroom``);
otherwise, or on a tie, the one whose share of its capacity after one more session, ``(load + 1) / max_sessions``,
is smallest; then the shorter recent chunk period per session (the replica that streams faster), then the name.

**Real-time headroom** = its stats' ``capacity.headroom`` (the share of the real-time budget its sessions leave,
``runtime.capacity``; read as a finite number in [-1000, 1], anything else: not reported), less what the opens in
flight there will take: each about the share one of its sessions takes now, ``(1 - headroom) / open sessions``
(nothing known with no session open: the opens count 0). None from a replica that does not report it (not measured
yet, or an older server).

**Recent chunk period** per session (``fold_stats``) = the replica's open sessions x the time between two stats
replies / the chunks it emitted in between: the mean interval between two chunks of one of its sessions over the
last stats interval; None while it emits nothing.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

import msgspec
from msgspec import UNSET

from ipc import protocol, tolerant
from ipc.metrics_types import MAX_SESSIONS, CapacityStats, ReplicaView, RouterTotals, ServerStats
from runtime.router_config import RouterSection, check_endpoint, check_name

log = logging.getLogger("runtime.router")  # (the core's logger: membership lines read as the router's)

MAX_SESSIONS_PER_REPLICA = MAX_SESSIONS  # a registration or stats reply claiming more is refused
# nesting of a replica's stats (a server's is 7 deep): a client reads 16 levels (``protocol.MAX_DEPTH``), and the
# router's stats reply wraps a replica's stats in 4 (the message, its stats, ``replicas``, the replica's name)
MAX_STATS_DEPTH = protocol.MAX_DEPTH - 4
READ = frozenset(ServerStats.__struct_fields__)  # what a server's stats say; other keys are shown, never read


class UnusableStats(ValueError):
    """A stats reply that is not one a server sends: the message says why."""


class ReplicaStatsReply(msgspec.Struct, frozen=True, tag_field="type", tag="stats_reply", kw_only=True):
    """A replica's ``stats_reply`` with its stats as they came: untrusted until ``read_stats`` read them (so stats
    that are not a server's mark their replica down with the reason, never fail the message)."""

    req: int
    stats: dict[str, Any]
    v: int = protocol.PROTOCOL_VERSION


_stats_reply = msgspec.msgpack.Decoder(ReplicaStatsReply)


def stats_reply(data: bytes | memoryview, max_bytes: int) -> ReplicaStatsReply:
    """A replica's ``stats_reply`` read as ``ReplicaStatsReply`` (bounded as ``protocol.decode`` bounds a message),
    or ``ProtocolViolation``."""
    if len(data) > max_bytes:
        raise protocol.ProtocolViolation(f"message of {len(data)} bytes exceeds the limit of {max_bytes} bytes")
    protocol.scan(data, max_items=protocol.MAX_INTERNAL_ITEMS)
    reply: ReplicaStatsReply = protocol.read_as(_stats_reply, data, "stats reply")
    return reply


def read_stats(stats: dict[str, Any]) -> tuple[ServerStats, dict[str, Any]]:
    """A replica's stats reply as typed values, and what it says besides (shown, never read), or ``UnusableStats``.
    A router serving as a replica (``layout`` "router") is read without its own replicas and totals: stats never
    nest stats."""
    depth = nesting(stats)
    if depth > MAX_STATS_DEPTH:
        raise UnusableStats(f"nested {depth} deep (at most {MAX_STATS_DEPTH})")
    try:
        typed = tolerant.convert(stats, ServerStats)  # a newer server's additions are dropped, not refused
    except msgspec.ValidationError as error:
        raise UnusableStats(str(error)[:200]) from None
    if typed.open_sessions > MAX_SESSIONS_PER_REPLICA:
        raise UnusableStats(f"{typed.open_sessions} open sessions (at most {MAX_SESSIONS_PER_REPLICA})")
    if typed.layout == "router":
        typed = msgspec.structs.replace(typed, total=UNSET, router=UNSET, replicas=UNSET)
    return typed, {k: v for k, v in stats.items() if k not in READ}


def nesting(value: Any) -> int:
    """How deep containers nest in ``value`` (a scalar: 0), walked without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list | tuple) else None
        if children is not None:
            deepest = max(deepest, depth)
            todo.extend((child, depth + 1) for child in children)
    return deepest


def _headroom(value: Any) -> float | None:
    """A reported headroom, if it is one: a finite number in [-1000, 1] (a replica's word is never trusted further)."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not -1000.0 <= value <= 1.0:
        return None  # NaN fails the range test too
    return float(value)


class State(str, Enum):
    DOWN = "down"  # not answering yet on its connection, or not any more
    UP = "up"  # answering: it takes sessions


TRANSITIONS = {State.DOWN: {State.UP}, State.UP: {State.DOWN}}


class IllegalTransition(RuntimeError):
    pass


class Due(NamedTuple):
    """What a timer turn does for one replica (``Replica.due``)."""

    ping: bool  # a heartbeat goes (every router.heartbeat_s)
    dead: str | None  # why it goes down now (up and silent past router.replica_dead_s)
    poll: bool  # its stats are read (every router.stats_interval_s)
    forget: bool  # registered and down past router.forget_after_s: it is forgotten


@dataclass
class Replica:
    name: str
    endpoint: str
    max_sessions: int
    listed: bool  # from the config file (kept forever) or registered (forgotten after router.forget_after_s down)
    since: float  # when it entered its state
    layout: str = ""
    incarnation: str = ""  # the server id of its latest registration ("": never registered)
    registered_at: float | None = None
    server: str = ""  # the server id its endpoint last answered heartbeats with ("": none yet), across connections
    state: State = State.DOWN
    generation: int = 0  # of its current connection (``Connect``)
    last_heard: float = 0.0  # last message on the current connection
    next_ping: float = 0.0
    next_stats: float = 0.0
    stats_req: int | None = None  # the stats request in flight
    stats_sent: float = 0.0
    stats: ServerStats | None = None  # its latest stats reply, typed (per-session entries kept for their owners)
    shown: dict[str, Any] = field(default_factory=dict)  # what that reply says besides, for operators
    stats_at: float | None = None
    fresh: bool = False  # a stats reply was read on the current connection: its load is known
    down_until: float = 0.0  # it said nonsense: it stays down until then
    is_router: bool = False  # its endpoint answered with the router's own id (a loop): never up
    sessions: set[str] = field(default_factory=set)  # the router's sessions on it
    opening: int = 0  # opens sent, not answered
    external: int = 0  # sessions of other clients, from its stats
    refused_until: float = 0.0  # it answered busy: no placement before its next stats reply
    draining: bool = False  # it said it drains (a ``draining`` notice): no placement on this connection
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

    @property
    def known(self) -> bool:
        """Whether the process answering at its endpoint is the one the router may place sessions on: any for a
        listed replica (its id is its incarnation), the registered one for a registered replica."""
        return self.listed or (bool(self.server) and self.server == self.incarnation)

    def has_room(self, now: float) -> bool:
        return (self.state is State.UP and self.fresh and self.load < self.max_sessions
                and now >= self.refused_until and not self.draining)

    def fold_stats(self, stats: ServerStats, shown: dict[str, Any], now: float) -> bool:
        """Take a (typed) stats reply in. Returns False when its uptime went back: the replica restarted since the
        last one (its sessions are gone)."""
        restarted = self._sample is not None and stats.uptime_s < self._sample[2]
        if self._sample is not None and not restarted:
            at, before, _ = self._sample
            emitted = stats.chunks_emitted - before
            if emitted > 0 and now > at:
                self.period_s = max(1, stats.open_sessions) * (now - at) / emitted
            elif emitted == 0:
                self.period_s = None
        self._sample = (now, stats.chunks_emitted, stats.uptime_s)
        self.external = max(0, stats.open_sessions - len(stats.per_session))
        self.stats, self.shown, self.stats_at, self.refused_until = stats, shown, now, 0.0
        self.draining = self.draining or stats.draining is True  # a draining replica takes nothing more
        self.fresh = True
        return not restarted

    def headroom(self) -> float | None:
        """Its real-time headroom (module docstring), or None when it reports none."""
        if self.stats is None:
            return None
        capacity = self.stats.capacity
        headroom = _headroom(capacity.headroom) if isinstance(capacity, CapacityStats) else None
        if headroom is None:
            return None
        present = self.stats.open_sessions
        return headroom - (self.opening * (1.0 - headroom) / present if present else 0.0)

    def forget_connection(self) -> None:
        """A new connection: nothing measured on the old one carries over."""
        self.generation += 1
        self.stats_req = None
        self.opening = 0
        self.external = 0
        self.period_s = None
        self.fresh = False
        self.draining = False
        self._sample = None

    def stats_due(self, now: float, dead_s: float) -> bool:
        """Whether a stats request may go: none is in flight, or the one in flight was lost."""
        return self.stats_req is None or now - self.stats_sent > dead_s

    def due(self, now: float, config: RouterSection) -> Due:
        """Its deadlines at ``now``: a ping (its next one is set), going down, a stats read, being forgotten."""
        ping = now >= self.next_ping
        if ping:
            self.next_ping = now + config.heartbeat_s
        if self.state is State.UP:
            silent = now - self.last_heard
            if silent > config.replica_dead_s:
                return Due(ping, f"stopped answering (silent for {silent:.1f} s)", False, False)
            return Due(ping, None, now >= self.next_stats and self.stats_due(now, config.replica_dead_s), False)
        down_for = min(now - self.since, now - (self.registered_at or 0.0))
        return Due(ping, None, False, not self.listed and down_for > config.forget_after_s)

    def registered(self, message: protocol.Register, now: float) -> None:
        """Its registration was accepted: what it says of itself is recorded."""
        self.incarnation, self.max_sessions = message.incarnation, message.max_sessions
        self.layout, self.registered_at = message.layout, now

    def move_to(self, endpoint: str) -> str | None:
        """A registration of its name at another endpoint: a requeued job on another node takes its name once the old
        job stopped answering (it is down; the core then connects to the new endpoint); while it answers, the name is
        held (a second array submitted with the same names, a stranger: they must not end its sessions). A listed
        replica never moves. Returns why not, or None once moved."""
        if self.listed:
            return f"{self.name} is a listed replica at {self.endpoint}; registrations cannot move it"
        if self.state is State.UP:
            return (f"the name {self.name} is held by a live replica at {self.endpoint} (answering as server "
                    f"{self.server}); choose another replica.name")
        log.info("replica %s moves from %s to %s", self.name, self.endpoint, endpoint)
        self.endpoint, self.server, self.down_until, self.is_router = endpoint, "", 0.0, False
        self.down_reason = "not answering yet"
        return None

    def reincarnation_problem(self, incarnation: str) -> str | None:
        """A registration at its endpoint under a new incarnation. Only the id its endpoint answers with decides what
        process is there (``identify``): a registration never ends sessions. It is refused when the endpoint answers
        as a live process of another id; otherwise it is recorded (a restarted registered replica takes sessions
        once its endpoint answers with that id)."""
        if self.state is State.UP and self.server and incarnation != self.server:
            return (f"{self.endpoint} answers as server {self.server}, not {incarnation}: the replica {self.name} "
                    "there is alive")
        return None

    def identify(self, server: str, router_id: str, now: float, dead_s: float) -> tuple[str | None, bool]:
        """A heartbeat ack says which process answers at its endpoint: the router itself (a loop: held down for
        good), a new one (the old one's sessions are gone: down, a fresh connection), or the known one (up, unless
        it is held down or, registered, its registration is not known yet). Returns why it goes down now (None: it
        does not) and whether its stats are to be read (it is up once they are)."""
        if server and server == router_id:
            self.is_router = True
            self.down_reason = (f"is this router itself ({self.endpoint} answers with the router's id): a replica "
                                "must be a worldstream server")
            return (self.down_reason if self.state is State.UP else None), False
        if server and self.server and server != self.server:
            before, self.server = self.server, server
            if self.state is State.UP:
                return f"restarted (it answers as server {server}, was {before})", False
        self.server = server or self.server
        if self.state is State.UP or self.is_router or now < self.down_until:
            return None, False
        if not self.known:
            self.down_reason = (f"answers as server {self.server or '(no id)'}, registered as "
                                f"{self.incarnation or '(nothing)'}: waiting for its registration")
            return None, False
        self.down_reason = f"answers as server {self.server or '(no id)'}; reading its stats"
        return None, self.stats_due(now, dead_s)  # its load is read before it is up

    def describe(self, now: float) -> ReplicaView:
        """This replica in the router's stats (its own stats without any session's entry: their owners' only)."""
        own = None
        if self.stats is not None:
            own = {**self.shown, **msgspec.to_builtins(self.stats)}
            own.pop("per_session", None)  # session ids are their owners' only
            if isinstance(own.get("capacity"), dict):
                own["capacity"].pop("sessions", None)
        return ReplicaView(
            state=self.state.value, endpoint=self.endpoint, source="config" if self.listed else "registered",
            layout=self.layout or (self.stats.layout if self.stats else ""), max_sessions=self.max_sessions,
            server=self.server, sessions=len(self.sessions), opening=self.opening,
            external_sessions=self.external, load=self.load, chunk_period_s=self.period_s,
            for_s=now - self.since, down_reason=None if self.state is State.UP else self.down_reason,
            stats_age_s=None if self.stats_at is None else now - self.stats_at, stats=own)


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


def totals(replicas: Iterable[Replica], rejects: dict[str, int]) -> RouterTotals:
    """The sums over the up replicas of the counters a server has (the router's own ``rejects`` added)."""
    every = list(replicas)
    up = [r for r in every if r.state is State.UP]
    read = [r.stats for r in up if r.stats is not None]  # typed and in range (``read_stats``): sums fit uint64

    def merged(counts: Iterable[dict[str, int]], start: dict[str, int]) -> dict[str, int]:
        out = dict(start)
        for each in counts:
            for name, n in each.items():
                out[name] = out.get(name, 0) + n
        return out

    return RouterTotals(
        replicas_up=len(up), replicas=len(every), max_sessions=sum(r.max_sessions for r in up),
        open_sessions=sum(len(r.sessions) + r.external for r in up), sessions_total=sum(s.sessions.total for s in read),
        chunks_emitted=sum(s.chunks_emitted for s in read), frames_emitted=sum(s.frames_emitted for s in read),
        rejects=merged((s.rejects for s in read), rejects),
        errors=merged((s.errors for s in read if isinstance(s.errors, dict)), {}))


def summary(replicas: Iterable[Replica]) -> str:
    """Each replica's load for a busy answer: ``a 2/2, b down``."""
    return ", ".join(f"{r.name} {r.load}/{r.max_sessions}" if r.state is State.UP else f"{r.name} down"
                     for r in replicas) or "no replica known"



def registration_problem(message: protocol.Register, replicas: Mapping[str, Replica],
                         config: RouterSection) -> str | None:
    """Why a registration is refused before it touches any replica (a token, a name, an endpoint or a size that is
    wrong, the router's replica limit, an endpoint that is the router itself), or None."""
    token = config.register_token
    if token and not hmac.compare_digest(message.token.encode(), token.encode()):
        return "wrong or missing token: replica.token must equal the router's register_token"
    why = check_name(message.name) or check_endpoint(message.endpoint)
    if why is None and not 1 <= message.max_sessions <= MAX_SESSIONS_PER_REPLICA:
        why = f"max_sessions must be in 1..{MAX_SESSIONS_PER_REPLICA}, got {message.max_sessions}"
    if why is None and message.name not in replicas and len(replicas) >= config.max_replicas:
        why = f"the router is at its limit of {config.max_replicas} replicas"
    loop = next((r for r in replicas.values() if r.endpoint == message.endpoint and r.is_router), None)
    if why is None and loop is not None:
        why = loop.down_reason
    return why
