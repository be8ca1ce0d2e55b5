"""``ipc.outgoing``: live input is a state, not a queue (a flood keeps only the newest unsent state, never refused),
and the requests one client has in flight are bounded. The socket tests use real DEALERs and a ROUTER on loopback."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq

from ipc import protocol
from ipc.aio_client import AsyncClient
from ipc.client import Client, OutboxFull, input_state, outbox_room
from ipc.outgoing import InFlight, Outgoing

FLOOD = 3000  # live states, as the page of issue 33 (9) sent


def outbox(limit: int = 4) -> Outgoing:
    return Outgoing(limit, lambda waiting: outbox_room(waiting, limit, "test"))


def drain(out: Outgoing) -> list[bytes]:
    sent = []
    while (item := out.peek()) is not None:
        out.sent(item)
        sent.append(item[0])
    return sent


def test_a_newer_state_replaces_the_unsent_one_and_keeps_its_place() -> None:
    out = outbox()
    out.put(b"open")
    out.put_state("s", b"state 1", ("s", 1))
    out.put(b"close")  # queued after the first state: the newest state still goes before it
    out.put_state("s", b"state 2", ("s", 2))
    out.put_state("t", b"other 1", ("t", 1))
    assert drain(out) == [b"open", b"state 2", b"close", b"other 1"]
    assert out.replaced == 1


def test_a_state_that_arrives_while_the_last_one_is_being_sent_goes_next() -> None:
    out = outbox()
    out.put_state("s", b"state 1")
    item = out.peek()
    out.put_state("s", b"state 2")  # from another thread, while the writer sends state 1
    assert item is not None
    out.sent(item)
    assert drain(out) == [b"state 2"]


def test_states_are_never_refused_but_other_messages_are_at_the_limit() -> None:
    out = outbox(limit=2)
    out.put(b"a")
    out.put(b"b")
    for revision in range(FLOOD):
        out.put_state("s", f"state {revision}".encode())
    with pytest.raises(OutboxFull):
        out.put(b"c")
    out.put(b"beat", own=True)  # the client's own messages are never refused
    assert drain(out) == [b"a", b"b", f"state {FLOOD - 1}".encode(), b"beat"]


def test_in_flight_requests_are_bounded_and_a_slot_frees_when_one_leaves() -> None:
    window = InFlight(limit=2)
    window.enter(1, 0)
    window.enter(2, 0)
    with pytest.raises(TimeoutError, match="2 requests of this client waited"):
        window.enter(3, 0.01)
    threading.Timer(0.05, window.leave, args=(1,)).start()
    window.enter(3, 5.0)
    window.leave(2)
    window.leave(2)  # idempotent: a request answered and then forgotten frees one slot
    assert len(window) == 1


def unanswered_endpoint() -> tuple[str, int]:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sock.close(linger=0)
    return f"tcp://127.0.0.1:{port}", port


def received_states(port: int, timeout_s: float = 10.0) -> list[int]:
    """Bind a ROUTER where the client sends, and read the revisions of the live states that arrive."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://127.0.0.1:{port}")
    revisions: list[int] = []
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and (not revisions or revisions[-1] < FLOOD):
            if sock.poll(100):
                _, data = sock.recv_multipart()
                message = protocol.decode(data, "client")
                if isinstance(message, protocol.ControlState):
                    revisions.append(message.revision)
    finally:
        sock.close()
    return revisions


def test_a_flood_of_live_states_to_a_server_not_taking_them_delivers_the_newest_and_is_never_refused() -> None:
    endpoint, port = unanswered_endpoint()
    with Client(endpoint, heartbeat_s=0, max_outbox=8) as client:
        for revision in range(1, FLOOD + 1):  # would raise OutboxFull once the socket's queue and outbox were full
            client.control_state("s", input_state("w", revision))
        revisions = received_states(port)
    assert revisions[-1] == FLOOD  # the newest state arrives
    assert revisions == sorted(revisions) and len(revisions) < FLOOD  # in order; the unsent ones were replaced


def test_a_flood_of_live_states_from_the_async_client_delivers_the_newest_and_is_never_refused() -> None:
    endpoint, port = unanswered_endpoint()

    async def scenario() -> list[int]:
        async with AsyncClient(endpoint, heartbeat_s=0, max_outbox=8) as client:
            for revision in range(1, FLOOD + 1):
                client.control_state("s", input_state("w", revision))
            return await asyncio.to_thread(received_states, port)

    revisions = asyncio.run(scenario())
    assert revisions[-1] == FLOOD and revisions == sorted(revisions)


def test_many_threads_of_one_client_never_have_more_than_max_in_flight_requests_at_the_server() -> None:
    server = zmq.Context.instance().socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    answers: list[BaseException] = []
    with Client(f"tcp://127.0.0.1:{port}", heartbeat_s=0, timeout_s=30, max_in_flight=4) as client:

        def ask() -> None:
            try:
                client.stats()
            except Exception as error:  # the answer this server gives: an error
                answers.append(error)

        threads = [threading.Thread(target=ask) for _ in range(16)]
        for thread in threads:
            thread.start()
        most = 0
        while len(answers) < 16:
            waiting = []  # what reached the server before it answers anything: at most max_in_flight
            while server.poll(200):
                waiting.append(server.recv_multipart())
            most = max(most, len(waiting))
            for who, data in waiting:
                req = protocol.decode(data, "client").req
                server.send_multipart([who, protocol.encode(protocol.Error(req=req, code="busy", message="x"))])
        for thread in threads:
            thread.join(5)
    server.close()
    assert most == 4 and all(getattr(a, "code", None) == "busy" for a in answers)
