"""The web gateway's pure parts: the playout policy, page message validation, the chunk adapter, frame encoding
and the bind/host rules. No processes, no sockets (tests/test_web.py runs the real thing)."""

from __future__ import annotations

import asyncio
import io
import json
import re
import struct
from typing import Any

import numpy as np
import pytest
from aiohttp.test_utils import TestServer
from PIL import Image

from ipc import protocol
from ipc.client import ChunkResult, Requests, ServerError, StaleRevision, input_state
from ipc.error_codes import ErrorCode
from runtime.control_service import ControlStateError, LiveControls
from scripts.local_server import ROOT
from web import page_messages as pm
from web import page_protocol as pp
from web.bridge import BridgeSettings, SessionSlots
from web.chunks import chrome_trace, page_chunk
from web.gateway import GatewaySettings, host_name, is_loopback, make_app
from web.playout import Dropped, Playout, encode_frame
from web.tab import connect
from web.tab_tasks import TabTasks

FPS = 16.0
PERIOD = 1 / FPS


def drain(playout: Playout, until: float, step: float = 0.001) -> list[tuple[float, tuple[int, int]]]:
    """Ask the playout every ``step`` seconds (a sender that is never late) up to ``until``."""
    sent, now = [], 0.0
    while now <= until:
        taken = playout.take(now)
        if taken is not None:
            sent.append((now, taken))
        now = round(now + step, 6)
    return sent


# ------------------------------------------------------------------------------------------------ playout


def test_playout_releases_a_chunks_frames_at_the_stream_fps() -> None:
    playout = Playout(FPS)
    playout.push(0, 4, now=0.0)
    sent = drain(playout, 1.0)
    assert [frame for _, frame in sent] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert [t for t, _ in sent] == pytest.approx([0.0, PERIOD, 2 * PERIOD, 3 * PERIOD], abs=0.0011)
    assert playout.dropped == Dropped(superseded=0, late=0)
    assert playout.next_due() is None


def test_a_newer_chunk_supersedes_the_unsent_frames_of_the_older_one_never_the_reverse() -> None:
    playout = Playout(FPS)
    playout.push(0, 12, now=0.0)
    assert playout.take(0.0) == (0, 0)
    assert playout.take(PERIOD) == (0, 1)
    playout.push(1, 12, now=0.1)  # faster than real time: 10 of chunk 0's frames will never be shown
    assert playout.dropped.superseded == 10
    sent = [frame for _, frame in drain(playout, 1.0)]
    assert sent[0] == (1, 0) and all(chunk == 1 for chunk, _ in sent)  # nothing of chunk 0 after chunk 1 began
    assert sent == [(1, k) for k in range(12)]  # the newest chunk plays whole when nothing newer comes
    with pytest.raises(ValueError, match="in order"):
        playout.push(1, 12, now=2.0)


def test_the_page_never_gets_more_than_fps_frames_a_second_when_chunks_outrun_real_time() -> None:
    playout, sent, now, step = Playout(FPS), [], 0.0, 0.001
    for chunk in range(40):  # a chunk every 50 ms: 12 frames each, 15x real time
        playout.push(chunk, 12, now)
        sent += [t for t, _ in drain_between(playout, now, now + 0.05, step)]
        now += 0.05
    rate = len(sent) / now
    tail = [t for t, _ in drain_between(playout, now, now + 1.0, step)]  # the last chunk plays out whole
    gaps = np.diff(sent + tail)
    assert gaps.min() >= PERIOD - step, "two frames closer than one frame period"
    assert rate == pytest.approx(FPS, rel=0.05)
    assert len(sent) + len(tail) + playout.dropped.superseded == 40 * 12  # every frame shown or counted dropped
    assert playout.dropped.late == 0


def drain_between(playout: Playout, start: float, end: float, step: float = 0.001) -> list[tuple[float, object]]:
    sent, now = [], start
    while now < end - 1e-9:
        taken = playout.take(now)
        if taken is not None:
            sent.append((now, taken))
        now = round(now + step, 6)
    return sent


def test_a_late_sender_gets_the_newest_due_frame_and_the_skipped_ones_count_as_late() -> None:
    playout = Playout(FPS)
    playout.push(0, 12, now=0.0)
    assert playout.take(0.0) == (0, 0)
    assert playout.take(5.5 * PERIOD) == (0, 5)  # frames 1..4 are stale by now
    assert playout.dropped.late == 4
    assert playout.take(5.6 * PERIOD) is None
    assert playout.next_due() == pytest.approx(6 * PERIOD)


def test_a_new_chunk_waits_at_most_one_frame_period_after_the_last_frame_sent() -> None:
    playout = Playout(FPS)
    playout.push(0, 12, now=0.0)
    assert playout.take(0.0) == (0, 0)
    playout.push(1, 12, now=0.01)
    assert playout.take(0.01) is None
    assert playout.next_due() == pytest.approx(PERIOD)
    assert playout.take(PERIOD) == (1, 0)


def test_a_cleared_playout_sends_nothing_and_starts_fresh() -> None:
    playout = Playout(FPS)
    playout.push(3, 12, now=0.0)
    playout.clear()
    assert playout.take(1.0) is None and playout.next_due() is None
    playout.push(0, 2, now=2.0)  # a new session starts at chunk 0 again
    assert playout.take(2.0) == (0, 0)


# ------------------------------------------------------------------------------------------------ page messages


def test_a_valid_state_parses_to_its_fields() -> None:
    state = pp.parse_text(json.dumps({"type": "state", "keys": ["w", "d"], "mouse": [1.5, -2], "taps": ["i"],
                                      "revision": 7}))
    assert isinstance(state, pp.StateRequest)
    assert (state.keys, state.mouse, state.taps, state.revision) == (["w", "d"], (1.5, -2.0), ["i"], 7)


@pytest.mark.parametrize(("message", "code", "text"), [
    ("not json", "bad_message", "JSON map"),
    ('{"type": "dance"}', "bad_message", "message type"),
    ('{"keys": []}', "bad_message", "message type"),
    ('{"type": "state", "keys": ["x"], "revision": 1}', "unknown_keys", "unknown keys ['x']"),
    ('{"type": "state", "keys": [], "taps": ["q"], "revision": 1}', "unknown_keys", "taps: unknown keys ['q']"),
    ('{"type": "state", "keys": [], "mouse": [1e999, 0], "revision": 1}', "bad_message", "out of range"),
    ('{"type": "state", "keys": [], "mouse": [400, 0], "revision": 1}', "bad_message", "within"),
    ('{"type": "state", "keys": [], "revision": -1}', "bad_message", "revision must be in 0..2147483647"),
    ('{"type": "state", "keys": [], "revision": 2147483648}', "bad_message", "revision must be in 0.."),
    ('{"type": "state", "keys": [], "revision": %s}' % ("9" * 400), "bad_message", r"got 9+ \.\.\. \(clipped\)"),
    ('{"type": "state", "keys": "w", "revision": 1}', "bad_message", "keys"),
    ('{"type": "state", "keys": [], "revision": 1, "extra": 1}', "bad_message", "extra"),
    ('{"type": "close", "session": "x"}', "bad_message", "session"),
    ('{"type": "save", "session": "x"}', "bad_message", "session"),  # a tab saves its own session, no other
])
def test_invalid_page_messages_raise_a_page_error_naming_the_problem(message: str, code: str, text: str) -> None:
    with pytest.raises(pp.PageError, match=text.replace("[", r"\[").replace("]", r"\]")) as error:
        pp.parse_text(message)
    assert error.value.code == code


def test_text_beyond_the_limit_is_refused_before_decoding() -> None:
    with pytest.raises(pp.PageError) as error:
        pp.parse_text('{"type": "stats"' + " " * pp.MAX_TEXT_BYTES + "}")
    assert error.value.code == "too_large"


def test_the_open_message_carries_the_request_and_the_image() -> None:
    data = pp.open_message({"prompt": "forest", "seed": 3, "num_chunks": 8, "pause_when_idle": True}, b"\x89PNG...")
    request, image = pp.parse_open(data, pp.Limits())
    assert (request.prompt, request.seed, request.num_chunks, request.live, request.pause_when_idle) == \
        ("forest", 3, 8, True, True)
    assert image == b"\x89PNG..."


def test_a_save_message_parses() -> None:
    assert isinstance(pp.parse_text('{"type": "save"}'), pp.SaveRequest)


SNAPSHOT_ID = "AbCdEfGhIjKlMnOpQr_-09"  # the shape of secrets.token_urlsafe(16)


def test_a_fork_opens_from_a_snapshot_id_with_no_image() -> None:
    request, image = pp.parse_open(pp.open_message({"restore": SNAPSHOT_ID, "seed": 3}, b""), pp.Limits())
    assert (request.restore, request.seed, image) == (SNAPSHOT_ID, 3, b"")
    assert pp.parse_open(pp.open_message({}, b"img"), pp.Limits())[0].restore is None  # a plain open restores nothing


@pytest.mark.parametrize(("data", "code", "text"), [
    (b"\x01\x02", "bad_message", "length of its JSON header"),
    (struct.pack("<I", 100) + b"{}", "bad_message", "claims 100 bytes"),
    (struct.pack("<I", pp.MAX_HEADER_BYTES + 1) + b"x" * (pp.MAX_HEADER_BYTES + 2), "bad_message", "at most"),
    (pp.open_message({}, b""), "bad_image", "no start image"),
    (pp.open_message({"live": False}, b"img"), "bad_request", "live sessions only"),
    (pp.open_message({"seed": -1}, b"img"), "bad_request", "seed"),
    (pp.open_message({"seed": 2**60}, b"img"), "bad_request", "seed"),
    (pp.open_message({"num_chunks": 0}, b"img"), "bad_request", "open.num_chunks must be in 1.."),
    (pp.open_message({"num_chunks": 2**64}, b"img"), "bad_request", "open.num_chunks must be in 1.."),
    (pp.open_message({"prompt": 5}, b"img"), "bad_message", "prompt"),
    (struct.pack("<I", 2) + b"[]" + b"img", "bad_message", "invalid open header"),
    (pp.open_message({"restore": SNAPSHOT_ID}, b"img"), "bad_request", "open.restore starts from a snapshot: send no"),
    (pp.open_message({"restore": "../../etc/passwd"}, b""), "bad_request", "open.restore must be a snapshot id"),
    (pp.open_message({"restore": SNAPSHOT_ID + "x"}, b""), "bad_request", "open.restore must be a snapshot id"),
    (pp.open_message({"restore": ""}, b""), "bad_request", "open.restore must be a snapshot id"),
    (pp.open_message({"restore": "x" * 5000}, b""), "bad_request", r"open.restore .* \(clipped\)"),
    (pp.open_message({"restore": 7}, b""), "bad_message", "restore"),
    (pp.open_message({"restore": SNAPSHOT_ID, "seed": -1}, b""), "bad_request", "open.seed"),
])
def test_invalid_open_messages_raise_a_page_error(data: bytes, code: str, text: str) -> None:
    with pytest.raises(pp.PageError, match=text) as error:
        pp.parse_open(data, pp.Limits())
    assert error.value.code == code


def test_an_upload_beyond_the_limit_is_refused_before_decoding() -> None:
    limit = pp.MIN_UPLOAD_BYTES
    with pytest.raises(pp.PageError, match=f"exceeds the limit of {limit} bytes") as error:
        pp.parse_open(pp.open_message({}, b"x" * limit), pp.Limits(max_upload_bytes=limit))
    assert error.value.code == "too_large"


@pytest.mark.parametrize("limit", [0, -1, pp.MIN_UPLOAD_BYTES - 1])
def test_an_upload_limit_of_zero_or_below_a_start_image_is_refused(limit: int) -> None:
    with pytest.raises(ValueError, match="upload limit must be at least"):  # aiohttp would read 0 as no limit
        pp.Limits(max_upload_bytes=limit)


def test_a_frame_message_header_round_trips() -> None:
    data = pp.frame_message("webp", chunk=70000, frame=11, frames=12, revision=-1, picture=b"RIFF")
    assert pp.read_frame(data) == {"kind": pp.FRAME_KIND, "format": 2, "header": 16, "chunk": 70000, "frame": 11,
                                   "frames": 12, "revision": -1}
    assert data[16:] == b"RIFF"


# ------------------------------------------------------------------------------------------------ chunk adapter


TIMES = protocol.ChunkTimes(control_accepted=1.0, condition_submitted=0.5, condition_start=0.55, condition_ready=0.6,
                            denoise_start=1.0, denoise_end=1.2, decode_start=1.2, decode_end=1.3, emitted=1.3)
SPANS = (protocol.Span("denoise", 2, "denoise", 1.0, 1.0, 1.2), protocol.Span("decode", 1, "decode", 1.2, 1.2, 1.3))


def chunk_with(control: protocol.ChunkControl, spans: tuple[protocol.Span, ...] = SPANS) -> ChunkResult:
    facts = protocol.ChunkFacts(index=4, frames=12, control=control, times=TIMES, spans=spans)
    return ChunkResult("s1", 4, np.zeros((12, 8, 8, 3), np.uint8), control, facts, received=5.0,
                       input_to_photon_s={3: 0.25})


def test_the_pages_chunk_message_is_built_from_the_sdks_chunk_result_its_applied_control_and_facts() -> None:
    chunk = chunk_with(protocol.ChunkControl(keys=frozenset("wd"), mouse=(2.0, -1.0), revision=3))
    message = json.loads(pm.encode(page_chunk(chunk, Dropped(superseded=2))))
    assert message == {"type": "chunk", "session": "s1", "index": 4, "frames": 12, "keys": ["d", "w"],
                       "mouse": [2.0, -1.0], "revision": 3, "prompt_revision": 0,
                       "control_to_output_s": pytest.approx(0.3), "steps": 0, "steps_changed": None,
                       "gateway_input_to_photon_s": {"3": 0.25}, "dropped": {"superseded": 2, "late": 0},
                       "missed": 0}


def test_the_trace_of_a_session_has_one_event_per_span_on_each_ranks_track() -> None:
    chunk = chunk_with(protocol.ChunkControl(keys=frozenset("w"), revision=1))
    trace = chrome_trace([(chunk.session, chunk.facts)])
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"].split()[0] in ("denoise", "decode")]
    assert sorted((e["name"], e["pid"]) for e in spans) == [("decode s1#4", 1), ("denoise s1#4", 2)]
    bare = chunk_with(protocol.ChunkControl(), spans=())  # a chunk without spans adds no span events
    assert [e for e in chrome_trace([(bare.session, bare.facts)])["traceEvents"] if e.get("ph") == "X"
            and e["name"].split()[0] in ("denoise", "decode")] == []


# ------------------------------------------------------------------------------------------------ encoding


@pytest.mark.parametrize("fmt", ["jpeg", "webp"])
def test_frames_encode_to_pictures_of_the_same_size(fmt: str) -> None:
    rgb = (np.arange(160 * 256 * 3) % 251).astype(np.uint8).reshape(160, 256, 3)
    picture = Image.open(io.BytesIO(encode_frame(rgb, fmt, 80)))
    assert (picture.format, picture.size) == (fmt.upper(), (256, 160))
    with pytest.raises(ValueError, match="unknown frame format"):
        encode_frame(rgb, "gif")


# ------------------------------------------------------------------------------------------------ binding rules


def test_host_names_and_loopback() -> None:
    assert [host_name(h) for h in ("localhost:8080", "[::1]:9000", "Example.org")] == ["localhost", "::1",
                                                                                         "example.org"]
    assert all(map(is_loopback, ("127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost")))
    assert not any(map(is_loopback, ("0.0.0.0", "10.1.2.3", "node17")))


def test_a_non_loopback_bind_needs_a_token() -> None:
    bridge = BridgeSettings(server="tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="needs an access token"):
        make_app(GatewaySettings(bridge=bridge, host="0.0.0.0"))
    make_app(GatewaySettings(bridge=bridge, host="0.0.0.0", token="secret"))
    make_app(GatewaySettings(bridge=bridge, host="127.0.0.1"))


def test_session_slots_refuse_beyond_the_limit_and_free_on_release() -> None:
    slots = SessionSlots(2)
    assert [slots.acquire(), slots.acquire(), slots.acquire()] == [True, True, False]
    slots.release()
    assert slots.acquire()
    with pytest.raises(ValueError):
        SessionSlots(0)


# ------------------------------------------------------------------------------------------------ a tab's tasks


async def swallowing_once(tasks: TabTasks, ready: asyncio.Event, turns: list[int]) -> None:
    """A pump whose wait loses one cancel, as ``asyncio.wait_for`` on Python 3.10/3.11 does when the awaited
    result is ready in the same step as the cancel: the result is returned and the cancel is gone."""
    while tasks.wanted():
        try:
            await ready.wait()
        except asyncio.CancelledError:
            if not ready.is_set():
                raise
        ready.clear()
        turns.append(1)


def test_a_task_that_loses_its_cancel_is_still_stopped() -> None:
    async def scenario() -> list[int]:
        tasks, ready, turns = TabTasks(), asyncio.Event(), []
        pump = tasks.spawn(swallowing_once(tasks, ready, turns))
        await asyncio.sleep(0)
        hung = asyncio.get_running_loop().call_later(5.0, asyncio.current_task().cancel)  # type: ignore[union-attr]
        ready.set()  # a chunk is ready in the same step as the cancel that stop() sends before it first waits
        await tasks.stop(pump)  # without the unwanted mark this waits forever (cancelled after 5 s: the test fails)
        hung.cancel()
        assert pump.done()
        return turns

    assert asyncio.run(scenario()) == [1]  # it took the ready result once, then saw it was stopped


def test_the_tab_ends_when_its_reader_returns_and_every_task_is_stopped() -> None:
    async def scenario() -> None:
        tasks = TabTasks()
        pumps = [tasks.spawn(asyncio.sleep(3600)) for _ in range(3)]

        async def reader() -> None:
            await asyncio.sleep(0)  # the WebSocket closed

        assert await asyncio.wait_for(tasks.run(reader()), 5) is None
        assert all(p.done() for p in pumps) and tasks.stopping
        with pytest.raises(RuntimeError, match="the tab is over"):
            tasks.spawn(asyncio.sleep(0))

    asyncio.run(scenario())


def test_a_failing_task_ends_the_tab_with_its_failure_and_stops_the_reader() -> None:
    async def scenario() -> None:
        tasks, stopped = TabTasks(), asyncio.Event()

        async def sender() -> None:
            raise struct.error("'i' format requires -2147483648 <= number <= 2147483647")

        async def reader() -> None:
            try:
                await asyncio.sleep(3600)
            finally:
                stopped.set()

        tasks.spawn(sender())
        failure = await asyncio.wait_for(tasks.run(reader()), 5)
        assert isinstance(failure, struct.error) and stopped.is_set()

    asyncio.run(scenario())


def test_a_playout_rewound_after_a_migration_takes_the_chunks_again_and_counts_what_it_dropped() -> None:
    playout = Playout(16.0)
    playout.push(3, 12, 0.0)
    with pytest.raises(ValueError, match="chunks arrive in order"):
        playout.push(2, 12, 0.1)
    playout.rewind()  # the session resumed from its snapshot at chunk 2 on another replica
    playout.push(2, 12, 0.1)
    assert playout.chunk == 2 and playout.dropped.superseded == 12  # chunk 3's frames were never sent


# ------------------------------------------------------------------------------------------------ one live input


def error_codes_the_gateway_may_send() -> set[str]:
    """Every error code written in the gateway's and the server's code, and the client library's: what a page may
    be told (the indexed controls' codes too: a router refuses live input with them during a migration)."""
    found = {code for cls in (ServerError, *ServerError.__subclasses__(), StaleRevision) for code in cls.codes}
    for path in [*(ROOT / "web").glob("*.py"), *(ROOT / "runtime").glob("*.py")]:
        text = path.read_text()
        found |= set(re.findall(r'(?:self\.error|PageError|ClientError)\(\s*"(\w+)"', text))
        found |= set(re.findall(r'code="(\w+)"', text))
        found |= {ErrorCode[name].value for name in re.findall(r"\bErrorCode\.([A-Z_]+)\b", text)}
    # (``migrated`` is a session's event, not an error: the page gets it as its own ``migrated`` message)
    return found - {"migrated"}


def test_hello_lists_the_keys_limits_and_error_codes_the_page_may_see() -> None:
    async def scenario() -> dict[str, Any]:
        bridge = BridgeSettings(server="tcp://127.0.0.1:9", limits=pp.Limits(max_upload_bytes=2**20))
        server = TestServer(make_app(GatewaySettings(bridge=bridge, max_sessions=3)), host="127.0.0.1")
        await server.start_server()
        try:
            async with connect(server.port) as tab:  # hello comes before any server is asked anything
                return tab.texts[0]
        finally:
            await server.close()

    hello = asyncio.run(scenario())
    assert (hello["type"], hello["version"], hello["max_sessions"]) == ("hello", pp.PAGE_PROTOCOL_VERSION, 3)
    assert hello["keys"] == sorted(protocol.KEYS)
    assert hello["limits"] == {"max_upload_bytes": 2**20, "max_text_bytes": pp.MAX_TEXT_BYTES,
                               "max_header_bytes": pp.MAX_HEADER_BYTES,
                               "max_mouse_degrees": protocol.MAX_MOUSE_DEGREES, "max_revision": protocol.MAX_REVISION}
    missing = error_codes_the_gateway_may_send() - set(hello["errors"])
    assert not missing, f"codes the page may get that hello does not list: {sorted(missing)}"
    assert all(isinstance(meaning, str) and meaning for meaning in hello["errors"].values())


def test_the_play_page_takes_its_keys_limits_and_error_codes_from_hello() -> None:
    js = (ROOT / "web" / "static" / "play.js").read_text()
    assert not re.search(r"""["'`][wasdijkl]{4,}["'`]""", js), "a key list written in play.js"
    assert "state.hello.keys" in js and "hello.errors" in js
    for limit in ("max_mouse_degrees", "max_revision", "max_text_bytes", "max_upload_bytes", "max_header_bytes"):
        assert f"limits.{limit}" in js or f".{limit}" in js, limit
    assert not re.search(r"\b(360|2147483647|9000|8192|16384)\b", js), "a limit written in play.js"
    worded = set(re.findall(r"^  (\w+): \(e\) =>", js, re.M))  # the page's own wording per code
    assert worded and worded <= set(pm.ERROR_CODES), sorted(worded - set(pm.ERROR_CODES))


@pytest.mark.parametrize("mouse", [(400.0, 0.0), (0.0, -361.0)])
def test_a_bad_mouse_value_gets_the_same_words_from_the_gateway_and_from_rank_0(mouse: tuple[float, float]) -> None:
    with pytest.raises(pp.PageError) as by_gateway:
        pp.parse_text(json.dumps({"type": "state", "keys": ["w"], "mouse": list(mouse), "revision": 1}))
    sent = Requests().control_state("s", input_state("w", 1, mouse=mouse))  # what the SDK puts on the wire
    live = LiveControls()
    with pytest.raises(ControlStateError) as by_rank_0:
        live.update(protocol.decode(protocol.encode(sent), "client"))
    assert by_gateway.value.message == by_rank_0.value.message and "within ±360 degrees" in by_rank_0.value.message
    assert (by_gateway.value.code, by_rank_0.value.reason) == ("bad_message", "malformed")  # each side's code as before
    assert live.revision == -1 and live.cut(0, 0) == protocol.ChunkControl()  # nothing changed


def test_the_gateway_leaves_staleness_to_rank_0() -> None:
    # the page's check is the shared one: an old revision passes it (rank 0 alone knows the last one it folded in)
    old = pp.parse_text(json.dumps({"type": "state", "keys": ["w"], "revision": 0}))
    assert isinstance(old, protocol.InputState) and old.revision == 0
    live = LiveControls()
    live.update(old)
    with pytest.raises(ControlStateError, match="not newer than 0, the last one the server folded in") as stale:
        live.update(pp.parse_text(json.dumps({"type": "state", "keys": ["s"], "revision": 0})))
    assert stale.value.reason == "stale_revision"
