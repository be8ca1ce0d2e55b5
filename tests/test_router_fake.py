"""The router process (``python -m ranks.router``) with fake replicas (``tests.fake_replica``: real ZeroMQ sockets
speaking the protocol, no ranks) and the Python SDK as its client: what replicas and registrants may say to it
(issue 21). A loop registration, hostile stats, registrations at a live replica's endpoint and a restarted replica
answering before it registers must each leave the router serving and every other session untouched. The timing
rules behind them (a dead timeout between two registrations, ten stats intervals) are pure tests of the router core
with time passed in: ``tests/test_router_membership.py``; here each wait is on the event it stands for."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from ipc import protocol
from ipc.client import Busy, Client
from ipc.metrics_types import ReplicaView
from router.registration import server_id
from scripts.local_router import LocalRouter
from tests.fake_replica import FakeReplica, register, sane_stats
from tests.shared import read_server
from tests.test_router import free_port, wait_for

pytestmark = pytest.mark.multiprocess

DEAD_S = 1.0
FAST = ["--router.heartbeat_s=0.1", f"--router.replica_dead_s={DEAD_S}", "--router.stats_interval_s=0.2"]


@pytest.fixture
def fake() -> Iterator[FakeReplica]:
    replica = FakeReplica("server-a")
    yield replica
    replica.stop()


def replicas(client: Client) -> dict[str, dict[str, Any]]:
    return client.stats().replicas


def alive(client: Client, session: str) -> bool:
    """The session is still open at the router and on its replica: a control is accepted, no error came."""
    client.control(session, 0, keys="w")
    errors = iter(client.error, None)
    assert not [e for e in errors if e.session == session]
    return True


def test_a_registration_at_the_routers_own_endpoint_is_refused_and_stats_stay_readable(fake: FakeReplica) -> None:
    with LocalRouter([("a", fake.endpoint, 2)], FAST, register_port=free_port()) as router, \
            Client(router.endpoint, timeout_s=10) as client:
        wait_for("a up", lambda: replicas(client)["a"].state == "up", 10)
        assert register(router.register_endpoint, "loop", router.endpoint, "x").ok  # not known yet to be itself
        wait_for("the loop seen", lambda: "router itself" in (replicas(client).get("loop", ReplicaView()).down_reason
                                                                or ""), 10)
        asked = fake.stats_asked  # the router keeps reading a's stats meanwhile: nothing nests
        wait_for("two more stats reads of a", lambda: fake.stats_asked >= asked + 2, 10)
        stats = client.stats()
        assert stats.replicas["loop"].state == "down" and stats.replicas["loop"].stats is None
        answer = register(router.register_endpoint, "loop", router.endpoint, "x")
        assert not answer.ok and "router itself" in answer.message
        sessions = [client.open(b"png", num_chunks=4) for _ in range(2)]
        assert {client.stats().per_session[s.id].replica for s in sessions} == {"a"}
        assert all(alive(client, s.id) for s in sessions)
        assert router.process is not None and router.process.poll() is None


HOSTILE: dict[str, Callable[[list[str], int], dict[str, Any]]] = {
    "near the top of uint64": lambda mine, n: sane_stats(mine, n) | {"chunks_emitted": 2**64 - 1,
                                                                       "frames_emitted": 2**64 - 2},
    "huge finite floats": lambda mine, n: sane_stats(mine, n) | {"uptime_s": 1e300, "open_sessions": 1e300},
    "nested 12 deep": lambda mine, n: sane_stats(mine, n) | {"deep": [[[[[[[[[[[[1]]]]]]]]]]]]},
}


def test_hostile_stats_mark_their_replica_down_and_never_kill_the_router(fake: FakeReplica) -> None:
    other = FakeReplica("server-b")
    other.stats = lambda mine, n: sane_stats(mine, n) | {"chunks_emitted": 5, "frames_emitted": 60}  # summed with a's
    try:
        with LocalRouter([("a", fake.endpoint, 2), ("b", other.endpoint, 2)], FAST) as router, \
                Client(router.endpoint, timeout_s=10) as client:
            wait_for("both up", lambda: {r.state for r in replicas(client).values()} == {"up"}, 10)
            for what, stats in HOSTILE.items():
                fake.stats, asked = stats, fake.stats_asked
                wait_for(f"{what} read by the router", lambda asked=asked: fake.stats_asked > asked, 10)
                # read again once its hold ends (one replica_dead_s): still down, and never fatal
                wait_for(f"{what} read again", lambda asked=asked: fake.stats_asked > asked + 1, 10)
                assert router.process is not None and router.process.poll() is None, (what, router.log())
                shown = replicas(client)  # every client still reads its stats
                assert shown["b"].state == "up" and shown["a"].state == "down", what
                assert "unusable stats" in shown["a"].down_reason, what
                session = client.open(b"png", num_chunks=4)
                assert client.stats().per_session[session.id].replica == "b" and alive(client, session.id)
                client.close(session.id)
                fake.stats = sane_stats
                wait_for(f"a back after {what}", lambda: replicas(client)["a"].state == "up", 10)
    finally:
        other.stop()


def test_registrations_at_a_live_listed_replicas_endpoint_never_end_its_sessions(fake: FakeReplica) -> None:
    with LocalRouter([("a", fake.endpoint, 2)], FAST, register_port=free_port()) as router, \
            Client(router.endpoint, timeout_s=10) as client:
        wait_for("a up", lambda: replicas(client)["a"].state == "up", 10)
        session = client.open(b"png", num_chunks=4)
        first = register(router.register_endpoint, "a", fake.endpoint, "one")
        second = register(router.register_endpoint, "a", fake.endpoint, "two")
        assert alive(client, session.id) and session.id in fake.sessions
        assert not first.ok and not second.ok and "server-a" in second.message  # a answers as server-a: alive
        assert register(router.register_endpoint, "a", fake.endpoint, "server-a").ok  # the replica itself
        assert register(router.register_endpoint, "a", fake.endpoint, "server-a").ok
        assert alive(client, session.id) and session.id in fake.sessions


def test_a_restarted_replica_takes_sessions_only_once_registered_and_its_registration_ends_none() -> None:
    old = FakeReplica("server-one")
    with LocalRouter([], FAST, register_port=free_port()) as router, Client(router.endpoint, timeout_s=10) as client:
        assert register(router.register_endpoint, "r", old.endpoint, "server-one").ok
        wait_for("r up", lambda: replicas(client).get("r", ReplicaView()).state == "up", 10)
        client.open(b"png", num_chunks=4)
        old.stop()  # the job dies; Slurm requeues it at the same endpoint
        new = FakeReplica("server-two", port=old.port)
        try:
            wait_for("the new job answers the router's pings", lambda: new.heartbeats >= 3, 10)
            wait_for("the router waiting for its registration",
                     lambda: "waiting for its registration" in (replicas(client)["r"].down_reason or ""), 10)
            try:  # before its registration: never placed there (a registration "restarting" it would end it)
                early = client.open(b"png", num_chunks=4).id
            except Busy:
                early = None
            assert register(router.register_endpoint, "r", new.endpoint, "server-two").ok
            wait_for("r up as server-two", lambda: replicas(client)["r"].state == "up", 10)
            later = client.open(b"png", num_chunks=4).id
            for _ in range(3):  # re-sent as a heartbeat, between the router's pings
                pings = new.heartbeats
                wait_for("a ping", lambda pings=pings: new.heartbeats > pings, 10)
                assert register(router.register_endpoint, "r", new.endpoint, "server-two").ok
            assert alive(client, later) and later in new.sessions
            assert early is None or alive(client, early)
            assert early is None  # placed only once its registration was known
        finally:
            new.stop()


def test_a_replica_registers_the_id_its_server_answers_heartbeats_with(fake: FakeReplica) -> None:
    stop = threading.Event()
    assert server_id(fake.endpoint, zmq.Context.instance(), stop, 0.1) == "server-a"  # what the router sees there
    stop.set()
    assert server_id("tcp://127.0.0.1:9", zmq.Context.instance(), stop, 0.1) is None  # stopped: no registration


def test_a_burst_of_64_requests_to_the_router_on_one_socket_gets_64_answers(fake: FakeReplica) -> None:
    with LocalRouter([("a", fake.endpoint, 2)], FAST) as router, Client(router.endpoint, timeout_s=10) as client:
        wait_for("a up", lambda: replicas(client)["a"].state == "up", 10)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(router.endpoint)
        try:  # 8 times the router's send_hwm, back to back: the replies beyond it used to vanish
            for req in range(1, 65):
                sock.send(protocol.encode(protocol.Stats(req=req)))
            answered: set[int] = set()
            while len(answered) < 64 and sock.poll(10_000):
                reply = read_server(sock)
                assert isinstance(reply, protocol.StatsReply), reply
                answered.add(reply.req)  # type: ignore[arg-type]
            assert answered == set(range(1, 65)), f"{64 - len(answered)} of 64 requests unanswered"
        finally:
            sock.close()
