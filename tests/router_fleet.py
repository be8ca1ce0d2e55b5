"""The router core's test harness: ``Fleet`` plays the clients and the replicas by feeding events (with their
time) and records what the core asks the shell to do."""

from __future__ import annotations

import itertools
from typing import Any

from ipc import protocol as p
from runtime.replicas import ReplicaStatsReply
from runtime.router import RouterCore
from runtime.router_config import ReplicaEntry, RouterSection
from runtime.router_types import (
    ChunkHead,
    ClientSent,
    Connect,
    Output,
    ReplicaSent,
    Tick,
    ToClient,
    ToReplica,
)

A, B, C = b"client-a", b"client-b", b"client-c"
DEAD_S = 2.0
ROUTER_ID = "router-test"


def stats_of(open_sessions: int = 0, chunks: int = 0, uptime: float = 10.0, **extra: Any) -> dict[str, Any]:
    """A replica's stats reply, as a server builds it (the keys the router reads)."""
    return {"uptime_s": uptime, "open_sessions": open_sessions, "chunks_emitted": chunks, "frames_emitted": 12 * chunks,
            "sessions": {"open": open_sessions, "total": open_sessions}, "rejects": {}, "errors": {},
            "layout": "cpu-mini", "per_session": {}, **extra}


class Fleet:
    """The router core with replicas (listed ``name -> max_sessions``) and clients around it. Replica answers are
    fed as the shell would: the message decoded, its bytes as the payload (a chunk: its head only)."""

    def __init__(self, listed: dict[str, int] | None = None, **router: Any) -> None:
        listed = {"a": 2, "b": 2} if listed is None else listed
        self.config = RouterSection(**{"heartbeat_s": 0.5, "replica_dead_s": DEAD_S, "stats_interval_s": 1.0,
                                       "client_timeout_s": 10.0, "open_timeout_s": 30.0, "busy_retry_s": 5.0,
                                       "forget_after_s": 60.0, **router})
        self.core = RouterCore(self.config, [ReplicaEntry(name=n, endpoint=f"tcp://{n}:5555", max_sessions=m)
                                             for n, m in listed.items()], 0.0, router_id=ROUTER_ID)
        self.now = 0.0
        self.log: list[Output] = []
        self.generation: dict[str, int] = {}
        self.req = itertools.count(1)
        self.ids = (f"{n:012x}" for n in itertools.count(1))
        self.step()

    # ---- driving

    def step(self, *events: Any, dt: float = 0.001) -> list[Output]:
        self.now += dt
        out = self.core.step(events, self.now)
        self.log += out
        for o in out:
            if isinstance(o, Connect):
                self.generation[o.replica] = o.generation
        return out

    def client(self, who: bytes, message: p.ClientMessage) -> list[Output]:
        return self.step(ClientSent(who, message, p.encode(message)))

    def replica(self, name: str, message: Any, generation: int | None = None) -> list[Output]:
        raw = p.encode(message)
        head = ChunkHead(message.session) if isinstance(message, p.Chunk) else message
        return self.step(ReplicaSent(name, self.generation[name] if generation is None else generation, head, raw))

    def up(self, *names: str, **stats: Any) -> None:
        """Each replica answers a heartbeat, then the stats poll that follows."""
        for name in names:
            self.replica(name, p.HeartbeatAck(req=0))
            self.step(Tick())
            self.answer_stats(name, stats_of(**stats))

    def answer_stats(self, name: str, stats: dict[str, Any]) -> list[Output]:
        """The replica answers the stats poll in flight (time moves on to the next poll when none is)."""
        replica = self.core.replicas[name]
        if replica.stats_req is None:
            self.step(Tick(), dt=max(0.001, replica.next_stats - self.now + 0.001))
        assert replica.stats_req is not None, f"no stats poll of {name}"
        return self.replica(name, ReplicaStatsReply(req=replica.stats_req, stats=stats))

    def sent_open(self) -> ToReplica:
        return [o for o in self.log if isinstance(o, ToReplica) and isinstance(o.message, p.Open)][-1]

    def open(self, who: bytes = A) -> tuple[str, str]:
        """Open a session for ``who``; the replica the router picked opens it. (session id, replica)"""
        req = next(self.req)
        self.client(who, p.Open(req=req, image=b"png", num_chunks=8))
        sent = self.sent_open()
        sid = next(self.ids)
        self.replica(sent.replica, opened(sent.message.req, sid))
        replies = self.to(who, p.Opened)
        assert replies and replies[-1].session == sid and replies[-1].req == req
        return sid, sent.replica

    def advance(self, seconds: float, answering: tuple[str, ...] = ()) -> None:
        """Let time pass in ticks; the replicas in ``answering`` answer each heartbeat."""
        end = self.now + seconds
        while self.now < end:
            self.step(Tick(), dt=0.1)
            for name in answering:
                self.replica(name, p.HeartbeatAck(req=0))

    # ---- reading

    def to(self, who: bytes, kind: type) -> list[Any]:
        """Messages of ``kind`` the core sent to ``who`` (payloads as received are decoded to compare)."""
        out = []
        for o in self.log:
            if isinstance(o, ToClient) and o.identity == who:
                message = o.message if not isinstance(o.message, bytes) else p.decode(o.message, "server")
                if isinstance(message, kind):
                    out.append(message)
        return out

    def to_replica(self, name: str, kind: type | None = None) -> list[ToReplica]:
        return [o for o in self.log if isinstance(o, ToReplica) and o.replica == name
                and (kind is None or isinstance(o.message, (bytes, kind)))
                and not isinstance(o.message, p.Heartbeat | p.Stats)]

    def errors(self, who: bytes) -> list[p.Error]:
        return self.to(who, p.Error)

    def clear(self) -> None:
        self.log.clear()


def opened(req: int, sid: str) -> p.Opened:
    return p.Opened(req=req, session=sid, height=160, width=256, fps=16.0, frames_first_chunk=9, frames_per_chunk=12,
                    num_chunks=8)


def chunk(sid: str, index: int) -> p.Chunk:
    times = p.ChunkTimes(1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
    return p.Chunk(session=sid, frames=bytes(12), shape=(1, 2, 2, 3),
                   facts=p.ChunkFacts(index, 1, p.ChunkControl(), times))


def two_replicas_up() -> Fleet:
    """A fleet with replicas a and b up (the tests' ``fleet`` fixture)."""
    f = Fleet()
    f.up("a", "b")
    return f
