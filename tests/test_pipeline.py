"""The 7-rank CPU layout end to end: real torchrun ranks, real gloo groups, real ZeroMQ sockets on loopback.

One server is shared by the tests of this module (a 7-rank start costs seconds); the last test shuts it down
and checks every rank exits 0. Failure tests start their own jobs.
"""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from ipc import protocol
from ipc.client import Client, ServerError
from scripts.local_server import ROOT, LocalServer
from tests.test_synthetic import horizontal_shift

pytestmark = pytest.mark.multiprocess

IMAGE = (ROOT / "assets" / "start.png").read_bytes()
FAST = ["--synthetic.encode_s=0.01", "--synthetic.denoise_s=0.03", "--synthetic.decode_s=0.015"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PROMETHEUS_PORT = free_port()


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    with LocalServer("cpu-tiny", [*FAST, f"--metrics.prometheus_port={PROMETHEUS_PORT}"]) as running:
        yield running


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
        assert summary["reason"] == "complete"
        assert {k: sorted(v) for k, v in summary["released"].items()} == {"decode": [1], "denoise": [2, 3, 4, 5, 6],
                                                                          "condition": [0]}
        assert list(summary["released"]) == ["decode", "denoise", "condition"]


def test_two_conditions_are_ready_before_the_first_control_is_sent(server: LocalServer) -> None:
    with Client(server.endpoint) as client:
        info = client.open(IMAGE, num_chunks=3)
        time.sleep(0.5)  # the client thinks; the condition path must not wait for it
        for index in range(3):
            client.control(info.id, index, keys="w")
        chunks = list(client.chunks(info.id, timeout_s=60))
    first_control = chunks[0].facts.times.control_accepted
    assert first_control is not None
    assert chunks[0].facts.times.condition_ready < first_control
    assert chunks[1].facts.times.condition_ready < first_control
    assert chunks[0].facts.times.condition_wait == 0.0
    # the latency clock starts at acceptance, not at the (much earlier) condition ingress
    assert chunks[0].facts.times.control_to_output < 0.45


def test_bad_messages_get_clear_errors_while_another_session_keeps_streaming(server: LocalServer) -> None:
    with Client(server.endpoint) as good:
        info = good.open(IMAGE, num_chunks=12)
        sender = threading.Thread(target=lambda: [good.control(info.id, i, keys="w") for i in range(12)])
        sender.start()
        context = zmq.Context.instance()
        raw = context.socket(zmq.DEALER)
        raw.connect(server.endpoint)

        def ask(data: bytes) -> protocol.Error:
            raw.send(data)
            assert raw.poll(30_000), "no reply"
            reply = protocol.decode(raw.recv(), "server", max_bytes=1 << 30)
            assert isinstance(reply, protocol.Error)
            return reply

        def enc(**fields: object) -> bytes:
            return msgspec.msgpack.encode({"v": protocol.PROTOCOL_VERSION, **fields})

        cases = [
            (b"\x93\xc1\xff not msgpack", "bad_message", "not a msgpack message"),
            (enc(type="warp", req=1), "bad_message", "unknown message type"),
            (msgspec.msgpack.encode({"v": 99, "type": "stats", "req": 1}), "bad_message", "version 99"),
            (enc(type="open", image=IMAGE), "bad_message", "missing required field `req`"),
            (enc(type="open", req=1, image=b"\0" * (100 * 2**20)), "bad_message", "exceeds the limit"),
            (enc(type="open", req=1, image=b"GIF89a-but-not-really"), "bad_image", "could not be decoded"),
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
    assert all(np.array_equal(x.frames, y.frames) for x, y in zip(a, b))


def test_stats_reports_sessions_ranks_and_clock_offsets(server: LocalServer) -> None:
    with Client(server.endpoint) as client:
        stats = client.stats()
    assert stats["sessions"]["total"] >= 1 and stats["layout"] == "cpu-tiny"
    assert stats["rejects"].get("bad_message", 0) >= 1  # counted by the bad-message test above
    assert sorted(stats["ranks"]) == ["0", "1", "2", "3", "4", "5", "6"]
    assert all(m["rss"] > 0 for m in stats["ranks"].values())
    assert all(abs(o["offset_s"]) < 0.05 for o in stats["clock_offsets"].values())  # one machine, one clock


def test_a_session_summary_is_complete_and_its_trace_puts_every_span_inside_its_chunk(server: LocalServer,
                                                                                    tmp_path: Path) -> None:
    from scripts.client import load_trace, play, write_chrome_trace

    with Client(server.endpoint) as client:
        played = play(client, IMAGE, load_trace(ROOT / "assets" / "demo_trace.json"), num_chunks=5)
    summary = played.summary
    assert summary["chunks"] == 5 and summary["frames"] == 9 + 4 * 12
    assert summary["latency_s"]["count"] == 3 and summary["warmup"]["chunks"] == 2  # two warm-up chunks
    for key in ("p50", "p90", "p99", "mean"):
        assert summary["latency_s"][key] > 0 and summary["chunk_period_s"][key] > 0
    assert summary["compute"]["fps_weighted"] > 0 and summary["real_time_factor"] > 0
    assert summary["time_to_first_frame_s"]["from_open"] >= summary["time_to_first_frame_s"]["from_first_control"]
    assert sorted(summary["peak_memory_bytes"]) == ["0", "1", "2", "3", "4", "5", "6"]
    assert set(summary["dit_idle"]["by_cause"]) == {"condition", "control", "edge", "no_session"}
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


def test_prometheus_endpoint_serves_counters_and_latency_histograms(server: LocalServer) -> None:
    with Client(server.endpoint) as client:
        stream(client, "w", chunks=2)
        client.send_raw(b"not msgpack")
        assert client.error(timeout_s=10) is not None
    text = urllib.request.urlopen(f"http://127.0.0.1:{PROMETHEUS_PORT}/metrics", timeout=10).read().decode()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["worldstream_chunks_emitted_total"] >= 2
    assert values["worldstream_control_to_output_seconds_count"] == values["worldstream_chunks_emitted_total"]
    assert values['worldstream_rejects_total{reason="bad_message"}'] >= 1


def test_zz_sigterm_shuts_every_rank_down_with_exit_0(server: LocalServer) -> None:
    ranks = server.ranks()
    assert sorted(ranks) == list(range(7))
    assert server.stop() == 0
    assert all(not p.is_running() or p.status() == "zombie" for p in ranks.values())
    assert "rank 6: clean exit" in server.log()


def test_a_killed_rank_ends_the_job_nonzero_within_30s_and_the_client_hears_of_it(tmp_path: Path) -> None:
    with LocalServer("cpu-tiny", FAST, log_path=tmp_path / "server.log") as server, Client(server.endpoint) as client:
        info = client.open(IMAGE, num_chunks=None)
        client.control(info.id, 0, keys="w")
        client.next_chunk(info.id, timeout_s=30)
        killed = time.monotonic()
        server.kill_rank(3)
        code = server.wait(timeout_s=30)
        elapsed = time.monotonic() - killed
        error = client.error(timeout_s=5)
        assert code != 0 and elapsed < 30
        assert error is not None and error.code == "rank_failed" and "rank 3" in error.message, error
