"""Spectators end to end on the 7-rank CPU layout (the session's shared server, ``tests/conftest.py``): real ranks,
real sockets. A watcher sees the player's frames bit for bit; a watcher that stops reading loses its oldest chunks
and slows neither the player nor another watcher; bad tokens, a full session and a watcher's controls get clear
errors."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import zmq

from ipc import protocol
from ipc.aio_client import AsyncClient
from ipc.client import BadRequest, ChunkResult, Client, UnknownSession, WatchOnly
from runtime.watchers import MAX_WATCHERS
from scripts.local_server import ROOT, LocalServer
from tests.shared import read_server

pytestmark = pytest.mark.multiprocess

IMAGE = (ROOT / "assets" / "start.png").read_bytes()
WAIT_S = 30.0


@pytest.fixture(scope="module")
def server(shared_server: LocalServer) -> LocalServer:
    return shared_server


class RawWatcher:
    """A watcher on a bare DEALER socket, so a test decides when (and whether) it reads. Its receive side is kept
    small, so a watcher that stops reading fills up after a few chunks."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 1)
        self.sock.setsockopt(zmq.RCVBUF, 1 << 16)
        self.sock.connect(endpoint)
        self.req = 0

    def send(self, message: Any) -> None:
        self.sock.send(protocol.encode(message))

    def ask(self, message: Any) -> Any:
        self.send(message)
        return self.answer(message.req)

    def answer(self, req: int) -> Any:
        while True:
            assert self.sock.poll(int(WAIT_S * 1000)), f"no answer to request {req}"
            message = read_server(self.sock)
            if getattr(message, "req", None) == req:
                return message

    def read_until_closed(self) -> list[Any]:
        out: list[Any] = []
        while True:
            assert self.sock.poll(int(WAIT_S * 1000)), "the watcher's stream did not end"
            message = read_server(self.sock)
            if isinstance(message, protocol.Chunk | protocol.Missed | protocol.Closed):
                out.append(message)
            if isinstance(message, protocol.Closed):
                return out

    def close(self) -> None:
        self.sock.close()


def play(client: Client, sid: str, indices: range) -> list[ChunkResult]:
    out = []
    for index in indices:
        client.control(sid, index, keys="wd"[index % 2])
    for _ in indices:
        out.append(client.next_chunk(sid, timeout_s=WAIT_S))
    return out


def test_a_watcher_gets_the_players_frames_bit_for_bit_from_the_chunk_after_it_subscribed(server: LocalServer) -> None:
    with Client(server.endpoint) as owner, Client(server.endpoint) as watcher:
        info = owner.open(IMAGE, num_chunks=8, seed=11)
        assert len(info.watch_token) >= 32
        before = play(owner, info.id, range(3))  # nothing more is emitted until control 3 is sent
        watch = watcher.watch(info.id, info.watch_token, timeout_s=WAIT_S)
        assert (watch.info.id, watch.info.height, watch.info.width) == (info.id, info.height, info.width)
        after = play(owner, info.id, range(3, 8))
        seen = list(watch)
        assert owner.wait_closed(info.id).reason == "complete"
    assert [c.index for c in before + after] == list(range(8))
    assert [c.index for c in seen] == list(range(3, 8)) and watch.missed == 0
    for mine, theirs in zip(after, seen, strict=True):
        assert mine.frames.tobytes() == theirs.frames.tobytes() and mine.facts == theirs.facts


def test_a_watcher_that_stops_reading_drops_its_oldest_chunks_and_slows_no_one(server: LocalServer) -> None:
    chunks = 40
    slow = RawWatcher(server.endpoint)
    with Client(server.endpoint) as owner, Client(server.endpoint) as fast:
        info = owner.open(IMAGE, num_chunks=chunks, seed=3)
        assert isinstance(slow.ask(protocol.Watch(req=1, session=info.id, token=info.watch_token)),
                          protocol.Watching)
        watch = fast.watch(info.id, info.watch_token, timeout_s=WAIT_S)
        played: list[ChunkResult] = []
        player = threading.Thread(target=lambda: played.extend(play(owner, info.id, range(chunks))))
        player.start()
        while player.is_alive():  # the slow watcher is alive (heartbeats) but reads nothing
            slow.send(protocol.Heartbeat())
            player.join(0.3)
        seen = list(watch)
        summary = owner.wait_closed(info.id)
    got = slow.read_until_closed()
    slow.close()
    assert [c.index for c in played] == list(range(chunks))  # the player got every chunk
    assert [c.index for c in seen] == list(range(chunks)) and watch.missed == 0  # so did the reading watcher
    assert summary.reason == "complete"
    indices = [m.facts.index for m in got if isinstance(m, protocol.Chunk)]
    missed = [m for m in got if isinstance(m, protocol.Missed)]
    assert missed and missed[-1].total == sum(m.chunks for m in missed) == chunks - len(indices)
    assert indices == sorted(indices) and indices[-1] == chunks - 1  # it lost the oldest, never the newest
    assert isinstance(got[-1], protocol.Closed) and got[-1].reason == "complete"
    with Client(server.endpoint) as reader:  # the server counts them (its shell reports once a heartbeat)
        deadline = time.monotonic() + 10
        while reader.stats().watch_dropped < missed[-1].total:
            assert time.monotonic() < deadline, "the drops never reached the server's stats"
            time.sleep(0.1)
    period = summary.chunk_period_s
    print(f"player chunk period p50 {period.p50:.4f} s p90 {period.p90:.4f} s; slow watcher got "
          f"{len(indices)} of {chunks} chunks, {missed[-1].total} dropped")


def test_a_wrong_token_and_an_unknown_session_are_refused_alike(server: LocalServer) -> None:
    with Client(server.endpoint) as owner, Client(server.endpoint) as other:
        info = owner.open(IMAGE, num_chunks=2)
        with pytest.raises(UnknownSession) as wrong:
            other.watch(info.id, info.watch_token[::-1])
        with pytest.raises(UnknownSession) as unknown:
            other.watch("0123456789ab", info.watch_token)
        assert wrong.value.message.replace(info.id, "?") == unknown.value.message.replace("0123456789ab", "?")
        with pytest.raises(BadRequest, match="owns session"):
            owner.watch(info.id, info.watch_token)
        owner.close(info.id)


def test_watchers_beyond_max_watchers_are_refused_busy(server: LocalServer) -> None:
    watchers = [RawWatcher(server.endpoint) for _ in range(MAX_WATCHERS + 1)]
    try:
        with Client(server.endpoint) as owner:
            info = owner.open(IMAGE, num_chunks=2)
            answers = [w.ask(protocol.Watch(req=1, session=info.id, token=info.watch_token)) for w in watchers]
            assert all(isinstance(a, protocol.Watching) for a in answers[:-1])
            refused = answers[-1]
            assert isinstance(refused, protocol.Error) and refused.code == "busy"
            assert f"limit of {MAX_WATCHERS} watchers" in refused.message and refused.retry_after_s
            assert owner.stats().watchers >= MAX_WATCHERS
            owner.close(info.id)
        for w in watchers[:-1]:
            assert isinstance(w.read_until_closed()[-1], protocol.Closed)
    finally:
        for w in watchers:
            w.close()


def test_a_watcher_cannot_control_or_close_the_session_and_can_unwatch(server: LocalServer) -> None:
    with Client(server.endpoint) as owner, Client(server.endpoint) as watcher:
        info = owner.open(IMAGE, num_chunks=4)
        watch = watcher.watch(info.id, info.watch_token, timeout_s=WAIT_S)
        with pytest.raises(WatchOnly, match="only its owner"):
            watcher.control(info.id, 0, keys="w")
        with pytest.raises(WatchOnly):
            watcher.close(info.id, timeout_s=5)
        play(owner, info.id, range(2))
        assert next(watch).index == 0
        assert watcher.unwatch(info.id).reason == "unwatched"
        with pytest.raises(UnknownSession):
            watcher.unwatch(info.id)
        play(owner, info.id, range(2, 4))  # it streams on for its owner
        assert owner.wait_closed(info.id).reason == "complete"


def test_the_async_client_watches_a_session(server: LocalServer) -> None:
    async def scenario(sid: str, token: str) -> tuple[list[int], int]:
        async with AsyncClient(server.endpoint) as client:
            watch = await client.watch(sid, token, timeout_s=WAIT_S)
            started.set()
            return [c.index async for c in watch], watch.missed

    started = threading.Event()
    with Client(server.endpoint) as owner:
        info = owner.open(IMAGE, num_chunks=3)
        result: list[tuple[list[int], int]] = []
        thread = threading.Thread(target=lambda: result.append(asyncio.run(scenario(info.id, info.watch_token))))
        thread.start()
        assert started.wait(WAIT_S)
        play(owner, info.id, range(3))
        thread.join(WAIT_S)
    assert result == [([0, 1, 2], 0)]
