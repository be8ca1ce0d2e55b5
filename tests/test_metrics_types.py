"""The metrics on the wire (``ipc.metrics_types``): a session summary and a stats reply keep the maps of earlier
versions, read back into the same typed values, and a newer server's additions never break a reader."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from ipc import protocol as p
from ipc import tolerant
from ipc.metrics_types import PartialSummary, ServerStats, SessionSummary
from ranks.prometheus import Exporter
from runtime.core_types import ClientSent
from tests.core_job import A, B, Job, control

_raw = msgspec.msgpack.Decoder()

# the keys of the maps before they were typed (runtime.metrics.SessionMetrics.to_dict, runtime.core.stats), in order
SUMMARY_KEYS = ["session", "opened_at", "closed_at", "elapsed_s", "chunks", "frames", "time_to_first_frame_s",
                "latency_s", "chunk_period_s", "compute", "warmup", "chunk_media_s", "real_time_factor", "dit_idle",
                "condition_prefetch_wait_s", "peak_memory_bytes", "percentile_relative_error", "recent_chunks"]
CLOSING_KEYS = ["clock_offsets", "released", "leaked_caches", "poisoned"]
STATS_KEYS = ["uptime_s", "sessions", "chunks_emitted", "frames_emitted", "rejects", "errors", "dit_idle",
              "per_session", "open_sessions", "watchers", "watch_dropped", "ranks", "clock_offsets", "layout",
              "schedule", "warm", "warm_up", "sizes", "capacity", "snapshots"]


def served() -> tuple[bytes, bytes]:
    """The encoded ``stats_reply`` of a live session (two chunks in) and the ``closed`` it ends with."""
    job = Job()
    sid = job.open(num_chunks=3)
    for index in range(2):
        control(job, sid, index, keys=["w"])
        job.chunk(sid, index)
    (reply,) = job.to(A, p.StatsReply, job.step(ClientSent(A, p.Stats(req=5))))
    job.play({A: sid}, chunks=3)
    (closed,) = job.to(A, p.Closed)
    return p.encode(reply), p.encode(closed)


def test_a_summary_and_a_stats_reply_round_trip_wire_to_typed_to_wire_unchanged() -> None:
    stats_bytes, closed_bytes = served()
    for data in (stats_bytes, closed_bytes):
        typed = p.decode(data, "server")
        assert p.encode(typed) == data  # byte for byte: every key, value and order kept
        assert tolerant.decode(data, "server") == typed
    stats, closed = _raw.decode(stats_bytes)["stats"], _raw.decode(closed_bytes)["summary"]
    assert list(stats) == STATS_KEYS and list(closed) == SUMMARY_KEYS + CLOSING_KEYS  # the maps old clients read
    (live,) = stats["per_session"].values()
    assert list(live) == SUMMARY_KEYS and live["chunks"] == 2 and closed["chunks"] == 3
    assert list(live["chunk_period_s"]) == ["count", "mean", "min", "max", "p50", "p90", "p99", "p95"]
    assert list(live["condition_prefetch_wait_s"])[-1] == "total" and "p95" not in live["latency_s"]
    assert list(live["dit_idle"]["by_cause"]) == ["condition", "control", "edge", "no_session", "save"]
    assert live["recent_chunks"][0]["control"] == {"keys": ["w"], "mouse": [0.0, 0.0], "poses": None, "revision": -1}
    typed = p.decode(stats_bytes, "server").stats
    assert isinstance(typed, ServerStats) and typed.per_session[next(iter(stats["per_session"]))].chunks == 2


def test_a_watchers_closed_carries_no_summary_and_reads_as_an_empty_one() -> None:
    data = p.encode(p.Closed(session="s", reason="unwatched"))
    assert "summary" not in _raw.decode(data)  # an older client takes its default, {}
    assert p.decode(p.encode(p.Closed(session="s", reason="x", summary=SessionSummary())), "server").summary == \
        SessionSummary()
    old = msgspec.msgpack.encode({"type": "closed", "v": 3, "session": "s", "reason": "x", "summary": {}})
    assert p.decode(old, "server").summary == SessionSummary()  # an older server's empty summary


def test_unknown_fields_in_a_stats_reply_and_a_summary_are_dropped_not_refused() -> None:
    stats_bytes, closed_bytes = served()
    reply, closed = _raw.decode(stats_bytes), _raw.decode(closed_bytes)
    expected_stats, expected_closed = p.decode(stats_bytes, "server"), p.decode(closed_bytes, "server")
    reply["stats"]["gpu_temperature"] = {"0": 71.5}  # what a newer server may add, at every level
    (live,) = reply["stats"]["per_session"].values()
    live["jitter_s"] = {"p50": 0.01}
    live["chunk_period_s"]["p999"] = 0.2
    reply["stats"]["capacity"]["sessions_waiting"] = 3
    closed["summary"]["dit_idle"]["by_cause"]["thermal"] = {"count": 1, "total_s": 0.5, "fraction": 0.1}
    for data, expected in ((reply, expected_stats), (closed, expected_closed)):
        encoded = msgspec.msgpack.encode(data)
        assert p.decode(encoded, "server") == expected
        assert tolerant.decode(encoded, "server") == expected


def test_the_prometheus_exporter_derives_each_sessions_chunk_period_from_the_core_events() -> None:
    exporter = Exporter()
    job = Job(observers=(exporter,))
    sids = {A: job.open(A, num_chunks=3), B: job.open(B, num_chunks=3)}
    job.play(sids, chunks=3)
    sample = exporter.registry.get_sample_value
    assert sample("worldstream_sessions_opened_total") == 2
    assert sample("worldstream_chunks_emitted_total") == 6
    emitted = {sid: [e.facts.times.emitted for e in job.emitted(sid)] for sid in sids.values()}
    periods = [b - a for times in emitted.values() for a, b in itertools.pairwise(times)]
    assert sample("worldstream_chunk_period_seconds_count") == len(periods) == 4  # within a session only
    assert sample("worldstream_chunk_period_seconds_sum") == pytest.approx(sum(periods))
    assert sample("worldstream_time_to_first_frame_seconds_count") == 2  # one first frame per session
    assert not exporter.last_emitted and not exporter.opened_at  # closed sessions are forgotten


def test_a_partial_summary_says_only_what_its_sender_knows_and_the_page_shows_no_zeros() -> None:
    """A router that lost a session's replica knows only the replica: the wire map is that (as before typing), and
    the gateway passes the page that map, not a summary of zeros read as "0 chunks"."""
    from web.bridge import _brief

    closed = p.Closed(session="s", reason="failed", error="replica a is down", summary=PartialSummary(replica="a"))
    wire = _raw.decode(p.encode(closed))
    assert wire["summary"] == {"replica": "a"}
    read = p.decode(p.encode(closed), "server").summary
    assert isinstance(read, SessionSummary) and read.session == "" and read.replica == "a"
    assert _brief(msgspec.structs.replace(read, reason="failed")) == {"replica": "a", "reason": "failed"}
    full = SessionSummary(session="s", chunks=0)  # a real summary keeps its zeros: they are measured
    assert _brief(full)["chunks"] == 0 and _brief(full)["session"] == "s"
