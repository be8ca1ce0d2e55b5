"""Live mode and session limits end to end on the 7-rank CPU layout: real ranks, real sockets.

The tests run on the session's shared server (``tests/conftest.py``: a short client timeout and small limits) and
never assume they are alone on it: the session limit is reached from however many sessions are open, and what
another client's sessions do is read from the server log.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from PIL import Image

from ipc import protocol
from ipc.aio_client import AsyncClient
from ipc.client import BadRequest, Busy, Client, SessionInfo, UnknownSession, input_state
from scripts import client as tool
from scripts.local_server import ROOT, LocalServer
from tests.shared import CLIENT_TIMEOUT_S, MAX_CHUNKS, MAX_IMAGE_PIXELS, MAX_SESSIONS, read_server
from tests.test_router import wait_for

pytestmark = pytest.mark.multiprocess

IMAGE = (ROOT / "assets" / "start.png").read_bytes()
TIMEOUT_S = CLIENT_TIMEOUT_S
TIMELINE: dict[str, Any] = {  # i, k and j are only ever tapped, never held
    "prompt": "live", "seed": 5, "num_chunks": 40, "events": [
        {"t": 0.10, "keys": "w"}, {"t": 0.25, "keys": "w", "taps": "i"}, {"t": 0.40, "keys": "wd"},
        {"t": 0.55, "keys": "d", "mouse": [4.0, -1.0]}, {"t": 0.62, "keys": "d", "mouse": [2.0, 0.0]},
        {"t": 0.70, "keys": "", "taps": "k"}, {"t": 0.85, "keys": "a", "taps": "j"},
    ]}


@pytest.fixture(scope="module")
def server(shared_server: LocalServer) -> LocalServer:
    return shared_server


@pytest.fixture(scope="module")
def live_run(server: LocalServer) -> tool.LivePlayed:
    with Client(server.endpoint) as client:
        return tool.play_live(client, IMAGE, TIMELINE)


def test_live_snapshots_follow_the_input_timeline_chunk_by_chunk(live_run: tool.LivePlayed) -> None:
    chunks, states = live_run.chunks, {s["revision"]: s for s in live_run.sent}
    assert live_run.summary.reason == "complete"
    assert [c.index for c in chunks] == list(range(40))
    assert len(states) == len(TIMELINE["events"]) and chunks[-1].revision == max(states)  # every input was shown
    previous = -1
    for chunk in chunks:
        revision = chunk.revision
        assert revision >= previous, "a snapshot never goes back to older input"
        folded = [states[r] for r in sorted(states) if previous < r <= revision]  # states cut into this chunk
        held = set(states[revision]["keys"]) if revision >= 0 else set()
        taps = {k for s in folded for k in s["taps"]}
        assert set(chunk.control.keys) == held | taps, (chunk.index, chunk.control, folded)
        mouse = np.sum([s["mouse"] for s in folded], axis=0) if folded else np.zeros(2)
        assert chunk.control.mouse == pytest.approx(tuple(mouse)), chunk.index  # motion sums, never repeats
        previous = revision
    for state in live_run.sent:
        for tap in state["taps"]:
            having = [c for c in chunks if tap in c.control.keys]
            first_showing = next(c for c in chunks if c.revision >= state["revision"])
            assert [c.index for c in having] == [first_showing.index], f"tap {tap} is consumed by exactly one chunk"
    assert chunks[0].revision == -1 and chunks[0].control.keys == frozenset()  # still camera before any input


def test_live_controls_are_never_cut_more_than_one_chunk_ahead(live_run: tool.LivePlayed) -> None:
    times = [c.facts.times for c in live_run.chunks]
    for j in range(2, len(times)):
        # control[j] may be accepted only once chunk j-1 is the one being produced, i.e. chunk j-2 was emitted
        assert times[j].control_accepted >= times[j - 2].emitted, j
    assert any(times[j].control_accepted < times[j - 1].emitted for j in range(1, len(times)))  # one ahead


def test_every_input_revision_gets_an_input_to_photon_latency(live_run: tool.LivePlayed) -> None:
    measured = {r: v for c in live_run.chunks for r, v in c.input_to_photon_s.items()}
    assert sorted(measured) == sorted(s["revision"] for s in live_run.sent)
    assert all(0 < v < 30 for v in measured.values())  # measured (each after its revision left), never negative
    stats = tool.photon_stats(live_run.chunks)
    period = live_run.summary.chunk_period_s.p50
    print(f"\ninput-to-photon on cpu-tiny: {stats} (chunk period p50 {period:.3f} s)")


def test_recorded_live_session_replays_to_identical_frames(server: LocalServer, live_run: tool.LivePlayed,
                                                           tmp_path: Path) -> None:
    path = tmp_path / "live_trace.json"
    path.write_text(json.dumps(tool.recording(TIMELINE, live_run)))
    recorded = tool.load_timeline(path)
    assert len({tuple(a["control"]["keys"]) for a in recorded["applied"]}) >= 4  # a replay that means something
    assert len(set(recorded["hashes"])) > 1
    with Client(server.endpoint) as client:
        played, matched = tool.replay_exact(client, IMAGE, recorded)
        assert matched and len(played.chunks) == 40
        altered = tool.applied_trace(recorded)
        altered["chunks"][3] = {"keys": "s", "mouse": [0.0, 0.0]}  # differs from every recorded snapshot
        changed = tool.play(client, IMAGE, altered, num_chunks=6)
    hashes = tool.frame_hashes(changed.chunks)
    assert hashes[:3] == recorded["hashes"][:3] and hashes[3] != recorded["hashes"][3]


def test_client_tool_records_and_replays_from_the_command_line(server: LocalServer, tmp_path: Path) -> None:
    timeline = {"seed": 2, "num_chunks": 8, "events": [{"t": 0.05, "keys": "l"}, {"t": 0.2, "keys": "", "taps": "w"}]}
    (tmp_path / "timeline.json").write_text(json.dumps(timeline))
    common = ["--endpoint", server.endpoint, "--image", str(ROOT / "assets" / "start.png")]
    record = tmp_path / "live_trace.json"
    assert tool.main([*common, "--live", "--timeline", str(tmp_path / "timeline.json"), "--record", str(record)]) == 0
    recorded = json.loads(record.read_text())
    assert recorded["format"] == tool.LIVE_TRACE_FORMAT and len(recorded["applied"]) == 8
    assert [e["revision"] for e in recorded["events"]] == [1, 2]
    assert tool.main([*common, "--replay", str(record), "--exact"]) == 0
    assert tool.main([*common, "--replay", str(record)]) == 0  # original timing: runs, cut points may differ


def test_pause_when_idle_stops_the_stream_until_the_next_input(server: LocalServer) -> None:
    quiet_s = 0.6
    with Client(server.endpoint) as client:
        info = client.open(IMAGE, live=True, pause_when_idle=True)
        with pytest.raises(TimeoutError):
            client.next_chunk(info.id, timeout_s=quiet_s)  # no input yet: paused
        live = client.live(info.id)
        live.press("w")
        walking = [client.next_chunk(info.id, timeout_s=10) for _ in range(3)]
        live.release("w")
        while True:  # the snapshots already cut (at most one ahead) still arrive, then the stream stops
            try:
                walking.append(client.next_chunk(info.id, timeout_s=quiet_s))
            except TimeoutError:
                break
        assert all(c.control.keys == {"w"} and c.revision == 1 for c in walking)
        live.tap("d")
        tapped = client.next_chunk(info.id, timeout_s=10)
        with pytest.raises(TimeoutError):
            client.next_chunk(info.id, timeout_s=quiet_s)  # a tap moves exactly one chunk, then idle again
        live.press("a")
        resumed = client.next_chunk(info.id, timeout_s=10)
        summary = client.close(info.id)
    assert (tapped.control.keys, tapped.revision) == ({"d"}, 3)
    assert (resumed.control.keys, resumed.revision) == ({"a"}, 4)
    assert [c.index for c in [*walking, tapped, resumed]] == list(range(len(walking) + 2))
    assert summary.reason == "client"


def test_a_session_beyond_the_limit_is_refused_busy_while_the_others_keep_streaming(server: LocalServer) -> None:
    with Client(server.endpoint) as client:
        infos: list[SessionInfo] = []
        with pytest.raises(Busy) as refused:  # up to the limit (whatever other clients hold), then one more
            for _ in range(MAX_SESSIONS + 1):
                infos.append(client.open(IMAGE, live=True))
        assert infos, "another test left every session slot taken"
        seen = {i.id: client.next_chunk(i.id, timeout_s=10).index for i in infos}  # endless, still camera: streaming
        after = {i.id: [client.next_chunk(i.id, timeout_s=10).index for _ in range(2)] for i in infos}
        for info in infos:
            client.close(info.id)
        assert client.open(IMAGE, num_chunks=1).id  # a slot is free again
    assert refused.value.retry_after_s and refused.value.retry_after_s > 0
    assert f"limit of {MAX_SESSIONS} sessions" in refused.value.message
    assert all(after[s] == [seen[s] + 1, seen[s] + 2] for s in seen)


def test_session_length_and_image_size_beyond_the_limits_are_refused(server: LocalServer) -> None:
    big = io.BytesIO()
    Image.new("RGB", (300, 300)).save(big, format="PNG")
    with Client(server.endpoint) as client:
        with pytest.raises(BadRequest, match=rf"num_chunks must be in 1\.\.{MAX_CHUNKS}, got {MAX_CHUNKS + 1}"):
            client.open(IMAGE, num_chunks=MAX_CHUNKS + 1)
        with pytest.raises(BadRequest, match=f"300x300 pixels exceeds the limit of {MAX_IMAGE_PIXELS} pixels"):
            client.open(big.getvalue(), num_chunks=2)
        with pytest.raises(BadRequest, match="exceeds the limit of 2000"):
            client.open(IMAGE, prompt="p" * 2001, num_chunks=2)  # server.max_prompt_chars
        assert client.stats().per_session == {}  # nothing was opened


def test_silent_clients_have_their_sessions_closed_and_caches_released_after_the_timeout(
    server: LocalServer,
) -> None:
    # Two ways to go silent: a socket that stays connected but never speaks or reads again (a hung process,
    # its live session streaming), and a client whose I/O thread stopped (socket closed, its session paused).
    identity = f"silent-{uuid.uuid4().hex[:6]}".encode()
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.IDENTITY, identity)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.endpoint)
    raw.send(protocol.encode(protocol.Open(req=1, image=IMAGE, live=True)))
    assert raw.poll(30_000)
    opened = read_server(raw)
    assert isinstance(opened, protocol.Opened), opened
    raw.send(protocol.encode(protocol.ControlState(req=2, session=opened.session, keys=["w"], revision=1)))
    raw_silent = time.monotonic()  # its last word
    first = read_server(raw) if raw.poll(30_000) else None
    assert isinstance(first, protocol.Chunk), first  # it was streaming to the socket that now goes silent
    stopped = Client(server.endpoint)
    paused = stopped.open(IMAGE, live=True, pause_when_idle=True)
    stopped.close_client()
    stopped_silent = time.monotonic()
    closed_after: dict[str, float] = {}
    while len(closed_after) < 2 and time.monotonic() - raw_silent < TIMEOUT_S + 10:
        log = server.log_path.read_text(errors="replace")  # another client's sessions: only the log may tell
        for sid, since in ((opened.session, raw_silent), (paused.id, stopped_silent)):
            if f"session {sid} closed (disconnect)" in log and sid not in closed_after:
                closed_after[sid] = time.monotonic() - since
        time.sleep(0.05)
    raw.close(linger=0)
    assert set(closed_after) == {opened.session, paused.id}
    assert all(t > TIMEOUT_S - 0.2 for t in closed_after.values()), closed_after  # never before the timeout
    log = server.log_path.read_text(errors="replace")
    for sid in closed_after:
        assert f"session {sid}: client silent" in log
    with Client(server.endpoint, identity=identity) as returning:
        with pytest.raises(UnknownSession, match="no session"):
            returning.resume(opened.session)
        returning.live(opened.session, first_revision=2).press("d")
        late = returning.error(timeout_s=5)
    assert isinstance(late, UnknownSession)


def test_a_reconnecting_client_with_the_same_identity_resumes_its_session(server: LocalServer) -> None:
    identity = f"resumer-{uuid.uuid4().hex[:6]}".encode()
    first = Client(server.endpoint, identity=identity)
    info = first.open(IMAGE, num_chunks=4)
    for index in range(2):
        first.control(info.id, index, keys="w")
    before = [first.next_chunk(info.id, timeout_s=10) for _ in range(2)]
    first.close_client()  # gone: no heartbeats, socket closed; the same identity is heard again at once
    with Client(server.endpoint) as stranger, pytest.raises(UnknownSession):
        stranger.resume(info.id)  # only the owner's identity may re-attach
    with Client(server.endpoint, identity=identity) as second:
        second.resume(info.id)
        for index in (2, 3):
            second.control(info.id, index, keys="d")
        after = list(second.chunks(info.id, timeout_s=10))
        summary = second.wait_closed(info.id)
    assert [c.index for c in before + after] == [0, 1, 2, 3]
    assert [c.control.keys for c in after] == [{"d"}, {"d"}]
    assert summary.reason == "complete"


def test_a_client_that_drops_mid_stream_resumes_and_keeps_receiving_later_chunks(server: LocalServer) -> None:
    identity = f"dropper-{uuid.uuid4().hex[:6]}".encode()
    first = Client(server.endpoint, identity=identity)
    info = first.open(IMAGE, num_chunks=None, live=True)
    first.control_state(info.id, input_state(["w"], revision=1))  # held: the world keeps streaming while we are away
    before = [first.next_chunk(info.id, timeout_s=10) for _ in range(2)]
    with Client(server.endpoint) as observer:  # the server's own count: a stranger sees no session of ours
        emitted = observer.stats().chunks_emitted
        first.close_client()
        # chunks are produced meanwhile and dropped (the client is gone, not yet timed out)
        wait_for("two chunks while it was away", lambda: observer.stats().chunks_emitted >= emitted + 2, 30)
    with Client(server.endpoint, identity=identity) as second:
        second.resume(info.id)
        after = [second.next_chunk(info.id, timeout_s=10) for _ in range(3)]
        second.close(info.id)
    indices = [c.index for c in before + after]
    assert indices == sorted(set(indices)) and after[0].index > before[-1].index  # in order, a gap allowed
    assert all(c.control.keys == {"w"} for c in after)


def test_async_client_streams_a_session_and_types_errors(server: LocalServer) -> None:
    async def scenario() -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
        async with AsyncClient(server.endpoint) as client:
            info = await client.open(IMAGE, num_chunks=3, seed=4)
            for index in range(3):
                await client.control(info.id, index, keys="j")
            chunks = [c async for c in client.chunks(info.id, timeout_s=30)]
            summary = await client.wait_closed(info.id)
            with pytest.raises(UnknownSession):
                await client.resume(info.id)
            return chunks, summary, await client.stats()

    chunks, summary, stats = asyncio.run(scenario())
    assert [c.index for c in chunks] == [0, 1, 2] and all(c.control.keys == {"j"} for c in chunks)
    assert summary.reason == "complete" and stats.layout == "cpu-tiny"
    with Client(server.endpoint) as client:  # same seed and controls through the blocking client: same frames
        same, _ = tool.play(client, IMAGE, {"seed": 4, "chunks": [{"keys": "j"}] * 3}), None
    assert len(chunks) == len(same.chunks) == 3
    assert all(np.array_equal(a.frames, b.frames) for a, b in zip(chunks, same.chunks, strict=True))


def test_live_input_with_unknown_keys_or_a_stale_revision_is_refused_by_the_server(server: LocalServer) -> None:
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.endpoint)

    def answer(req: int) -> object:
        while True:
            assert raw.poll(30_000), f"no answer to {req}"
            message = read_server(raw)
            if getattr(message, "req", None) == req:
                return message

    try:
        raw.send(protocol.encode(protocol.Open(req=1, image=IMAGE, live=True, pause_when_idle=True)))
        opened = answer(1)
        assert isinstance(opened, protocol.Opened)
        raw.send(protocol.encode(protocol.ControlState(req=2, session=opened.session, keys=["w"], revision=5)))
        raw.send(protocol.encode(protocol.ControlState(req=3, session=opened.session, keys=["q"], revision=6)))
        unknown = answer(3)
        raw.send(protocol.encode(protocol.ControlState(req=4, session=opened.session, keys=["a"], revision=5)))
        stale = answer(4)
        assert isinstance(unknown, protocol.Error) and unknown.code == "unknown_keys" and "q" in unknown.message
        assert isinstance(stale, protocol.Error) and stale.code == "stale_revision"
        chunk: object = None  # the refusals changed nothing: the accepted state drives the stream
        while not isinstance(chunk, protocol.Chunk):
            assert raw.poll(30_000)
            chunk = read_server(raw)
        assert chunk.facts.control.keys == {"w"} and chunk.facts.control.revision == 5
        raw.send(protocol.encode(protocol.Close(req=9, session=opened.session)))
        while not isinstance(chunk, protocol.Closed):  # closed before the socket goes: nothing left streaming
            assert raw.poll(30_000)
            chunk = read_server(raw)
    finally:
        raw.close()
