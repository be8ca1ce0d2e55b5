"""Membership timing rules of the router core (``runtime.replicas``), with time passed in: registrations, restarts
and loops spaced past the dead timeout, and stats read over many intervals. The process tests
(``tests/test_router_fake.py``) check the same paths over real sockets without waiting on the clock."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ipc import protocol as p
from runtime.replicas import ReplicaStatsReply, State
from runtime.router_types import RegisterSent, Tick, ToRegistrant, ToReplica
from tests.router_fleet import DEAD_S, ROUTER_ID, A, B, Fleet, stats_of

STATS_S = 1.0  # the Fleet's stats interval


def answering(f: Fleet, seconds: float, name: str, server: str, stats: dict[str, Any] | None = None,
              others: Mapping[str, str] = MappingProxyType({})) -> None:
    """Let ``seconds`` pass in ticks; ``name`` answers each heartbeat as ``server`` and each stats poll with
    ``stats`` (sane ones when None); each of ``others`` (name -> server) answers as itself with sane stats."""
    end = f.now + seconds
    while f.now < end:
        f.step(Tick(), dt=0.1)
        for each, its_server, its_stats in [(name, server, stats), *((n, s, None) for n, s in others.items())]:
            f.replica(each, p.HeartbeatAck(req=0, server=its_server))
            replica = f.core.replicas[each]
            if replica.stats_req is not None:
                f.replica(each, ReplicaStatsReply(req=replica.stats_req, stats=its_stats or stats_of()))


def registered(f: Fleet, name: str, endpoint: str, incarnation: str) -> p.Registered:
    message = p.Register(name=name, endpoint=endpoint, max_sessions=2, layout="x", incarnation=incarnation)
    (answer,) = [o.message for o in f.step(RegisterSent(b"peer", message)) if isinstance(o, ToRegistrant)]
    return answer


def test_registrations_at_a_live_listed_replicas_endpoint_a_dead_timeout_apart_never_end_its_sessions() -> None:
    f = Fleet({"a": 2}, register_bind="tcp://127.0.0.1:5561")
    answering(f, 0.5, "a", "server-a")
    sid, _ = f.open(A)
    first = registered(f, "a", "tcp://a:5555", "one")
    answering(f, DEAD_S * 1.5, "a", "server-a")  # no timing rule may take the second for a restart
    second = registered(f, "a", "tcp://a:5555", "two")
    assert not first.ok and not second.ok and "server-a" in second.message  # a answers as server-a: alive
    assert registered(f, "a", "tcp://a:5555", "server-a").ok  # the replica itself
    answering(f, DEAD_S * 1.5, "a", "server-a")
    assert registered(f, "a", "tcp://a:5555", "server-a").ok
    assert sid in f.core.sessions and not f.errors(A) and f.core.replicas["a"].state is State.UP


def test_a_restarted_replica_answering_past_the_dead_timeout_before_it_registers_takes_no_session_until_then(
) -> None:
    f = Fleet({}, register_bind="tcp://127.0.0.1:5561")
    assert registered(f, "r", "tcp://r:5555", "server-one").ok
    answering(f, 0.5, "r", "server-one")
    old, _ = f.open(A)
    f.replica("r", p.HeartbeatAck(req=0, server="server-two"))  # the job was requeued at the same endpoint
    assert old not in f.core.sessions and f.core.replicas["r"].state is State.DOWN
    answering(f, DEAD_S * 1.5, "r", "server-two")  # its registration comes later than a timing rule would wait
    assert f.core.replicas["r"].state is State.DOWN and "waiting for its registration" in \
        f.core.replicas["r"].down_reason
    f.client(B, p.Open(req=1, image=b"png"))
    assert f.errors(B)[-1].code == "busy"  # never placed there before its registration
    assert registered(f, "r", "tcp://r:5555", "server-two").ok
    answering(f, 0.5, "r", "server-two")
    assert f.core.replicas["r"].state is State.UP
    later, name = f.open(B)
    for _ in range(3):  # its registration, re-sent as a heartbeat, ends nothing
        answering(f, 0.3, "r", "server-two")
        assert registered(f, "r", "tcp://r:5555", "server-two").ok
    assert name == "r" and later in f.core.sessions and f.errors(B)[-1].code == "busy"


def test_an_endpoint_answering_as_the_router_stays_down_over_many_stats_intervals_and_stats_stay_whole() -> None:
    f = Fleet({"a": 2}, register_bind="tcp://127.0.0.1:5561")
    answering(f, 0.5, "a", "server-a")
    assert registered(f, "loop", "tcp://router:5560", "x").ok  # not known yet to be itself
    f.replica("loop", p.HeartbeatAck(req=0, server=ROUTER_ID))
    for _ in range(10):  # ten stats intervals: it is never polled, never up
        answering(f, STATS_S, "a", "server-a")
        f.replica("loop", p.HeartbeatAck(req=0, server=ROUTER_ID))
    loop = f.core.replicas["loop"]
    assert loop.state is State.DOWN and loop.stats is None and loop.stats_req is None
    stats = f.core.stats(A, f.now)
    assert stats.replicas["loop"].state == "down" and "router itself" in (stats.replicas["loop"].down_reason or "")
    answer = registered(f, "loop", "tcp://router:5560", "x")
    assert not answer.ok and "router itself" in answer.message
    assert [f.open(A)[1] for _ in range(2)] == ["a", "a"]


def test_hostile_stats_keep_their_replica_down_at_each_read_until_they_are_sane_again() -> None:
    f = Fleet({"a": 2, "b": 2})
    f.up("a", "b")
    hostile = stats_of() | {"chunks_emitted": 2**64 - 1}
    for _ in range(5):  # several reads, each after the hold of the one before
        answering(f, DEAD_S + STATS_S, "a", "server-a", hostile, others={"b": "server-b"})
        assert f.core.replicas["a"].state is State.DOWN and "unusable stats" in f.core.replicas["a"].down_reason
        assert f.core.stats(A, f.now).replicas["b"].state == "up"
    polls = [o for o in f.log if isinstance(o, ToReplica) and o.replica == "a" and isinstance(o.message, p.Stats)]
    assert len(polls) >= 6 and f.open(A)[1] == "b"  # read again after each hold, and never fatal
    answering(f, DEAD_S + STATS_S, "a", "server-a", others={"b": "server-b"})
    assert f.core.replicas["a"].state is State.UP
