"""``ClientCore``'s plans without any transport: each test plays the transport, answering the steps a plan asks for
(``Ask``, ``Start``, ``Tell``, ``Pause``, ``NextEvent``) by hand, with a clock it moves itself. What a plan decides
here is what ``Client`` and ``AsyncClient`` both do, since they only perform the steps."""

from __future__ import annotations

import queue
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

from ipc import protocol
from ipc.client import (
    BadRequest,
    ChunkResult,
    ClientCore,
    ControlBackpressure,
    Requests,
    ServerGone,
    SessionClosed,
    SessionMigrated,
    UnknownSession,
    chunk_control,
)
from ipc.client_core import Ask, NextEvent, Pause, Running, Start, Tell

W = protocol.ChunkControl(keys=frozenset("w"))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_core(clock: Clock | None = None) -> ClientCore[queue.Queue[Any], Future[Any]]:
    return ClientCore(queue.Queue, lambda error: None, clock=clock or Clock())


def backpressure() -> ControlBackpressure:
    return ControlBackpressure("control_backpressure", "the edge is full", "s", retry_after_s=0.01)


def chunk_of(session: str, index: int) -> ChunkResult:
    control = protocol.ChunkControl()  # the plans never read a chunk's facts
    return ChunkResult(session, index, np.zeros((1, 2, 2, 3), np.uint8), control, None, 0.0)  # type: ignore[arg-type]


def closed(session: str) -> protocol.Closed:
    return protocol.Closed(session=session, reason="client_closed")


def test_a_backpressured_control_is_asked_again_as_a_new_request_after_the_servers_hint_until_accepted() -> None:
    clock = Clock()
    running = Running(make_core(clock).control("s", 3, W, True, None, timeout_s=5.0))
    first = running.step
    assert isinstance(first, Ask) and first.message.index == 3 and first.timeout_s == 5.0
    running.answer(None, backpressure())
    assert running.step == Pause(0.01)
    clock.now = 1.0
    running.answer(None)
    again = running.step
    assert isinstance(again, Ask) and again.message.req != first.message.req and again.timeout_s == 4.0
    running.answer(protocol.Accepted(req=again.message.req, session="s", index=3))
    assert running.done and running.result is None


def test_a_control_still_backpressured_past_the_timeout_raises_the_servers_error() -> None:
    clock = Clock()
    running = Running(make_core(clock).control("s", 0, protocol.ChunkControl(), True, None, timeout_s=1.0))
    clock.now = 1.5
    with pytest.raises(ControlBackpressure):
        running.answer(None, backpressure())


def test_an_unwaited_control_is_told_once_and_an_invalid_one_raises_before_any_step() -> None:
    running = Running(make_core().control("s", 0, W, False, None, timeout_s=1.0))
    assert isinstance(running.step, Tell)
    running.answer(None)
    assert running.done
    with pytest.raises(BadRequest):
        chunk_control(keys="q")  # the keyword form is checked as it is built, before any plan runs
    with pytest.raises(BadRequest):
        Running(make_core().control("s", 0, W, True, 3, timeout_s=1.0))


def test_the_keyword_form_of_a_control_is_sugar_for_the_value_and_the_two_do_not_mix() -> None:
    """``client.control(sid, i, keys="Wd", mouse=(1, 2))`` sends the bytes ``control(sid, i, ChunkControl(...))``
    sends: one request builder, the keyword form built in one place (``chunk_control``)."""
    value = protocol.ChunkControl(keys=frozenset("wd"), mouse=(1.0, 2.0))
    assert chunk_control(keys="Wd", mouse=(1, 2)) == value and chunk_control(value) is value
    sugar, plain = Requests(), Requests()
    assert protocol.encode(sugar.control("s", 0, chunk_control(keys=["W", "d"], mouse=(1, 2)))) == \
        protocol.encode(plain.control("s", 0, value))
    with pytest.raises(BadRequest, match="not both"):
        chunk_control(value, "s", keys="w")


def test_close_waits_for_the_sessions_closed_and_forgets_its_request() -> None:
    core = make_core()
    running = Running(core.until_closed(core.requests.close("s"), timeout_s=5.0))
    start = running.step
    assert isinstance(start, Start)
    pending: Future[Any] = core.expect(start.message.req, Future(), type(start.message))
    running.answer(pending)
    assert running.step == NextEvent("s", 0.05)
    running.answer(chunk_of("s", 0))  # chunks before the closed are discarded
    running.answer(closed("s"))
    assert running.done and running.result.reason == "client_closed"
    assert pending.cancelled()  # no reply came: nobody waits for it any more


def test_a_refused_close_raises_its_error_but_a_close_of_a_closing_session_waits_for_the_closed() -> None:
    core = make_core()
    running = Running(core.until_closed(core.requests.close("s"), timeout_s=5.0))
    pending: Future[Any] = Future()
    running.answer(pending)
    pending.set_exception(UnknownSession("unknown_session", "no such session", "s"))
    with pytest.raises(UnknownSession):
        running.answer(None, NextEvent("s", 0.05).late())
    running = Running(core.until_closed(core.requests.close("t"), timeout_s=5.0))
    pending = Future()
    running.answer(pending)
    pending.set_exception(UnknownSession("closing", "the session is closing", "t"))
    running.answer(None, NextEvent("t", 0.05).late())
    running.answer(closed("t"))
    assert running.done


def test_waiting_for_a_closed_ends_with_server_gone_when_the_server_is_silent_and_with_a_timeout_otherwise() -> None:
    clock = Clock()
    core = make_core(clock)
    running = Running(core.wait_closed("s", timeout_s=1.0))
    clock.now = 0.5
    running.answer(None, NextEvent("s", 0.05).late())  # the server still talks: wait on
    clock.now = 1.2
    with pytest.raises(TimeoutError, match=r"not closed within 1\.0 s"):
        running.answer(None, NextEvent("s", 0.05).late())
    core.check_server(silent_after_s=0.5)
    running = Running(core.wait_closed("s", timeout_s=1.0))
    with pytest.raises(ServerGone):
        running.answer(None, NextEvent("s", 0.05).late())


def test_chunks_hand_a_migration_on_and_end_at_the_closed() -> None:
    core = make_core()
    moved = SessionMigrated("migrated", "moved", "s")
    outcomes: list[Any] = []
    for event in (chunk_of("s", 0), moved, closed("s")):
        running = Running(core.streamed("s", timeout_s=1.0))
        running.answer(event)
        outcomes.append(running.result)
    assert isinstance(outcomes[0], ChunkResult) and outcomes[1] is moved and outcomes[2] is None
    core.route(protocol.encode(closed("s")))
    core.session("s").events.get_nowait()  # read: the session ended and nothing is left
    with pytest.raises(SessionClosed):  # so no step is asked for
        Running(core.next_chunk("s", timeout_s=1.0))


def test_watching_again_forgets_the_closed_of_the_earlier_watch() -> None:
    core = make_core()
    core.route(protocol.encode(closed("s")))
    running = Running(core.watch("s", "token", timeout_s=2.0))
    assert isinstance(running.step, Ask) and running.step.message.token == "token"
    assert core.session("s").closed is None
