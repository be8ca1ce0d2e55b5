"""The Python clients without a server: live input bookkeeping, input-to-photon, error typing, and routing of
replies checked against a fake coordinator (a bare ROUTER socket in the test) for the blocking and asyncio
clients; plus the pure parts of the live record/replay tool."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from ipc import protocol
from ipc.aio_client import AsyncClient
from ipc.client import (
    BadRequest,
    Busy,
    ChunkResult,
    Client,
    ClientCore,
    ControlBackpressure,
    InputToPhoton,
    LiveInput,
    OutboxFull,
    RejectedControl,
    Requests,
    ServerError,
    ServerGone,
    SessionFailed,
    StaleRevision,
    UnknownSession,
    input_state,
)
from ipc.metrics_types import ServerStats
from scripts.client import applied_trace, check_timeline, frame_hashes, intrinsics_of, photon_stats

# ------------------------------------------------------------------------------------------------ LiveInput


class Sink:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def control_state(self, session: str, state: protocol.InputState) -> None:
        self.sent.append({"session": session, "keys": state.keys, "revision": state.revision, "mouse": state.mouse,
                          "taps": state.taps})


def test_live_input_sends_the_whole_state_with_strictly_increasing_revisions_only_on_change() -> None:
    sink = Sink()
    live = LiveInput(sink, "s1")
    assert live.press("w") == 1
    assert live.press("W") is None  # already held: nothing changed, nothing sent
    assert live.press("d") == 2
    assert live.tap("i") == 3
    assert live.move(2.5, -1.0) == 4
    assert live.release("w") == 5
    assert live.release("w") is None
    assert live.reset() == 6
    assert live.reset() is None
    assert [m["revision"] for m in sink.sent] == [1, 2, 3, 4, 5, 6]
    assert [m["keys"] for m in sink.sent] == [["w"], ["d", "w"], ["d", "w"], ["d", "w"], ["d"], []]
    assert [m["taps"] for m in sink.sent] == [[], [], ["i"], [], [], []]  # a tap travels once, keys stay held
    assert [m["mouse"] for m in sink.sent] == [(0.0, 0.0)] * 3 + [(2.5, -1.0)] + [(0.0, 0.0)] * 2
    assert {m["session"] for m in sink.sent} == {"s1"}


def test_live_input_set_takes_key_strings_and_a_first_revision() -> None:
    sink = Sink()
    live = LiveInput(sink, "s", first_revision=10)
    assert live.set("Wd", taps="k") == 10
    assert live.set(["w", "d"]) is None
    assert sink.sent[0]["keys"] == ["d", "w"] and sink.sent[0]["taps"] == ["k"]
    with pytest.raises(ValueError):
        LiveInput(sink, "s", first_revision=-1)


# ------------------------------------------------------------------------------------------------ input-to-photon


def test_input_to_photon_counts_each_revision_once_at_the_first_chunk_that_shows_it() -> None:
    clock = InputToPhoton()
    clock.sent(1, at=10.0)
    clock.sent(2, at=10.1)
    clock.sent(3, at=10.2)
    assert clock.shown(-1, at=10.3) == {}  # a chunk cut before any input shows none
    assert clock.shown(2, at=10.5) == pytest.approx({1: 0.5, 2: 0.4})
    assert clock.shown(2, at=10.6) == {}  # already shown: not counted twice
    assert clock.shown(5, at=11.0) == pytest.approx({3: 0.8})


def test_input_to_photon_forgets_the_oldest_unshown_revisions_beyond_its_bound() -> None:
    clock = InputToPhoton(keep=2)
    for r in range(5):
        clock.sent(r, at=float(r))
    assert sorted(clock.shown(10, at=10.0)) == [3, 4]


# ------------------------------------------------------------------------------------------------ error typing


@pytest.mark.parametrize(("code", "cls"), [
    ("busy", Busy), ("unknown_session", UnknownSession), ("rejected_control", RejectedControl),
    ("control_backpressure", ControlBackpressure), ("bad_image", BadRequest), ("bad_request", BadRequest),
    ("stale_revision", StaleRevision), ("failed", SessionFailed), ("rank_failed", ServerGone),
    ("shutdown", ServerGone), ("something_new", ServerError),
])
def test_every_server_code_maps_to_its_typed_error_which_stays_a_server_error(code: str, cls: type) -> None:
    error = ServerError.from_wire(protocol.Error(req=3, session="s", code=code, message="why", retry_after_s=1.5))
    assert type(error) is cls and isinstance(error, ServerError)
    assert (error.code, error.message, error.session, error.retry_after_s, error.req) == (code, "why", "s", 1.5, 3)
    assert str(error) == f"{code}: why"


def test_backpressure_is_a_rejected_control_and_stale_revision_a_bad_request() -> None:
    assert issubclass(ControlBackpressure, RejectedControl) and issubclass(StaleRevision, BadRequest)


# ------------------------------------------------------------------------------------------------ fake coordinator


class FakeServer:
    """A ROUTER socket that plays the coordinator for one test, driven step by step."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"

    def recv(self, kind: type, timeout_s: float = 5.0) -> tuple[bytes, Any]:
        """The next client message of ``kind`` (heartbeats and others skipped)."""
        while self.sock.poll(int(timeout_s * 1000)):
            identity, data = self.sock.recv_multipart()
            message = protocol.decode(data, "client")
            if isinstance(message, kind):
                return identity, message
        raise AssertionError(f"no {kind.__name__} from the client")

    def send(self, identity: bytes, message: Any) -> None:
        self.sock.send_multipart([identity, protocol.encode(message)])


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    server = FakeServer()
    yield server
    server.sock.close()


def chunk(session: str, index: int, revision: int) -> protocol.Chunk:
    frames = np.full((1, 2, 2, 3), index, dtype=np.uint8)
    times = protocol.ChunkTimes(None, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    facts = protocol.ChunkFacts(index, 1, protocol.ChunkControl(keys=frozenset("w"), revision=revision), times)
    return protocol.Chunk(session=session, frames=frames.tobytes(), shape=(1, 2, 2, 3), facts=facts)


def raised_in_thread(call: Any) -> tuple[threading.Thread, list[BaseException]]:
    """Run a blocking client call in a thread (the fake server answers from the test); collect what it raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as error:
            raised.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, raised


def test_client_raises_the_typed_error_of_the_reply_to_its_request(fake: FakeServer) -> None:
    with Client(fake.endpoint, timeout_s=5) as client:
        thread, raised = raised_in_thread(client.stats)
        identity, stats = fake.recv(protocol.Stats)
        fake.send(identity, protocol.Error(req=stats.req, code="busy", message="full", retry_after_s=5.0))
        thread.join(timeout=5)
    assert len(raised) == 1 and isinstance(raised[0], Busy)
    assert raised[0].retry_after_s == 5.0 and raised[0].req == stats.req


def test_a_rejected_live_state_surfaces_via_error_without_ending_the_chunk_stream(fake: FakeServer) -> None:
    with Client(fake.endpoint, timeout_s=5) as client:
        live = client.live("s1")
        live.press("w")
        identity, state = fake.recv(protocol.ControlState)
        assert (state.keys, state.revision, state.session) == (["w"], 1, "s1")
        fake.send(identity, protocol.Error(req=state.req, session="s1", code="stale_revision", message="old"))
        fake.send(identity, chunk("s1", 0, revision=1))
        fake.send(identity, protocol.Closed(session="s1", reason="complete"))
        error = client.error(timeout_s=5)
        received = list(client.chunks("s1", timeout_s=5))
    assert isinstance(error, StaleRevision) and error.session == "s1"
    assert [c.index for c in received] == [0] and received[0].revision == 1
    assert list(received[0].input_to_photon_s) == [1] and received[0].input_to_photon_s[1] >= 0


def test_a_session_failure_ends_its_chunk_stream_with_the_typed_error(fake: FakeServer) -> None:
    with Client(fake.endpoint, timeout_s=5) as client:
        client.live("s2").press("a")
        identity, _ = fake.recv(protocol.ControlState)
        fake.send(identity, protocol.Error(session="s2", code="failed", message="decode exploded"))
        with pytest.raises(SessionFailed, match="decode exploded"):
            client.next_chunk("s2", timeout_s=5)


def test_an_invalid_control_is_refused_before_it_is_sent_and_a_valid_one_travels_typed(fake: FakeServer) -> None:
    with Client(fake.endpoint, timeout_s=5) as client:
        with pytest.raises(BadRequest, match="unknown keys") as refused:
            client.control("s", 0, keys="wq")
        assert refused.value.code == "bad_control"
        client.control("s", 0, keys="Wd", mouse=(1, 2), wait=False)
        _, sent = fake.recv(protocol.Control)
    assert (sent.index, sent.control) == (0, protocol.ChunkControl(keys=frozenset("wd"), mouse=(1.0, 2.0)))


def test_close_of_a_session_the_server_does_not_hold_raises_unknown_session(fake: FakeServer) -> None:
    with Client(fake.endpoint, timeout_s=5) as client:
        thread, raised = raised_in_thread(lambda: client.close("gone"))
        identity, message = fake.recv(protocol.Close)
        fake.send(identity, protocol.Error(req=message.req, session="gone", code="unknown_session", message="no"))
        thread.join(timeout=5)
    assert len(raised) == 1 and isinstance(raised[0], UnknownSession)


def test_a_silent_server_fails_waiting_calls_with_server_gone_and_close_does_not_wait_out_its_timeout(
        fake: FakeServer) -> None:
    with Client(fake.endpoint, timeout_s=30, heartbeat_s=0.1, server_silent_s=0.5) as client:
        thread, raised = raised_in_thread(client.stats)  # the fake never answers, not even heartbeats
        thread.join(timeout=10)
        assert len(raised) == 1 and isinstance(raised[0], ServerGone) and raised[0].code == "server_gone"
        with pytest.raises(ServerGone):
            client.close("s1", timeout_s=20)


def test_a_restarted_server_ends_the_old_sessions_and_still_answers_new_requests(fake: FakeServer) -> None:
    with Client(fake.endpoint, timeout_s=10, heartbeat_s=0.1, server_silent_s=30) as client:
        identity, _ = fake.recv(protocol.Heartbeat)
        fake.send(identity, protocol.HeartbeatAck(server="run-1"))
        fake.send(identity, chunk("s1", 0, revision=-1))
        assert client.next_chunk("s1", timeout_s=5).index == 0
        thread, raised = raised_in_thread(client.stats)
        _, stats = fake.recv(protocol.Stats)
        fake.send(identity, protocol.HeartbeatAck(server="run-2"))  # the restarted server, which got the request
        fake.send(identity, protocol.StatsReply(req=stats.req, stats=ServerStats(uptime_s=1.0, open_sessions=0)))
        thread.join(timeout=5)
        assert not raised  # answered by the new run: not failed as lost
        with pytest.raises(ServerGone, match="restarted"):
            client.next_chunk("s1", timeout_s=5)


def test_an_open_answered_after_its_caller_gave_up_is_closed_not_leaked(fake: FakeServer) -> None:
    with Client(fake.endpoint, timeout_s=0.3) as client:
        with pytest.raises(TimeoutError):
            client.open(b"png")
        identity, opening = fake.recv(protocol.Open)
        fake.send(identity, protocol.Opened(req=opening.req, session="late", height=1, width=1, fps=16.0,
                                            frames_first_chunk=1, frames_per_chunk=4, num_chunks=None))
        _, close = fake.recv(protocol.Close)
    assert close.session == "late"


def test_async_client_has_the_same_api_shape_and_error_typing(fake: FakeServer) -> None:
    async def scenario() -> tuple[Any, ...]:
        async with AsyncClient(fake.endpoint, timeout_s=5, heartbeat_s=0.1) as client:
            loop = asyncio.get_running_loop()
            opening = asyncio.ensure_future(client.open(b"png", live=True))
            identity, open_ = await loop.run_in_executor(None, fake.recv, protocol.Open)
            fake.send(identity, protocol.Opened(req=open_.req, session="a1", height=2, width=2, fps=16.0,
                                                frames_first_chunk=1, frames_per_chunk=1, num_chunks=2))
            info = await opening
            client.live(info.id).press("w")
            _, state = await loop.run_in_executor(None, fake.recv, protocol.ControlState)
            fake.send(identity, protocol.Error(req=state.req, session="a1", code="stale_revision", message="x"))
            for i in range(2):
                fake.send(identity, chunk("a1", i, revision=1))
            fake.send(identity, protocol.Closed(session="a1", reason="complete"))
            received = [c async for c in client.chunks("a1", timeout_s=5)]
            error = await client.error(timeout_s=5)
            asking = asyncio.ensure_future(client.stats())
            _, stats = await loop.run_in_executor(None, fake.recv, protocol.Stats)
            fake.send(identity, protocol.Error(req=stats.req, code="busy", message="full", retry_after_s=2.0))
            with pytest.raises(Busy) as busy:
                await asking
            _, beat = await loop.run_in_executor(None, fake.recv, protocol.Heartbeat)  # heartbeats flow
            return info, state, received, error, busy.value, beat

    info, state, received, error, busy, beat = asyncio.run(scenario())
    assert info.id == "a1" and state.keys == ["w"] and state.revision == 1
    assert [c.index for c in received] == [0, 1] and all(isinstance(c, ChunkResult) for c in received)
    assert list(received[0].input_to_photon_s) == [1] and received[1].input_to_photon_s == {}
    assert isinstance(error, StaleRevision) and busy.retry_after_s == 2.0 and beat.session is None


# ------------------------------------------------------------------------------------------------ bounded outboxes


def unanswered_endpoint() -> str:
    """A loopback port nobody listens on: what a client sends there stays queued on its side."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sock.close(linger=0)
    return f"tcp://127.0.0.1:{port}"


def test_requests_are_built_once_for_both_clients_with_fresh_ids_and_checked_before_sending() -> None:
    requests = Requests()
    built = [requests.open(b"png", live=True), requests.control("s", 0, protocol.ChunkControl()),
             requests.control_state("s", input_state(["W", "d"], 3, mouse=(1, 2), taps="i")), requests.close("s"),
             requests.stats(), requests.resume("s")]
    assert [m.req for m in built] == [1, 2, 3, 4, 5, 6]
    state = built[2]
    assert (state.keys, state.mouse, state.taps, state.revision) == (["d", "w"], (1.0, 2.0), ["i"], 3)
    assert built[5].session == "s"
    with pytest.raises(BadRequest):
        requests.open(b"png", intrinsics=(1.0, 2.0))


def test_a_live_input_the_outbox_refused_is_not_counted_as_sent() -> None:
    class Refusing:
        def control_state(self, *args: Any, **kwargs: Any) -> None:
            raise OutboxFull("outbox_full", "full")

    keys = LiveInput(Refusing(), "s")
    with pytest.raises(OutboxFull):
        keys.press("w")
    assert keys.held == frozenset() and keys.revision == 0  # the next press sends w again, as revision 1


def test_the_blocking_clients_outbox_is_bounded_and_a_full_one_refuses_with_outbox_full() -> None:
    with Client(unanswered_endpoint(), timeout_s=5, heartbeat_s=0.05, server_silent_s=0.3, max_outbox=8) as client:
        accepted, refused, until = 0, None, time.monotonic() + 1.0
        while time.monotonic() < until:  # a caller that keeps sending to a server that is not there
            try:
                client.control("s", accepted, keys="w", wait=False)
                accepted += 1
            except OutboxFull as error:
                refused = error
                time.sleep(0.002)
        # the socket's own queue took about 1000 (its high-water mark), the outbox 8, and then nothing more
        assert refused is not None and refused.code == "outbox_full" and isinstance(refused, ServerError)
        assert 500 < accepted <= 1000 + 8
        with pytest.raises(OutboxFull, match="messages already wait to be sent"):
            client.stats()  # refused at once, not a wait for a reply
        gone = client.error(timeout_s=5)  # the I/O thread never blocks on the full socket: it still finds the
        while gone is not None and gone.code != "server_gone":  # server silent
            gone = client.error(timeout_s=5)
        assert isinstance(gone, ServerGone)


def test_the_async_clients_outbox_is_bounded_and_a_full_one_refuses_with_outbox_full() -> None:
    async def scenario() -> tuple[int, BaseException]:
        async with AsyncClient(unanswered_endpoint(), timeout_s=5, heartbeat_s=0.05, max_outbox=8) as client:
            sent = 0
            with pytest.raises(OutboxFull):
                for index in range(100):
                    await client.control("s", index, keys="w", wait=False)
                    sent += 1
            with pytest.raises(OutboxFull) as refused:
                await client.stats()
            return sent, refused.value

    sent, refused = asyncio.run(scenario())
    assert sent == 8 and refused.code == "outbox_full"


# ------------------------------------------------------------------------------------------------ record/replay tool


def test_applied_trace_turns_recorded_snapshots_into_indexed_controls_in_chunk_order() -> None:
    recorded = {"prompt": "p", "seed": 3, "intrinsics": [520.0, 520.0, 416.0, 240.0], "applied": [
        {"index": 1, "control": {"keys": ["d", "i"], "mouse": [1.5, 0.0], "revision": 4}},
        {"index": 0, "control": {"keys": [], "mouse": [0.0, 0.0], "revision": -1}},
    ]}
    trace = applied_trace(recorded)
    assert trace == {"prompt": "p", "seed": 3, "intrinsics": [520.0, 520.0, 416.0, 240.0], "chunks": [
        {"keys": "", "mouse": [0.0, 0.0]}, {"keys": "di", "mouse": [1.5, 0.0]}]}
    assert intrinsics_of(trace) == (520.0, 520.0, 416.0, 240.0) and intrinsics_of({}) is None  # the replay's camera
    with pytest.raises(ValueError, match=r"0\.\.n-1"):
        applied_trace({"applied": [{"index": 1, "control": {}}]})


def test_applied_trace_of_a_restored_session_restores_it_and_repeats_its_prompt_steps_and_saves() -> None:
    control = {"keys": ["w"], "mouse": [0.0, 0.0], "revision": 1}
    recorded = {"restore": "s" * 22, "first_chunk": 3, "saves": [{"chunk": 4, "snapshot": "x" * 22}],
                "events": [{"t": 0.1, "prompt": "snow", "prompt_revision": 2, "chunk": 5}], "applied": [
                    {"index": 3, "control": control, "prompt_revision": 1, "steps": 4},
                    {"index": 4, "control": control, "prompt_revision": 1, "steps": 2},
                    {"index": 5, "control": control, "prompt_revision": 2, "steps": 2}]}
    trace = applied_trace(recorded)
    # revision 1 is the snapshot's (no change of this recording): only revision 2 is a change, at chunk 5
    assert trace["restore"] == "s" * 22 and trace["prompts"] == [{"chunk": 5, "prompt": "snow"}]
    assert [c.get("steps") for c in trace["chunks"]] == [4, 2, None] and trace["saves"] == [4]
    with pytest.raises(ValueError, match=r"3\.\.n-1"):
        applied_trace({**recorded, "applied": recorded["applied"][1:]})


def test_timelines_need_ordered_event_times() -> None:
    check_timeline({"num_chunks": 4, "events": [{"t": 0.0, "keys": "w"}, {"t": 0.5}]})
    with pytest.raises(ValueError, match="event 1"):
        check_timeline({"num_chunks": 4, "events": [{"t": 0.5}, {"t": 0.1}]})
    with pytest.raises(ValueError, match="endless"):
        check_timeline({"events": []})


def test_frame_hashes_and_photon_stats() -> None:
    def result(value: int, photon: dict[int, float]) -> ChunkResult:
        facts = protocol.ChunkFacts(0, 1, protocol.ChunkControl(), protocol.ChunkTimes(None, *[0.0] * 7))
        return ChunkResult("s", 0, np.full((1, 2, 2, 3), value, np.uint8), facts.control, facts, 0.0, photon)

    a, b, c = result(1, {1: 0.2}), result(1, {2: 0.4, 3: 0.1}), result(2, {})
    assert frame_hashes([a])[0] == frame_hashes([b])[0] != frame_hashes([c])[0]
    stats = photon_stats([a, b, c])
    assert stats["count"] == 3 and stats["p50"] == pytest.approx(0.2) and stats["max"] == pytest.approx(0.4)
    assert photon_stats([c])["count"] == 0


def test_an_open_carries_its_camera_a_bad_one_is_refused_before_it_is_sent_and_the_reply_says_which_applies(
        fake: FakeServer) -> None:
    camera, applied = (520.0, 520.0, 416.0, 240.0), (260.0, 260.0, 208.0, 120.0)

    def reply(identity: bytes, opening: protocol.Open, session: str) -> None:
        fake.send(identity, protocol.Opened(req=opening.req, session=session, height=240, width=416, fps=16.0,
                                            frames_first_chunk=9, frames_per_chunk=12, num_chunks=None,
                                            intrinsics=applied))

    with Client(fake.endpoint, timeout_s=5) as client:
        with pytest.raises(BadRequest, match="principal point") as refused:
            client.open(b"png", intrinsics=(520.0, 520.0, 416.0, 481.0))
        assert refused.value.code == "bad_request"
        result: list[Any] = []
        thread = threading.Thread(target=lambda: result.append(client.open(b"png", intrinsics=camera)))
        thread.start()
        identity, opening = fake.recv(protocol.Open)  # the first one never left the client
        reply(identity, opening, "s1")
        thread.join(timeout=5)
    assert opening.intrinsics == camera and result[0].intrinsics == applied

    async def scenario() -> tuple[protocol.Open, Any]:
        async with AsyncClient(fake.endpoint, timeout_s=5) as client:
            with pytest.raises(BadRequest, match="must be finite"):
                await client.open(b"png", intrinsics=(float("nan"), 1.0, 1.0, 1.0))
            opening = asyncio.ensure_future(client.open(b"png", intrinsics=camera))
            identity, sent = await asyncio.get_running_loop().run_in_executor(None, fake.recv, protocol.Open)
            reply(identity, sent, "a1")
            return sent, await opening

    sent, info = asyncio.run(scenario())
    assert sent.intrinsics == camera and info.intrinsics == applied


def test_a_chunk_whose_shape_does_not_match_its_bytes_is_a_bad_reply_and_the_client_reads_on() -> None:
    """A hostile or broken server's chunk (shape 2^63 x 1 x 1 x 3 over 12 bytes, a chunk index past the page's u32)
    is refused on decode: an error for the caller, never a reshape that kills the I/O thread."""
    errors: list[ServerError] = []
    core: ClientCore[queue.Queue[Any], Any] = ClientCore(queue.Queue, errors.append, clock=lambda: 0.0)
    good = chunk("s", 0, revision=1)
    for field, value in (("shape", [2**63 - 1, 1, 1, 3]), ("shape", [-1, 2, 2, 3])):
        raw = msgspec.msgpack.decode(protocol.encode(good))
        raw[field] = value
        core.route(msgspec.msgpack.encode(raw))
    raw = msgspec.msgpack.decode(protocol.encode(good))
    raw["facts"]["index"] = 2**40
    core.route(msgspec.msgpack.encode(raw))
    assert [e.code for e in errors] == ["bad_reply"] * 3
    core.route(protocol.encode(good))
    assert core.session("s").events.get_nowait().index == 0
