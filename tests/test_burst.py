"""Bursts of requests against the shared server (``server.send_hwm=4``): every request is answered, and a burst is
never taken for a client that stopped reading (``ipc.client_lines``)."""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import pytest
import zmq

from ipc import protocol
from ipc.aio_client import AsyncClient
from ipc.client import Client, ServerError, input_state
from scripts.local_server import ROOT, LocalServer
from tests.shared import read_server

pytestmark = pytest.mark.multiprocess

IMAGE = (ROOT / "assets" / "start.png").read_bytes()
BURST = 64  # requests sent back to back, 16 times the server's send_hwm here
THREADS = 32


@pytest.fixture
def server(shared_server: LocalServer) -> LocalServer:
    return shared_server


def enc(**fields: object) -> bytes:
    return msgspec.msgpack.encode({"v": protocol.PROTOCOL_VERSION, **fields})


def read(sock: zmq.Socket, timeout_s: float = 30.0) -> object:
    assert sock.poll(int(timeout_s * 1000)), "no message within the timeout"
    return read_server(sock)


def test_a_burst_of_64_requests_on_one_socket_gets_64_answers_and_its_session_streams_on(server: LocalServer) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    try:
        sock.send(enc(type="open", req=1, image=IMAGE, num_chunks=2))
        opened = read(sock)
        assert isinstance(opened, protocol.Opened), opened
        sid = opened.session
        # the reproduction of issue 33 (2): stats, then a control naming the session, in one burst
        for req in range(100, 100 + BURST - 1):
            sock.send(enc(type="stats", req=req))
        sock.send(enc(type="control", req=99, session=sid, index=0))
        answered: set[int] = set()
        chunks: list[int] = []
        deadline = time.monotonic() + 60
        while (len(answered) < BURST or not chunks) and time.monotonic() < deadline:
            message = read(sock)
            if isinstance(message, protocol.Chunk):
                chunks.append(message.facts.index)
            elif isinstance(message, protocol.StatsReply | protocol.Accepted):
                answered.add(message.req)  # type: ignore[arg-type]
            elif not isinstance(message, protocol.HeartbeatAck):
                raise AssertionError(f"unexpected during the burst: {message}")
            sock.send(enc(type="heartbeat"))  # a reading client is a live one
        assert answered == set(range(99, 100 + BURST - 1)), f"{BURST - len(answered)} requests unanswered"
        assert chunks == [0]
        sock.send(enc(type="control", req=2, session=sid, index=1))  # the session survived the burst: it goes on
        while not isinstance(message := read(sock), protocol.Closed):
            assert not isinstance(message, protocol.Error), message
        assert message.reason == "complete", message
    finally:
        sock.close()


def test_32_threads_of_one_client_each_get_their_answer_and_the_session_survives(server: LocalServer) -> None:
    with Client(server.endpoint, timeout_s=60) as client:
        info = client.open(IMAGE, num_chunks=None, live=True)
        answers: list[object] = []
        start = threading.Barrier(THREADS)

        def ask(i: int) -> None:
            start.wait()
            try:  # answered, either way: a scheduled prompt, or a refusal the caller sees (prompt_backpressure)
                answers.append(client.set_prompt(info.id, f"prompt {i}") if i % 2 else client.stats())
            except ServerError as error:
                answers.append(error)
            except TimeoutError as error:  # the old failure: a dropped reply leaves its caller waiting
                answers.append(error)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
        timeouts = [a for a in answers if isinstance(a, TimeoutError)]
        assert len(answers) == THREADS and not timeouts, f"{len(timeouts)} of {THREADS} calls got no answer"
        refused = [a.code for a in answers if isinstance(a, ServerError)]
        assert set(refused) <= {"prompt_backpressure"}, refused
        client.control_state(info.id, input_state("w", 1))
        client.next_chunk(info.id, 30)  # the session streams on
        assert client.close(info.id, 30) is not None


def test_32_tasks_of_one_async_client_each_get_their_answer_and_the_session_survives(server: LocalServer) -> None:
    async def scenario() -> list[object]:
        async with AsyncClient(server.endpoint, timeout_s=60) as client:
            info = await client.open(IMAGE, num_chunks=None, live=True)

            async def ask(i: int) -> object:
                try:
                    return await (client.set_prompt(info.id, f"prompt {i}") if i % 2 else client.stats())
                except (ServerError, TimeoutError) as error:
                    return error

            answers = await asyncio.gather(*(ask(i) for i in range(THREADS)))
            client.control_state(info.id, input_state("w", 1))
            await client.next_chunk(info.id, 30)  # the session streams on
            assert await client.close(info.id, 30) is not None
            return answers

    answers = asyncio.run(scenario())
    timeouts = [a for a in answers if isinstance(a, TimeoutError)]
    assert not timeouts, f"{len(timeouts)} of {THREADS} calls got no answer"
    assert {a.code for a in answers if isinstance(a, ServerError)} <= {"prompt_backpressure"}
