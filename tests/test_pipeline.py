"""The 7-rank CPU layout end to end: real torchrun ranks, real gloo groups, real ZeroMQ sockets on loopback.

The tests run on the session's shared server (``tests/conftest.py``) and never assume they are alone on it; the
tests that stop a server start their own.
"""

from __future__ import annotations

import io
import itertools
import json
import threading
import time
import urllib.request
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
from PIL import Image

from ipc import protocol
from ipc.client import Client, ServerError
from models.camera import intrinsics_at
from models.controls import OFFICIAL_INTRINSICS
from scripts.local_server import ROOT, LocalServer
from tests.shared import FAST, prometheus_port, read_server
from tests.test_synthetic import horizontal_shift

pytestmark = pytest.mark.multiprocess

IMAGE = (ROOT / "assets" / "start.png").read_bytes()


@pytest.fixture
def server(shared_server: LocalServer) -> LocalServer:
    return shared_server


def stream(client: Client, keys: str, chunks: int, seed: int = 0, prompt: str = "") -> tuple[list, dict]:
    info = client.open(IMAGE, prompt=prompt, seed=seed, num_chunks=chunks)
    for index in range(chunks):
        client.control(info.id, index, keys=keys)
    received = list(client.chunks(info.id, timeout_s=60))
    return received, client.wait_closed(info.id)


def test_two_concurrent_sessions_get_every_chunk_once_in_order_moving_with_their_keys(server: LocalServer) -> None:
    results: dict[str, tuple[list, dict]] = {}

    def run(keys: str) -> None:
        with Client(server.endpoint) as client:
            results[keys] = stream(client, keys, chunks=6)

    threads = [threading.Thread(target=run, args=(k,)) for k in ("d", "a")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert set(results) == {"d", "a"}
    for keys, (chunks, summary) in results.items():
        assert [c.index for c in chunks] == list(range(6))
        assert [c.frames.shape for c in chunks] == [(9, 160, 256, 3)] + [(12, 160, 256, 3)] * 5
        assert all(c.control.keys == {keys} for c in chunks)
        frames = np.concatenate([c.frames for c in chunks])
        shifts = [horizontal_shift(a, b) for a, b in itertools.pairwise(frames)]
        # strafing right slides the scene left, frame after frame (and strafing left slides it right)
        assert all(s < 0 for s in shifts) if keys == "d" else all(s > 0 for s in shifts), (keys, shifts)
        assert summary.reason == "complete"
        assert {k: sorted(v) for k, v in summary.released.items()} == {"decode": [1], "denoise": [2, 3, 4, 5, 6],
                                                                          "condition": [0]}
        assert list(summary.released) == ["decode", "denoise", "condition"]


def test_two_conditions_are_ready_before_the_first_control_is_sent(server: LocalServer) -> None:
    with Client(server.endpoint) as client:
        info = client.open(IMAGE, num_chunks=3)
        time.sleep(0.5)  # the client thinks; the condition path must not wait for it
        for index in range(3):
            client.control(info.id, index, keys="w")
        chunks = list(client.chunks(info.id, timeout_s=60))
        summary = client.wait_closed(info.id)
    first_control = chunks[0].facts.times.control_accepted
    assert first_control is not None
    assert chunks[0].facts.times.condition_ready < first_control
    assert chunks[1].facts.times.condition_ready < first_control
    assert chunks[0].facts.times.condition_wait == 0.0
    # the server's latency metric counts from acceptance, not from the condition ingress half a second earlier
    first = chunks[0].facts.times
    assert summary.warmup.latency_s[0] == pytest.approx(first.emitted - first.control_accepted)
    assert summary.warmup.latency_s[0] < first.emitted - first.condition_submitted - 0.4


def test_bad_messages_get_clear_errors_while_another_session_keeps_streaming(server: LocalServer) -> None:
    with Client(server.endpoint) as good:
        info = good.open(IMAGE, num_chunks=12)
        assert info.intrinsics == intrinsics_at(OFFICIAL_INTRINSICS, info.height, info.width)  # the camera it gets
        sender = threading.Thread(target=lambda: [good.control(info.id, i, keys="w") for i in range(12)])
        sender.start()
        context = zmq.Context.instance()
        raw = context.socket(zmq.DEALER)
        raw.connect(server.endpoint)

        def ask(data: bytes) -> protocol.Error:
            raw.send(data)
            assert raw.poll(30_000), "no reply"
            reply = read_server(raw)
            assert isinstance(reply, protocol.Error)
            return reply

        def enc(**fields: object) -> bytes:
            return msgspec.msgpack.encode({"v": protocol.PROTOCOL_VERSION, **fields})

        cases = [
            (b"\xc1\xff not msgpack", "bad_message", "not a msgpack message"),
            (enc(type="warp", req=1), "bad_message", "unknown message type"),
            (msgspec.msgpack.encode({"v": 99, "type": "stats", "req": 1}), "bad_message", "version 99"),
            (enc(type="open", image=IMAGE), "bad_message", "missing required field `req`"),
            (enc(type="open", req=1, image=b"\0" * (16 * 2**20 + 4096)), "bad_message", "exceeds the limit"),
            (enc(type="open", req=1, image=b"GIF89a-but-not-really"), "bad_image", "could not be decoded"),
            (enc(type="open", req=1, image=IMAGE, intrinsics=[415.0, 415.0, 900.0, 240.0]), "bad_message",
             "principal point (cx, cy) = (900, 240) must lie inside the 832x480 frame"),
            (enc(type="open", req=1, image=IMAGE, intrinsics=[0.0, 415.0, 416.0, 240.0]), "bad_message",
             "focal lengths fx, fy must be positive"),
            (enc(type="control", req=1, session="nope", index=0), "unknown_session", "no session"),
            (enc(type="control", req=1, session=info.id, index=0), "unknown_session", "no session"),  # not ours
        ]
        for data, code, text in cases:
            reply = ask(data)
            assert reply.code == code and text in reply.message, (code, reply)
        with pytest.raises(ServerError, match=r"rejected_control.*expected index"):
            good.control(info.id, 40, keys="w")  # a skip is refused, nothing changes
        chunks = list(good.chunks(info.id, timeout_s=60))
        sender.join(timeout=30)
        raw.close(linger=0)
    assert [c.index for c in chunks] == list(range(12))


def test_duplicate_control_is_rejected_and_changes_nothing(server: LocalServer) -> None:
    with Client(server.endpoint) as client:
        info = client.open(IMAGE, num_chunks=2)
        client.control(info.id, 0, keys="w")
        with pytest.raises(ServerError, match=r"control\[0\] rejected.*expected index 1"):
            client.control(info.id, 0, keys="w")
        client.control(info.id, 1, keys="s")
        chunks = list(client.chunks(info.id, timeout_s=60))
    assert [c.control.keys for c in chunks] == [{"w"}, {"s"}]


def test_same_seed_and_controls_give_identical_frames_across_sessions(server: LocalServer) -> None:
    with Client(server.endpoint) as client:
        a, _ = stream(client, "l", chunks=3, seed=11)
        b, _ = stream(client, "l", chunks=3, seed=11)
    assert [c.index for c in a] == [c.index for c in b] == [0, 1, 2]
    assert all(np.array_equal(x.frames, y.frames) for x, y in zip(a, b, strict=True))


def test_stats_reports_sessions_rejects_ranks_and_clock_offsets(server: LocalServer) -> None:
    with Client(server.endpoint) as client:
        before = client.stats()
        stream(client, "w", chunks=1)
        client.send_raw(b"not msgpack")
        error = client.error(timeout_s=10)
        stats = client.stats()
    assert error is not None and error.code == "bad_message"
    assert stats.sessions.total == before.sessions.total + 1 and stats.layout == "cpu-tiny"
    assert stats.rejects["bad_message"] == before.rejects.get("bad_message", 0) + 1
    assert sorted(stats.ranks) == ["0", "1", "2", "3", "4", "5", "6"]
    assert all(m.rss > 0 for m in stats.ranks.values())
    assert all(abs(o.offset_s) < 0.05 for o in stats.clock_offsets.values())  # one machine, one clock


def test_a_session_summary_is_complete_and_its_trace_puts_every_span_inside_its_chunk(server: LocalServer,
                                                                                    tmp_path: Path) -> None:
    from scripts.client import load_trace, play, write_chrome_trace

    with Client(server.endpoint) as client:
        played = play(client, IMAGE, load_trace(ROOT / "assets" / "demo_trace.json"), num_chunks=5)
    summary = played.summary
    assert summary.chunks == 5 and summary.frames == 9 + 4 * 12
    assert summary.latency_s.count == 3 and summary.warmup.chunks == 2  # two warm-up chunks
    for key in ("p50", "p90", "p99", "mean"):
        assert getattr(summary.latency_s, key) > 0 and getattr(summary.chunk_period_s, key) > 0
    assert summary.compute.fps_weighted > 0 and summary.real_time_factor > 0
    assert summary.time_to_first_frame_s.from_open >= summary.time_to_first_frame_s.from_first_control
    assert sorted(summary.peak_memory_bytes) == ["0", "1", "2", "3", "4", "5", "6"]
    assert set(summary.dit_idle.by_cause.shares()) == {"condition", "control", "edge", "no_session", "save"}
    path = tmp_path / "trace.json"
    write_chrome_trace(played, path)
    events = json.loads(path.read_text())["traceEvents"]
    windows = {e["args"]["chunk"]: e for e in events if e["ph"] == "X" and e["cat"] == "chunk"}
    spans = [e for e in events if e["ph"] == "X" and e["cat"] != "chunk"]
    assert sorted(windows) == list(range(5)) and {e["pid"] for e in spans} == set(range(7))
    for span in spans:
        window = windows[span["args"]["chunk"]]
        slack_us = 2000  # clock offsets between ranks are estimated within a ping's half round trip
        assert window["ts"] - slack_us <= span["ts"], span
        assert span["ts"] + span["dur"] <= window["ts"] + window["dur"] + slack_us, span


def prometheus(server: LocalServer) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{prometheus_port(server)}/metrics", timeout=10).read().decode()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_prometheus_endpoint_serves_counters_and_latency_histograms(server: LocalServer) -> None:
    before = prometheus(server)
    with Client(server.endpoint) as client:
        stream(client, "w", chunks=2)
        client.send_raw(b"not msgpack")
        error = client.error(timeout_s=10)
    assert error is not None and error.code == "bad_message"
    values = prometheus(server)
    reject = 'worldstream_rejects_total{reason="bad_message"}'
    assert values["worldstream_chunks_emitted_total"] >= before.get("worldstream_chunks_emitted_total", 0) + 2
    assert values["worldstream_control_to_output_seconds_count"] == values["worldstream_chunks_emitted_total"]
    assert values[reject] == before.get(reject, 0) + 1


def test_sigterm_tells_connected_clients_and_every_rank_exits_0(tmp_path: Path) -> None:
    # server.drain_s=0: the signal stops at once (the drain, which hands sessions off first: test_drain_e2e.py)
    with LocalServer("cpu-tiny", [*FAST, "--server.drain_s=0"], log_path=tmp_path / "server.log") as server, \
            Client(server.endpoint) as client:
        info = client.open(IMAGE, num_chunks=None)
        client.control(info.id, 0, keys="w")
        client.next_chunk(info.id, timeout_s=30)
        ranks = server.ranks()
        assert sorted(ranks) == list(range(7))
        assert server.stop() == 0
        error = client.error(timeout_s=10)
        summary = client.wait_closed(info.id, timeout_s=10)
        log = server.log()
    assert error is not None and error.code == "shutdown", error
    assert summary.reason == "shutdown" and summary.chunks >= 1
    assert all(not p.is_running() or p.status() == "zombie" for p in ranks.values())
    assert all(f"rank {r}: clean exit" in log for r in range(1, 7))


def test_the_refill_submits_condition_i_plus_2_when_denoise_i_completes(server: LocalServer) -> None:
    with Client(server.endpoint) as client:  # each control only once the previous chunk arrived: no control
        info = client.open(IMAGE, num_chunks=6)  # brings its condition along, the refill alone submits them
        chunks = []
        for index in range(6):
            client.control(info.id, index, keys="w")
            chunks.append(client.next_chunk(info.id, timeout_s=60))
    assert [c.index for c in chunks] == list(range(6))
    times = [c.facts.times for c in chunks]
    assert times[0].condition_submitted == times[1].condition_submitted < times[0].control_accepted  # prefetched
    for i in range(4):  # the normal refill: at denoise[i]'s completion, so the encode overlaps decode[i]
        assert times[i + 2].condition_submitted == times[i].denoise_end < times[i + 2].control_accepted, i


def test_a_jpeg_start_image_streams(server: LocalServer) -> None:
    picture = io.BytesIO()
    Image.open(ROOT / "assets" / "start.png").convert("RGB").save(picture, format="JPEG", quality=90)
    with Client(server.endpoint) as client:
        info = client.open(picture.getvalue(), num_chunks=2)
        for index in range(2):
            client.control(info.id, index, keys="d")
        assert [c.frames.shape[1:] for c in client.chunks(info.id, timeout_s=60)] == [(160, 256, 3)] * 2


def test_a_control_sent_too_far_ahead_meets_backpressure_on_the_wire_and_is_accepted_later(
        server: LocalServer) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)

    def enc(**fields: object) -> bytes:
        return msgspec.msgpack.encode({"v": protocol.PROTOCOL_VERSION, **fields})

    def answer(req: int) -> object:
        while True:  # chunks of the session interleave with the answers
            assert sock.poll(30_000), f"no answer to {req}"
            message = read_server(sock)
            if getattr(message, "req", None) == req:
                return message

    try:
        sock.send(enc(type="open", req=1, image=IMAGE, num_chunks=12))
        opened = answer(1)
        assert isinstance(opened, protocol.Opened)
        refused = None
        for index in range(12):  # as fast as possible: the control edge fills
            sock.send(enc(type="control", req=10 + index, session=opened.session, index=index))
            reply = answer(10 + index)
            if isinstance(reply, protocol.Error):
                refused = (index, reply)
                break
            assert isinstance(reply, protocol.Accepted) and reply.index == index
        assert refused is not None, "the control edge never filled"
        index, error = refused
        assert error.code == "control_backpressure" and error.retry_after_s and error.retry_after_s > 0
        deadline = time.monotonic() + 30
        while True:  # the same control again, later: accepted once work moved on
            time.sleep(error.retry_after_s)
            sock.send(enc(type="control", req=100, session=opened.session, index=index))
            reply = answer(100)
            if isinstance(reply, protocol.Accepted):
                break
            assert reply.code == "control_backpressure" and time.monotonic() < deadline  # type: ignore[attr-defined]
        sock.send(enc(type="close", req=200, session=opened.session))
        message: object = None
        while not isinstance(message, protocol.Closed):  # closed before the socket goes: nothing left streaming
            assert sock.poll(30_000)
            message = read_server(sock)
    finally:
        sock.close()


def test_the_aggregated_layout_with_co_located_roles_streams(tmp_path: Path) -> None:
    with LocalServer("cpu-aggregated", FAST, log_path=tmp_path / "server.log") as server, \
            Client(server.endpoint) as client:  # fmt: skip
        chunks, summary = stream(client, "a", chunks=4)
    assert [c.index for c in chunks] == [0, 1, 2, 3] and summary.reason == "complete"
    assert sorted(summary.released["denoise"]) == [0, 1, 2, 3, 4]
