"""Two replicas behind the router, all real: two 2-rank jobs (``cpu-mini``, synthetic backend, gloo) started by
``launch.py``, the router process (``python -m ranks.router``), ZeroMQ on loopback, the Python SDK as clients.
Replica ``a`` is listed in the router's config; replica ``b`` registers itself (``replica.router``), as a Slurm job
on an unknown node would.

The jobs are shared by the module's tests (each start costs seconds); the last test kills a rank of ``b``,
restarts ``b`` and checks it rejoins.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec
import pytest
import zmq

from ipc import protocol
from ipc.client import Busy, Client, ServerError, ServerGone
from ipc.metrics_types import SessionSummary
from scripts.local_router import LocalRouter, Streamer, replica_of, wait_for
from scripts.local_server import ROOT, LocalServer
from scripts.ports import free_port
from tests.shared import read_server

pytestmark = pytest.mark.multiprocess

IMAGE = (ROOT / "assets" / "start.png").read_bytes()
MAX_SESSIONS = 3
COSTS = ["--synthetic.encode_s=0.01", "--synthetic.denoise_s=0.03", "--synthetic.decode_s=0.015"]
# One client (the router) carries every session of a replica: its send queue holds all of their chunks.
REPLICA = [*COSTS, f"--server.max_sessions={MAX_SESSIONS}", "--server.send_hwm=512"]
ROUTER = ["--router.heartbeat_s=0.25", "--router.replica_dead_s=3", "--router.stats_interval_s=0.5"]


@dataclass
class Fleet:
    router: LocalRouter
    a: LocalServer
    b: LocalServer
    servers: list[LocalServer] = field(default_factory=list)  # every job started, stopped at the end

    def replica_b(self) -> LocalServer:
        return LocalServer("cpu-mini", [*REPLICA, f"--replica.router={self.router.register_endpoint}",
                                        "--replica.name=b", "--replica.heartbeat_s=0.5"])

    def states(self) -> dict[str, str]:
        with Client(self.router.endpoint, timeout_s=10) as client:
            return {name: r.state for name, r in client.stats().replicas.items()}


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    port_a = free_port()
    router = LocalRouter([("a", f"tcp://127.0.0.1:{port_a}", MAX_SESSIONS)], ROUTER, register_port=free_port())
    a = LocalServer("cpu-mini", [*REPLICA, f"--server.port={port_a}"])
    with router:
        f = Fleet(router, a, LocalServer("cpu-mini", []))
        f.b = f.replica_b()
        f.servers += [a, f.b]
        starts = [threading.Thread(target=s.start) for s in f.servers]
        for t in starts:
            t.start()
        for t in starts:
            t.join()
        try:
            wait_for("both replicas up at the router", lambda: f.states() == {"a": "up", "b": "up"}, 30)
            yield f
        finally:
            for server in f.servers:
                server.stop()
        assert router.stop() == 0, router.log()


def unaddressed(text: str) -> str:
    """An error text without the heap addresses some carry (an undecodable image names its BytesIO)."""
    return re.sub(r" at 0x[0-9a-f]+", "", text)


def stream(client: Client, session: str, chunks: int, keys: str = "w") -> list[int]:
    for index in range(chunks):
        client.control(session, index, keys=keys)
    return [c.index for c in client.chunks(session, timeout_s=60)]


def test_sessions_spread_over_both_replicas_arrive_in_order_and_a_full_fleet_answers_busy(fleet: Fleet) -> None:
    clients = [Client(fleet.router.endpoint) for _ in range(2 * MAX_SESSIONS + 1)]
    try:
        sessions = [c.open(IMAGE, num_chunks=5) for c in clients[:-1]]
        placed = [replica_of(c, s.id) for c, s in zip(clients, sessions)]
        assert sorted(placed) == ["a"] * MAX_SESSIONS + ["b"] * MAX_SESSIONS
        with pytest.raises(Busy) as refused:
            clients[-1].open(IMAGE, num_chunks=5)
        assert refused.value.retry_after_s == 5.0 and f"a {MAX_SESSIONS}/{MAX_SESSIONS}" in refused.value.message
        results: dict[int, list[int]] = {}
        summaries: dict[int, SessionSummary] = {}

        def run(n: int) -> None:
            results[n] = stream(clients[n], sessions[n].id, 5, keys="wasd"[n % 4])
            summaries[n] = clients[n].wait_closed(sessions[n].id)

        threads = [threading.Thread(target=run, args=(n,)) for n in range(len(sessions))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert results == {n: [0, 1, 2, 3, 4] for n in range(len(sessions))}
        assert all(s.reason == "complete" and s.chunks == 5 for s in summaries.values())
        assert len({s.id for s in sessions}) == len(sessions)  # unique across replicas
    finally:
        for c in clients:
            c.close_client()


def test_bad_input_at_the_router_gets_the_same_typed_errors_as_at_a_server(fleet: Fleet) -> None:
    context = zmq.Context.instance()

    def ask(endpoint: str, data: bytes | list[bytes]) -> protocol.Error:
        raw = context.socket(zmq.DEALER)
        raw.connect(endpoint)
        try:
            raw.send_multipart(data) if isinstance(data, list) else raw.send(data)
            assert raw.poll(30_000), f"no reply from {endpoint}"
            reply = read_server(raw)
        finally:
            raw.close(linger=0)
        assert isinstance(reply, protocol.Error)
        return reply

    def enc(**fields: object) -> bytes:
        return msgspec.msgpack.encode({"v": protocol.PROTOCOL_VERSION, **fields})

    with Client(fleet.router.endpoint) as good:
        info = good.open(IMAGE, num_chunks=8)
        sender = threading.Thread(target=lambda: [good.control(info.id, i, keys="d") for i in range(8)])
        sender.start()
        cases = [
            b"\x93\xc1\xff not msgpack",
            enc(type="warp", req=1),
            msgspec.msgpack.encode({"v": 99, "type": "stats", "req": 2}),
            enc(type="open", image=IMAGE),
            enc(type="open", req=3, image=b"\0" * (16 * 2**20 + 4096)),  # over the limit, under MAXMSGSIZE
            enc(type="open", req=4, image=b"GIF89a-but-not-really"),
            enc(type="open", req=5, image=IMAGE, num_chunks=0),
            enc(type="open", req=6, image=IMAGE, prompt="x" * 5000),
            enc(type="control", req=7, session="nope", index=0),
            enc(type="control", req=8, session=info.id, index=0),  # another client's session
            enc(type="control", req=9, session="x", index=0, control={"keys": ["q"]}),
            enc(type="heartbeat", req=10, session="nope"),
        ]
        for data in cases:
            at_router, at_server = ask(fleet.router.endpoint, data), ask(fleet.a.endpoint, data)
            assert (at_router.req, at_router.code, unaddressed(at_router.message)) == \
                   (at_server.req, at_server.code, unaddressed(at_server.message)), data[:60]
        multi = ask(fleet.router.endpoint, [enc(type="stats", req=1), b"extra"])
        assert multi.code == "bad_message" and "one ZeroMQ frame" in multi.message
        with pytest.raises(ServerError, match=r"rejected_control.*expected index"):
            good.control(info.id, 40, keys="d")  # the replica's own answer, through the router
        chunks = [c.index for c in good.chunks(info.id, timeout_s=60)]
        sender.join(timeout=30)
    assert chunks == list(range(8))  # the bad input harmed nothing


def test_router_stats_list_each_replica_and_sum_them(fleet: Fleet) -> None:
    with Client(fleet.router.endpoint) as client:
        info = client.open(IMAGE, num_chunks=3)
        stats = client.stats()
        assert set(stats.per_session) == {info.id}  # only this client's sessions
        replica = stats.per_session[info.id].replica
        assert stream(client, info.id, 3) == [0, 1, 2]
        # its replica's stats, as the router last read them, count the session's chunks: the counters are fresh

        def fresh() -> bool:
            shown = client.stats().replicas[replica].stats
            return shown is not None and shown["chunks_emitted"] >= 3

        wait_for("the router read its replica's stats since the chunks", fresh, 30)
        stats = client.stats()
    replicas = stats.replicas
    assert set(replicas) == {"a", "b"} and {r.state for r in replicas.values()} == {"up"}
    assert replicas["a"].source == "config" and replicas["b"].source == "registered"
    assert replicas["b"].layout == "cpu-mini" and replicas["b"].max_sessions == MAX_SESSIONS
    assert replicas[replica].stats["chunks_emitted"] >= 3
    total = stats.total
    assert total.chunks_emitted == sum(r.stats["chunks_emitted"] for r in replicas.values()) > 0
    assert total.max_sessions == 2 * MAX_SESSIONS and total.replicas_up == 2
    assert stats.router.chunks_forwarded >= 3 and stats.router.client_messages >= 5
    json.dumps(protocol.to_builtins(stats))  # plain JSON all the way down


def test_a_killed_replica_ends_only_its_sessions_and_rejoins_after_restart(fleet: Fleet) -> None:
    clients = [Client(fleet.router.endpoint, timeout_s=30) for _ in range(5)]
    try:
        streamers = []
        for client in clients[:4]:
            info = client.open(IMAGE)
            streamers.append(Streamer(client, info.id, replica_of(client, info.id)))
        assert sorted(s.replica for s in streamers) == ["a", "a", "b", "b"]
        threads = [s.start() for s in streamers]
        wait_for("every session streaming", lambda: all(len(s.chunks) >= 3 for s in streamers), 60)
        lost = [s for s in streamers if s.replica == "b"]
        kept = [s for s in streamers if s.replica == "a"]

        killed = time.monotonic()
        fleet.b.kill_rank(1)  # mid-stream: the DiT and decode rank of replica b
        wait_for("b's clients told", lambda: all(s.error is not None for s in lost), 30)
        for s in lost:
            assert isinstance(s.error, ServerGone) and s.error.code == "rank_failed", s.error
            assert "replica b" in s.error.message and s.error.session == s.session
        told_s = max(s.error_at for s in lost) - killed

        opened = clients[4].open(IMAGE, num_chunks=3)  # on the survivor (b is down or its open is moved)
        new_session_s = time.monotonic() - killed
        assert replica_of(clients[4], opened.id) == "a"
        assert stream(clients[4], opened.id, 3) == [0, 1, 2]
        before = {id(s): len(s.chunks) for s in kept}
        wait_for("a's sessions stream on", lambda: all(len(s.chunks) > before[id(s)] + 3 for s in kept), 30)
        assert fleet.b.wait(timeout_s=30) != 0  # the job ended non-zero (Slurm would requeue it)

        restarted = fleet.replica_b()
        fleet.servers.append(restarted)
        restarted.start()
        serving = time.monotonic()
        rejoin_s = wait_for("b rejoined", lambda: fleet.states().get("b") == "up", 30)
        with Client(fleet.router.endpoint) as client:
            info = client.open(IMAGE, num_chunks=3)
            assert replica_of(client, info.id) == "b"  # a holds 3 of 3: the rejoined replica takes it
            assert stream(client, info.id, 3) == [0, 1, 2]

        for s in kept:
            s.stop.set()
        for t in threads:
            t.join(timeout=60)
        for s in kept:
            assert s.error is None and s.summary is not None and s.summary.reason == "client"
            assert [i for i, _ in s.chunks] == list(range(len(s.chunks)))
        print(f"\nfailover: kill -> clients told {told_s:.2f} s, kill -> new session on the survivor "
              f"{new_session_s:.2f} s, restarted replica serving -> rejoined {rejoin_s:.2f} s "
              f"(serving {serving - killed:.1f} s after the kill)")
    finally:
        for c in clients:
            c.close_client()
