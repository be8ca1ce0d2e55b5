"""A session survives its replica, all real: two 2-rank ``cpu-mini`` jobs (synthetic backend, gloo) sharing one
snapshot folder behind a router with ``snapshot_every``; a rank of the replica holding the session is killed with
SIGKILL mid-stream. The client is told ``migrated`` and gets the chunks again from the snapshot's chunk, bit for
bit the frames it got before for the same indices (and the uninterrupted session's after them); the router deletes
the snapshots it asked for once their sessions ended (``router.snapshots_dir``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ipc.client import Client, RejectedControl, SessionMigrated
from scripts.local_router import LocalRouter
from scripts.local_server import ROOT, LocalServer
from tests.test_router import COSTS, free_port, replica_of, wait_for

pytestmark = pytest.mark.multiprocess

IMAGE = (ROOT / "assets" / "start.png").read_bytes()
CHUNKS = 12
BEFORE = 7  # chunks 0..6 stream before the kill
KEYS = ["w", "d", "wj", "", "l", "sa", "i", "w", "k", "ad", "j", "s"]  # one per chunk: each moves differently
EVERY = 2


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalRouter, dict[str, LocalServer]]]:
    folder: Path = tmp_path_factory.mktemp("snapshots")  # shared by both replicas: either restores the other's
    ports = {"a": free_port(), "b": free_port()}
    servers = {name: LocalServer("cpu-mini", [*COSTS, f"--server.port={port}", f"--snapshots.dir={folder}"])
               for name, port in ports.items()}
    router = LocalRouter([(name, f"tcp://127.0.0.1:{port}", 2) for name, port in ports.items()],
                         ["--router.heartbeat_s=0.25", "--router.replica_dead_s=3", "--router.stats_interval_s=0.5",
                          f"--router.snapshot_every={EVERY}", f"--router.snapshots_dir={folder}"])
    router.snapshots = folder  # type: ignore[attr-defined]
    with router:
        starts = [threading.Thread(target=s.start) for s in servers.values()]
        for t in starts:
            t.start()
        for t in starts:
            t.join()
        try:
            with Client(router.endpoint, timeout_s=10) as client:
                wait_for("both replicas up", lambda: {n: r.state for n, r in client.stats().replicas.items()}
                         == {"a": "up", "b": "up"}, 60)
            yield router, servers
        finally:
            for server in servers.values():
                server.stop()
        assert router.stop() == 0, router.log()


def step(client: Client, session: str, index: int, revisions: dict[int, int] | None = None) -> np.ndarray:
    """Chunk ``index`` under its control; its frames (its prompt revision into ``revisions``)."""
    client.control(session, index, keys=KEYS[index])
    chunk = client.next_chunk(session, timeout_s=60)
    assert chunk.index == index
    if revisions is not None:
        revisions[index] = chunk.prompt_revision
    return chunk.frames.copy()


def test_a_session_whose_replica_is_killed_resumes_on_the_other_from_its_snapshot_bit_for_bit(
        fleet: tuple[LocalRouter, dict[str, LocalServer]]) -> None:  # fmt: skip
    router, servers = fleet
    with Client(router.endpoint, timeout_s=60) as client:
        reference = client.open(IMAGE, prompt="a quiet harbour", seed=7, num_chunks=CHUNKS)
        expected = {i: step(client, reference.id, i) for i in range(CHUNKS)}  # saved every 2 chunks, never moved
        client.wait_closed(reference.id, timeout_s=60)
        saves = client.stats().router.autosaves  # the reference's

        info = client.open(IMAGE, prompt="a quiet harbour", seed=7, num_chunks=CHUNKS)
        before = {i: step(client, info.id, i) for i in range(BEFORE)}
        assert all(np.array_equal(before[i], expected[i]) for i in before), "the router's saves changed the stream"
        wait_for("a save of the session", lambda: client.stats().router.autosaves > saves, 30)
        holder = replica_of(client, info.id)
        # a new prompt after the snapshot (the synthetic frames do not depend on its text; the facts name it)
        scheduled = client.set_prompt(info.id, "a harbour in a storm")
        assert scheduled.revision == 1 and scheduled.chunk >= BEFORE, scheduled

        killed = time.monotonic()
        servers[holder].kill_rank(1)  # the DiT and decode rank of the replica holding the session
        with pytest.raises(SessionMigrated) as moved:
            client.next_chunk(info.id, timeout_s=60)
        told_s = time.monotonic() - killed
        resume = moved.value.chunk
        assert moved.value.replica != holder and moved.value.session == info.id
        assert 0 < resume < BEFORE, resume  # a snapshot taken while it streamed (every 2 chunks)
        assert replica_of(client, info.id) == moved.value.replica  # the same id towards the client

        with pytest.raises(RejectedControl, match=f"from index {resume}"):
            client.control(info.id, resume - 1, keys="w", wait=True)
        revisions: dict[int, int] = {}
        again = step(client, info.id, resume, revisions)
        first_frame_s = time.monotonic() - killed
        assert np.array_equal(again, before[resume])
        after = {resume: again} | {i: step(client, info.id, i, revisions) for i in range(resume + 1, CHUNKS)}
        # the router set the prompt again on the survivor (its snapshot predates it): in force from the survivor's
        # next undispatched chunk once encoded (which one is a race with the client's controls), as revision 1
        # there too (the snapshot's revision 0, plus one)
        assert revisions[CHUNKS - 1] == 1, revisions
        assert sorted(revisions.values()) == list(revisions.values()), revisions
        for i in range(resume, BEFORE):
            assert np.array_equal(after[i], before[i]), f"chunk {i} differs from the one got before the kill"
        for i in range(resume, CHUNKS):
            assert np.array_equal(after[i], expected[i]), f"chunk {i} differs from the uninterrupted session's"
        client.wait_closed(info.id, timeout_s=60)
        assert client.stats().router.migrations == 1
    folder: Path = router.snapshots  # type: ignore[attr-defined]
    wait_for("the router's snapshots deleted once their sessions ended",
             lambda: not list(folder.glob("*/manifest.json")), 10)
    print(f"\nmigration: SIGKILL -> migrated notice {told_s:.2f} s, -> first frame on the survivor "
          f"{first_frame_s:.2f} s (resumed at chunk {resume}, {BEFORE - resume} chunks produced again)")
