"""Spectators through the router process (``python -m ranks.router``) with a fake replica (``tests.fake_replica``:
real ZeroMQ sockets, no ranks) whose chunks are large enough to fill a slow reader's queues in a few chunks. The
router feeds watchers itself: its replica sends each chunk once, and the router's replica queues never carry a
watcher's copy."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from ipc import protocol
from ipc.client import BadRequest, Busy, ChunkResult, Client, UnknownSession, WatchOnly
from scripts.local_router import LocalRouter
from tests.fake_replica import FakeReplica
from tests.test_router import wait_for
from tests.test_watch import RawWatcher

pytestmark = pytest.mark.multiprocess

MAX_WATCHERS = 2
FLAGS = ["--router.heartbeat_s=0.1", "--router.replica_dead_s=2.0", "--router.stats_interval_s=0.2",
         f"--router.max_watchers={MAX_WATCHERS}"]
WAIT_S = 20.0


@pytest.fixture(scope="module")
def router() -> Iterator[LocalRouter]:
    replica = FakeReplica("server-w", side=256)  # a 4-frame chunk is 786 KB
    with LocalRouter([("a", replica.endpoint, 4)], FLAGS) as router, Client(router.endpoint) as client:
        wait_for("replica a up", lambda: client.stats().replicas["a"].state == "up", 20)
        yield router
    replica.stop()


def play(client: Client, sid: str, chunks: int) -> list[ChunkResult]:
    for index in range(chunks):
        client.control(sid, index, keys="w")
    return [client.next_chunk(sid, timeout_s=WAIT_S) for _ in range(chunks)]


def test_a_watcher_through_the_router_gets_the_owners_chunks_bit_for_bit(router: LocalRouter) -> None:
    with Client(router.endpoint) as owner, Client(router.endpoint) as watcher:
        forwarded = owner.stats().router.chunks_forwarded
        info = owner.open(b"png", num_chunks=6)
        assert len(info.watch_token) >= 32  # the router's own: this replica predates spectators
        watch = watcher.watch(info.id, info.watch_token, timeout_s=WAIT_S)
        assert (watch.info.height, watch.info.width) == (256, 256)
        mine = play(owner, info.id, 6)
        theirs = [next(watch) for _ in range(6)]
        stats = owner.stats().router
        owner.close(info.id)
        assert [c.index for c in theirs] == list(range(6)) and watch.missed == 0
        assert all(a.frames.tobytes() == b.frames.tobytes() for a, b in zip(mine, theirs, strict=True))
        assert stats.chunks_forwarded - forwarded == 6 and stats.watchers == 1  # each chunk read once
        assert list(watch) == []  # its stream ended with the session


def test_a_slow_watcher_at_the_router_loses_its_oldest_chunks_and_slows_no_one(router: LocalRouter) -> None:
    chunks = 60
    slow = RawWatcher(router.endpoint)
    with Client(router.endpoint) as owner, Client(router.endpoint) as fast:
        info = owner.open(b"png", num_chunks=chunks)
        assert isinstance(slow.ask(protocol.Watch(req=1, session=info.id, token=info.watch_token)),
                          protocol.Watching)
        watch = fast.watch(info.id, info.watch_token, timeout_s=WAIT_S)
        played: list[ChunkResult] = []
        player = threading.Thread(target=lambda: played.extend(play(owner, info.id, chunks)))
        player.start()
        while player.is_alive():
            slow.send(protocol.Heartbeat())
            player.join(0.3)
        seen = [next(watch) for _ in range(chunks)]
        owner.close(info.id)
    got = slow.read_until_closed()
    slow.close()
    assert [c.index for c in played] == list(range(chunks))
    assert [c.index for c in seen] == list(range(chunks)) and watch.missed == 0
    indices = [m.facts.index for m in got if isinstance(m, protocol.Chunk)]
    missed = [m for m in got if isinstance(m, protocol.Missed)]
    assert missed and missed[-1].total == chunks - len(indices)
    assert indices == sorted(indices) and indices[-1] == chunks - 1
    with Client(router.endpoint) as reader:  # the router counts them (its shell reports once a second)
        wait_for("drops counted", lambda: reader.stats().router.watch_dropped >= missed[-1].total, 5)


def test_the_router_refuses_bad_tokens_extra_watchers_and_a_watchers_controls(router: LocalRouter) -> None:
    with Client(router.endpoint) as owner, Client(router.endpoint) as w1, Client(router.endpoint) as w2, \
            Client(router.endpoint) as w3:
        info = owner.open(b"png", num_chunks=4)
        with pytest.raises(UnknownSession) as wrong:
            wrong_first = "x" if info.watch_token[0] != "x" else "y"  # a token may start with x (1 in 64)
            w1.watch(info.id, wrong_first + info.watch_token[1:])
        with pytest.raises(UnknownSession) as unknown:
            w1.watch("0123456789ab", info.watch_token)
        assert wrong.value.message.replace(info.id, "?") == unknown.value.message.replace("0123456789ab", "?")
        with pytest.raises(BadRequest, match="owns session"):
            owner.watch(info.id, info.watch_token)
        first, second = w1.watch(info.id, info.watch_token), w2.watch(info.id, info.watch_token)
        with pytest.raises(Busy, match=f"limit of {MAX_WATCHERS} watchers"):
            w3.watch(info.id, info.watch_token)
        with pytest.raises(WatchOnly):
            w1.control(info.id, 0, keys="w")
        with pytest.raises(WatchOnly):
            w1.close(info.id, timeout_s=5)
        assert w1.unwatch(info.id).reason == "unwatched"
        w3.watch(info.id, info.watch_token)  # a seat freed
        play(owner, info.id, 2)
        assert owner.close(info.id).reason == "client"
        assert [c.index for c in second] == [0, 1] and second.info.id == first.info.id
