"""What the SDK keeps of a server's messages is bounded (``ipc.client_bounds``), whatever the server sends: an
error's text is clipped, and sessions only the server named keep a bounded state. Played on ``ClientCore`` (the
sans-io half both SDKs share) and once through a real ``Client`` on loopback."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any

import zmq

from ipc import protocol as p
from ipc.client import Client, ClientCore, ServerError, UnknownSession
from ipc.client_bounds import MAX_ERROR_CHARS, MAX_STRAY_SESSIONS
from tests.router_fleet import chunk, opened

TEN_MB = 10 * 2**20


def core() -> tuple[ClientCore[queue.Queue[Any], Future[Any]], list[ServerError]]:
    errors: list[ServerError] = []
    return ClientCore(queue.Queue, errors.append, clock=lambda: 0.0), errors


def test_a_10_mb_error_from_the_server_reaches_the_caller_clipped_with_its_code_and_length() -> None:
    c, errors = core()
    pending: Future[Any] = c.expect(7, Future())
    c.route(p.encode(p.Error(req=7, code="failed", message="x" * TEN_MB)))
    c.route(p.encode(p.Error(code="unknown_session" + "y" * TEN_MB, message="z" * TEN_MB)))
    answered = pending.exception()
    assert isinstance(answered, ServerError) and answered.code == "failed"
    for error in (answered, errors[0]):
        assert len(error.message) < MAX_ERROR_CHARS + 100 and str(TEN_MB - MAX_ERROR_CHARS) in error.message
        assert len(str(error)) < 2 * MAX_ERROR_CHARS + 200
    assert errors[0].code.startswith("unknown_session") and not isinstance(errors[0], UnknownSession)


def test_messages_naming_sessions_the_caller_never_asked_for_keep_a_bounded_state_and_never_evict_its_own() -> None:
    c, errors = core()
    c.session("0000000000aa")  # one the caller reads
    c.expect(1, Future())
    c.route(p.encode(opened(1, "0000000000bb")))  # one the caller opened: its chunks come before it reads them
    c.route(p.encode(chunk("0000000000bb", 0)))
    for n in range(5000):
        sid = f"f{n:011x}"  # none of them the two above
        message = (chunk(sid, 0), p.Closed(session=sid, reason="client"), p.Missed(session=sid, chunks=1, total=1),
                   p.Migrated(session=sid, chunk=1, replica="r"), p.Error(session=sid, code="failed", message="-"))
        c.route(p.encode(message[n % 5]))
    assert len(c._sessions) <= MAX_STRAY_SESSIONS + 2
    assert c.session("0000000000bb").events.get_nowait().index == 0
    c.route(p.encode(chunk("0000000000aa", 3)))
    assert c.session("0000000000aa").events.get_nowait().index == 3
    c.route(p.encode(p.Closed(session="s" * 5000, reason="client")))  # not a session id at all: no state for it
    assert errors[-1].code == "bad_reply" and "s" * 5000 not in c._sessions


def test_a_real_client_answered_a_10_mb_error_raises_it_clipped_and_reads_on() -> None:
    with zmq.Context() as context, context.socket(zmq.ROUTER) as server:  # a server on loopback, played here
        port = server.bind_to_random_port("tcp://127.0.0.1")
        with Client(f"tcp://127.0.0.1:{port}", identity=b"player", timeout_s=10) as client:
            asked: Future[Any] = Future()

            def answer() -> None:
                while True:
                    assert server.poll(10_000)
                    who, data = server.recv_multipart()
                    message = p.decode(data, "client")
                    if isinstance(message, p.Stats):
                        server.send_multipart([who, p.encode(p.Error(req=message.req, code="failed",
                                                                     message="x" * TEN_MB))])
                        asked.set_result(message.req)
                        return

            thread = threading.Thread(target=answer, daemon=True)
            thread.start()
            try:
                client.stats()
            except ServerError as error:
                assert error.code == "failed" and len(error.message) < MAX_ERROR_CHARS + 100
            else:
                raise AssertionError("the error was not raised")
            thread.join(10)
            assert asked.done()
