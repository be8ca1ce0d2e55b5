"""A chunk's frames as a ZeroMQ part of their own (protocol 4), end to end: a real 2-rank job (``cpu-mini``, synthetic
backend, gloo), the router process in front of it, the Python SDK. The frames streamed are the very bytes main's
code streamed (one encoded map per chunk) for the same seed and controls: ``DIGESTS`` were taken from it, directly
and through a router, before the change.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from ipc import protocol
from ipc.client import Client
from scripts.local_router import LocalRouter
from scripts.local_server import ROOT, LocalServer
from scripts.ports import free_port
from tests.fake_replica import FakeReplica
from tests.fake_replica import chunk_parts as fake_chunk_parts

pytestmark = pytest.mark.multiprocess

IMAGE = (ROOT / "assets" / "start.png").read_bytes()
KEYS = ("w", "d", "", "aj")  # one chunk each
SEED = 7
# sha256 of each chunk's frames for SEED and KEYS, as main's code (protocol 3) streamed them at c3ff301
DIGESTS = ["8f924e69d0d599c5527fc89088d1e2c40e801da69133ae3283c889fa74ba46e9",
           "63b20c2f48c52ab4ab96bbc3227807eb02b754b847ce047810bccb4eef40109a",
           "11ebcd885a9870a364fc7be32b1727fe42457749f96d6111dfb6386aac0c8f2d",
           "3708992a9b469fe3a7486d461b7724d0eb0dfb2139145bdc7ef75c11213d3d9f"]


def wait_for_up(router: LocalRouter, timeout_s: float = 60) -> None:
    began = time.monotonic()
    with Client(router.endpoint, timeout_s=10) as client:
        while {name: r.state for name, r in client.stats().replicas.items()} != {"a": "up"}:
            assert time.monotonic() - began < timeout_s, "replica a not up at the router"
            time.sleep(0.05)


def stream_digests(endpoint: str) -> list[str]:
    with Client(endpoint, timeout_s=60) as client:
        info = client.open(IMAGE, seed=SEED, num_chunks=len(KEYS))
        for index, keys in enumerate(KEYS):
            client.control(info.id, index, keys=keys)
        digests = [hashlib.sha256(chunk.frames.tobytes()).hexdigest() for chunk in client.chunks(info.id, 60)]
        client.wait_closed(info.id)
        return digests


@pytest.fixture(scope="module")
def job() -> Iterator[tuple[LocalServer, LocalRouter]]:
    port = free_port()
    server = LocalServer("cpu-mini", [f"--server.port={port}"])
    router = LocalRouter([("a", f"tcp://127.0.0.1:{port}", 4)])
    with server, router:
        wait_for_up(router)
        yield server, router
    assert router.process is not None and router.process.returncode == 0, router.log()


def test_a_server_streams_the_same_frame_bytes_as_before_directly_and_through_the_router(
        job: tuple[LocalServer, LocalRouter]) -> None:
    server, router = job
    assert stream_digests(server.endpoint) == DIGESTS
    assert stream_digests(router.endpoint) == DIGESTS


@pytest.mark.parametrize("through", ["server", "router"])
def test_a_chunk_leaves_as_its_map_and_its_frames_part_and_crosses_the_router_as_it_is(
        job: tuple[LocalServer, LocalRouter], through: str) -> None:
    """On the wire (a bare DEALER, no SDK): every chunk is two ZeroMQ frames, the map saying where the frames are
    (``frames_part`` 1, no frames inside it) and the frames part exactly the shape's bytes; every other message one."""
    endpoint = (job[0] if through == "server" else job[1]).endpoint
    context = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(protocol.encode(protocol.Open(req=1, image=IMAGE, prompt="", seed=SEED, num_chunks=2)))
        opened = protocol.decode(recv_one(sock), "server")
        assert isinstance(opened, protocol.Opened) and opened.v == protocol.PROTOCOL_VERSION == 4
        for index in range(2):
            sock.send(protocol.encode(protocol.Control(req=2 + index, session=opened.session, index=index)))
        chunks = 0
        while chunks < 2:
            assert sock.poll(60_000), "no message within 60 s"
            parts = sock.recv_multipart()
            message = protocol.decode(parts[0], "server")
            if not isinstance(message, protocol.Chunk):
                assert len(parts) == 1, f"a {type(message).__name__} in {len(parts)} parts"
                continue
            chunks += 1
            n, height, width, _ = message.shape
            assert (len(parts), message.frames_part, message.frames) == (2, 1, b"")
            assert len(parts[1]) == n * height * width * 3 == n * opened.height * opened.width * 3 > 0
            raw = msgspec.msgpack.decode(parts[0])
            assert raw["frames_part"] == 1 and raw["frames"] == b""
        sock.send(protocol.encode(protocol.Close(req=9, session=opened.session)))
    finally:
        sock.close()


@pytest.mark.parametrize("through", ["server", "router"])
def test_an_sdk_before_version_4_is_refused_a_stream_in_words_and_a_version_it_reads(
        job: tuple[LocalServer, LocalRouter], through: str) -> None:
    endpoint = (job[0] if through == "server" else job[1]).endpoint
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(msgspec.msgpack.encode({"v": 3, "type": "open", "req": 5, "image": IMAGE, "num_chunks": 2}))
        raw = msgspec.msgpack.decode(recv_one(sock))
        assert (raw["type"], raw["v"], raw["req"], raw["code"]) == ("error", 3, 5, "bad_message")
        assert "upgrade the SDK" in raw["message"]
        sock.send(msgspec.msgpack.encode({"v": 3, "type": "stats", "req": 6}))  # others: answered
        assert msgspec.msgpack.decode(recv_one(sock))["type"] == "stats_reply"
    finally:
        sock.close()


def recv_one(sock: zmq.Socket) -> bytes:
    assert sock.poll(60_000), "no reply within 60 s"
    parts = sock.recv_multipart()
    assert len(parts) == 1
    return parts[0]


BROKEN = {  # chunk index -> how a broken replica sends that chunk's parts
    0: lambda parts: parts[:1],  # the frames part missing
    1: lambda parts: [*parts, b"more"],  # a part too many
    2: lambda parts: [parts[0], parts[1] + b"\0" * 64],  # a frames part larger than its shape
    3: lambda parts: [parts[0], parts[1][:-1]],  # shorter
}


def test_a_replicas_chunks_in_parts_other_than_their_map_says_are_dropped_at_the_router_and_another_session_streams(
        ) -> None:
    fake = FakeReplica("server-a")
    broken: set[str] = set()
    fake.chunk_parts = lambda chunk: (BROKEN[chunk.facts.index](fake_chunk_parts(chunk)) if chunk.session in broken
                                      else fake_chunk_parts(chunk))
    try:
        with LocalRouter([("a", fake.endpoint, 4)], ["--router.heartbeat_s=0.1"]) as router, \
                Client(router.endpoint, timeout_s=10) as client:
            wait_for_up(router)
            bad, good = client.open(b"png", num_chunks=4), client.open(b"png", num_chunks=4)
            broken.add(bad.id)
            for index in range(4):  # the replica sends bad's chunk i before good's: good's last one comes last
                client.control(bad.id, index, keys="w")
                client.control(good.id, index, keys="w")
            assert [client.next_chunk(good.id, timeout_s=30).index for _ in range(4)] == [0, 1, 2, 3]
            with pytest.raises(TimeoutError):
                client.next_chunk(bad.id, timeout_s=0.01)  # read after good's last chunk: none of bad's came
            assert router.log().count("unreadable message from replica a") == 4
            assert router.process is not None and router.process.poll() is None
            assert client.stats().replicas["a"].state == "up"
    finally:
        fake.stop()
