"""Every field of every message, in every direction, with a value of every msgpack type (``tests.hostile_fields``):
each is decoded into its typed message or refused with a ``ProtocolViolation`` naming the problem, and nothing else.
Then the same bytes, sent for real: to a 7-rank server's client port, to a router's client and registration ports,
and from a server to the SDK's ``Client``; each receiver answers and serves on. (An array for ``v`` once ended the
whole job: the version was tested against a set, and an array is unhashable.)"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import msgspec
import pytest
import zmq

from ipc import protocol, tolerant
from ipc.client import Client, ClientCore, ServerError, ServerGone
from ipc.metrics_types import ServerStats
from scripts.local_router import LocalRouter
from scripts.local_server import LocalServer
from tests.hostile_fields import DIRECTIONS, Case, cases
from tests.shared import free_port, read_server

READ = {"client": protocol.decode, "replica": protocol.decode, "server": tolerant.decode, "router": tolerant.decode}


@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_every_field_of_every_message_with_every_msgpack_type_is_read_typed_or_refused_by_name(direction: str) -> None:
    count = 0
    for case in cases(direction):
        count += 1
        try:
            message = READ[direction](case.data, direction)
        except protocol.ProtocolViolation as error:
            assert str(error), case.name
            if case.field != "req" and case.message in {"open", "control", "close", "save", "set_prompt", "watch"}:
                assert error.req in (1, None), case.name  # the error reaches the caller waiting for it, or none
            continue
        except Exception as error:  # the point: nothing but a ProtocolViolation leaves a read
            pytest.fail(f"{case.name}: {type(error).__name__}: {error}")
        assert isinstance(message, msgspec.Struct), case.name
    assert count >= 100  # the smallest, the router's answer to a registration, has 4 fields


def test_a_request_refused_for_a_field_names_its_request_id() -> None:
    data = msgspec.msgpack.encode({"v": 3, "type": "close", "req": 7, "session": [1]})
    with pytest.raises(protocol.ProtocolViolation, match="session") as refused:
        protocol.decode(data, "client")
    assert refused.value.req == 7
    for version in ([3], {}, "3", 2.5, None):
        data = msgspec.msgpack.encode({"v": version, "type": "stats", "req": 1})
        with pytest.raises(protocol.ProtocolViolation, match=r"version|message head"):
            protocol.decode(data, "client")


def _batches(direction: str, size: int, skip: frozenset[str] = frozenset()) -> Iterator[list[Case]]:
    it = (case for case in cases(direction) if case.message not in skip)
    while batch := list(itertools.islice(it, size)):
        yield batch


def _probe(sock: zmq.Socket, req: int, timeout_s: float = 60.0) -> list[object]:
    """Send ``stats(req)`` and read until its reply: every earlier reply was delivered, the receiver serves."""
    sock.send(protocol.encode(protocol.Stats(req=req)))
    replies: list[object] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not sock.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
            break
        message = read_server(sock, tolerant.decode)
        if isinstance(message, protocol.StatsReply) and message.req == req:
            return replies
        replies.append(message)
    raise AssertionError(f"no stats reply {req} within {timeout_s} s: the receiver stopped serving")


def _send_all(endpoint: str, send_hwm: int, skip: frozenset[str] = frozenset()) -> int:
    """Every client case to ``endpoint`` but those of the ``skip`` kinds, a few at a time (never more replies in
    flight than its send queue holds), each few followed by a stats probe; returns the replies read besides the
    probes'."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    replies = 0
    try:
        for req, batch in enumerate(_batches("client", max(1, send_hwm // 2 - 1), skip), start=1_000_000):
            for case in batch:
                sock.send(case.data)
            replies += len(_probe(sock, req))
    finally:
        sock.close()
    return replies


@pytest.mark.multiprocess
def test_a_server_answers_every_field_of_every_client_message_with_every_type_and_serves_on(
        shared_server: LocalServer) -> None:
    # (a well-formed ``drain`` drains the server: its fields are read above, its effect is test_drain_e2e.py's)
    replies = _send_all(shared_server.endpoint, send_hwm=4, skip=frozenset({"drain"}))  # its --server.send_hwm
    assert replies > 1000  # most hostile messages are answered with an error naming the field
    assert shared_server.process is not None and shared_server.process.poll() is None
    with Client(shared_server.endpoint, timeout_s=30) as client:
        assert client.stats().uptime_s > 0


@pytest.mark.multiprocess
def test_a_router_answers_every_field_on_both_its_ports_and_serves_on() -> None:
    with LocalRouter([], register_port=free_port()) as router:
        replies = _send_all(router.endpoint, send_hwm=8)
        assert replies > 1000
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(router.register_endpoint)
        try:
            answered = 0
            for case in cases("replica"):
                sock.send(case.data)
                if sock.poll(10_000):
                    answer = protocol.decode(sock.recv(), "router")
                    assert isinstance(answer, protocol.Registered), case.name
                    answered += 1
            assert answered > 150
        finally:
            sock.close()
        assert router.process is not None and router.process.poll() is None
        with Client(router.endpoint, timeout_s=30) as client:
            assert client.stats().layout == "router"


class FakeServer:
    """A ROUTER socket that answers a client's stats with a real reply and sends it whatever it is told to."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.peer: bytes | None = None

    def serve_once(self, timeout_s: float = 30.0) -> protocol.Stats | None:
        """Read one message (learning the client's identity); answer it when it is a stats request."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        self.peer, data = self.sock.recv_multipart()
        try:
            message = protocol.decode(data, "client")
        except protocol.ProtocolViolation:  # the client closing a hostile "opened" of a 5000-character session id
            return None
        if isinstance(message, protocol.Stats):
            stats = ServerStats(uptime_s=1.0, open_sessions=0)
            self.sock.send_multipart([self.peer, protocol.encode(protocol.StatsReply(req=message.req, stats=stats))])
            return message
        return None


def _read_by(client: Client, server: FakeServer, marker: str) -> None:
    """A ``closed`` for a made-up session, waited for: the client read everything sent before it."""
    closed = protocol.Closed(session=marker, reason="complete")
    server.sock.send_multipart([server.peer, protocol.encode(closed)])
    for _ in range(1000):
        try:
            client.wait_closed(marker, timeout_s=60)
            return
        except ServerGone:  # a hostile heartbeat ack named another server id: "restarted", which ends streams
            continue
    raise AssertionError("the marker's closed never came")


def test_the_sdk_reads_every_field_of_every_server_message_with_every_type_and_serves_on() -> None:
    server = FakeServer()
    with Client(server.endpoint, timeout_s=30, heartbeat_s=0.05, server_silent_s=600) as client:
        while server.peer is None:  # its first heartbeat names it
            server.serve_once()
        assert server.peer is not None
        for sent, case in enumerate(cases("server"), start=1):
            server.sock.send_multipart([server.peer, case.data])
            if sent % 500 == 0:  # never more in flight than the sockets queue (a ROUTER drops beyond them)
                _read_by(client, server, f"marker-{sent}")
        _read_by(client, server, "marker-end")  # every hostile reply was read before the request below
        answer: list[float] = []
        asking = threading.Thread(target=lambda: answer.append(client.stats().uptime_s))
        asking.start()
        deadline = time.monotonic() + 60
        while asking.is_alive() and time.monotonic() < deadline:
            server.serve_once(timeout_s=1.0)
        asking.join(timeout=1.0)
        assert answer == [1.0], "the client stopped reading its server"
    server.sock.close()


def test_a_reply_of_another_kind_than_its_request_takes_fails_that_request_as_bad_reply() -> None:
    errors: list[ServerError] = []
    core: ClientCore[queue.Queue[Any], Future[Any]] = ClientCore(queue.Queue, errors.append)
    asked = core.expect(5, Future(), protocol.Stats)
    core.route(protocol.encode(protocol.Saved(req=5, session="s", snapshot="x" * 22, chunk=0, bytes=1, files=1,
                                              pause_s=0.0, write_s=0.0, wait_s=0.0)))
    with pytest.raises(ServerError, match="'saved' answered request 5, which takes 'stats_reply'") as refused:
        asked.result(timeout=0)
    assert refused.value.code == "bad_reply"
    stats = ServerStats(uptime_s=2.0, open_sessions=0)
    again = core.expect(6, Future(), protocol.Stats)
    core.route(protocol.encode(protocol.StatsReply(req=6, stats=stats)))
    assert again.result(timeout=0).stats.uptime_s == 2.0
