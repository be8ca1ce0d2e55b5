"""The drain, all real: 2-rank ``cpu-mini`` jobs (synthetic backend, gloo) sharing one snapshot folder, loopback
ZeroMQ, real signals. Behind a router, three sessions on replica A and a SIGTERM to A: each goes on on B under its
own id with its chunk indices contiguous, and A exits 0 within ``server.drain_s``. Without a router: the client gets
``draining`` with a snapshot id it restores on another server, where the session goes on bit for bit as an
uninterrupted one under the same controls. One launch of each job serves every test of the module (A twice)."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ipc.client import Client, SessionDraining, SessionMigrated
from scripts.local_router import LocalRouter
from scripts.local_server import ROOT, LocalServer
from tests.test_router import COSTS, free_port, replica_of, wait_for

pytestmark = pytest.mark.multiprocess

IMAGE = (ROOT / "assets" / "start.png").read_bytes()
CHUNKS = 9
BEFORE = 4  # chunks 0..3 stream before the SIGTERM (and the control of chunk 4 is sent)
KEYS = ["w", "d", "wj", "", "l", "sa", "i", "w", "k"]  # one per chunk: each moves differently
DRAIN_S = 30.0


class Fleet:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.ports = {"a": free_port(), "b": free_port()}
        self.servers = {name: self.server(name) for name in self.ports}
        self.router = LocalRouter([(name, f"tcp://127.0.0.1:{port}", 3) for name, port in self.ports.items()],
                                  ["--router.heartbeat_s=0.25", "--router.replica_dead_s=3",
                                   "--router.stats_interval_s=0.5"])

    def server(self, name: str) -> LocalServer:
        return LocalServer("cpu-mini", [*COSTS, f"--server.port={self.ports[name]}", f"--snapshots.dir={self.folder}",
                                        f"--server.drain_s={DRAIN_S}", "--server.max_sessions=3"])

    def states(self) -> dict[str, str]:
        with Client(self.router.endpoint, timeout_s=10) as client:
            return {n: r.state for n, r in client.stats().replicas.items()}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path_factory.mktemp("snapshots"))  # shared: either server restores the other's
    with fleet.router:
        try:
            yield fleet
        finally:
            for server in fleet.servers.values():
                server.stop()
        assert fleet.router.stop() == 0, fleet.router.log()


def frames(client: Client, session: str, index: int) -> np.ndarray:
    client.control(session, index, keys=KEYS[index])
    chunk = client.next_chunk(session, timeout_s=60)
    assert chunk.index == index
    return chunk.frames.copy()


def sigterm(server: LocalServer) -> float:
    assert server.process is not None
    server.process.send_signal(signal.SIGTERM)
    return time.monotonic()


def until_handed_off(client: Client, session: str, expected: type[Exception]) -> tuple[dict[int, np.ndarray], Any]:
    """The chunks a session streams after the SIGTERM (by index) until its hand-off notice."""
    seen = {}
    while True:
        try:
            chunk = client.next_chunk(session, timeout_s=60)
        except expected as notice:
            return seen, notice
        seen[chunk.index] = chunk.frames.copy()


def test_sigterm_moves_every_session_of_a_replica_to_the_other_under_its_own_id(fleet: Fleet) -> None:
    a, b = fleet.servers["a"].start(), fleet.servers["b"]
    wait_for("replica a up", lambda: fleet.states()["a"] == "up", 60)
    with Client(fleet.router.endpoint, timeout_s=60) as client:
        sessions = [client.open(IMAGE, prompt="a quiet harbour", seed=seed, num_chunks=CHUNKS).id for seed in (1, 2, 3)]
        assert {replica_of(client, sid) for sid in sessions} == {"a"}  # b is not up yet
        b.start()
        wait_for("replica b up", lambda: fleet.states() == {"a": "up", "b": "up"}, 60)
        for index in range(BEFORE):
            for sid in sessions:
                client.control(sid, index, keys=KEYS[index])
            assert [client.next_chunk(sid, timeout_s=60).index for sid in sessions] == [index] * 3
        for sid in sessions:  # one more control: the SIGTERM meets chunk BEFORE anywhere on its way
            client.control(sid, BEFORE, keys=KEYS[BEFORE])

        began = sigterm(a)
        moves = {sid: until_handed_off(client, sid, SessionMigrated) for sid in sessions}
        for sid, (seen, moved) in moves.items():
            assert isinstance(moved, SessionMigrated) and moved.session == sid and moved.replica == "b"
            last = BEFORE - 1 + len(seen)  # indices so far: 0..last, contiguous
            assert list(seen) == list(range(BEFORE, last + 1)), list(seen)
            assert moved.chunk <= last + 1, (moved.chunk, last)  # nothing skipped
            assert moved.chunk >= BEFORE, moved.chunk  # saved at its next boundary, not an older snapshot
            assert last + 1 - moved.chunk == 0, "the drain holds the boundary chunk: none is streamed twice"
            assert replica_of(client, sid) == "b"
        assert a.wait(DRAIN_S) == 0, a.log()  # every session handed off: a is done, before b streams them on
        assert time.monotonic() - began < DRAIN_S
        for sid, (_, moved) in moves.items():  # each goes on on b from where it was saved, under its own id
            indices = []
            for index in range(moved.chunk, CHUNKS):
                client.control(sid, index, keys=KEYS[index])
                indices.append(client.next_chunk(sid, timeout_s=60).index)
            assert indices == list(range(moved.chunk, CHUNKS))
            client.wait_closed(sid, timeout_s=60)
        assert "drain over: every session handed off (3 of 3)" in a.log()
        assert client.stats().router.migrations == 3


def test_without_a_router_the_client_restores_the_drained_session_elsewhere_bit_for_bit(fleet: Fleet) -> None:
    b = fleet.servers["b"]
    if b.process is None:
        b.start()
    drained = fleet.servers["a"]
    if drained.process is not None and drained.process.poll() is None:  # the first test stopped short of its exit
        drained.stop()
    a = fleet.servers["a"] = fleet.server("a").start()  # a fresh a on the same port
    with Client(b.endpoint, timeout_s=60) as there:
        reference = there.open(IMAGE, prompt="a quiet harbour", seed=7, num_chunks=CHUNKS)
        expected = [frames(there, reference.id, i) for i in range(CHUNKS)]
        there.wait_closed(reference.id, timeout_s=60)
    with Client(a.endpoint, timeout_s=60) as here:
        info = here.open(IMAGE, prompt="a quiet harbour", seed=7, num_chunks=CHUNKS)
        got = {i: frames(here, info.id, i) for i in range(BEFORE)}
        here.control(info.id, BEFORE, keys=KEYS[BEFORE])
        sigterm(a)
        seen, notice = until_handed_off(here, info.id, SessionDraining)
        assert isinstance(notice, SessionDraining) and notice.snapshot and notice.session == info.id
        assert list(seen) == list(range(BEFORE, notice.chunk)), (list(seen), notice.chunk)  # all below it first
        got |= seen
        told = here.draining(info.id)
        assert told is not None and told.snapshot == notice.snapshot
        assert here.wait_closed(info.id, timeout_s=30).reason == "drained"
    assert a.wait(DRAIN_S) == 0, a.log()
    with Client(b.endpoint, timeout_s=60) as there:
        restored = there.open(restore=notice.snapshot)
        assert restored.first_chunk == notice.chunk
        for i in range(notice.chunk, CHUNKS):
            got[i] = frames(there, restored.id, i)
        there.wait_closed(restored.id, timeout_s=60)
    assert sorted(got) == list(range(CHUNKS))
    for i in range(CHUNKS):
        assert np.array_equal(got[i], expected[i]), f"chunk {i} differs from the uninterrupted session's"
