"""Session and server metrics on hand-built event sequences: anchors, percentiles, causes, bounded memory."""

from __future__ import annotations

import json
import math
import tracemalloc

import msgspec
import numpy as np
import pytest

from ipc.metrics_types import IdleShare, ServerStats, SessionCounts, TimeToFirstFrame
from ipc.protocol import ChunkControl, ChunkFacts, ChunkTimes, Span, to_builtins
from runtime.metrics import (
    OTHER_REASON,
    IdleCause,
    ServerMetrics,
    SessionMetrics,
    StreamStat,
    compute_seconds,
    window,
)

FPS = 16.0


def record(index: int, emitted: float, **overrides: object) -> ChunkFacts:
    """A chunk accepted 0.5 s before emission, compute 0.1 condition + 0.2 denoise + 0.1 decode, 12 frames.
    ``overrides`` name fields of the record or of its ``ChunkTimes``."""
    times: dict[str, object] = {
        "emitted": emitted,
        "control_accepted": emitted - 0.5,
        "condition_submitted": emitted - 0.6,
        "condition_ready": emitted - 0.5,
        "denoise_start": emitted - 0.35,
        "denoise_end": emitted - 0.15,
        "decode_start": emitted - 0.12,
        "decode_end": emitted - 0.02,
    }
    values: dict[str, object] = {
        "index": index,
        "frames": 12,
        "control": ChunkControl(keys=frozenset("w"), revision=index),
        "spans": (
            Span("condition", 0, "condition", emitted - 0.6, emitted - 0.6, emitted - 0.5),
            Span("denoise", 2, "denoise", emitted - 0.4, emitted - 0.35, emitted - 0.15),
            Span("denoise", 3, "denoise", emitted - 0.4, emitted - 0.34, emitted - 0.15),
            Span("transfer:latent", 1, "decode", emitted - 0.15, emitted - 0.15, emitted - 0.12),
            Span("decode", 1, "decode", emitted - 0.15, emitted - 0.12, emitted - 0.02),
        ),
    }
    for name, value in overrides.items():
        (times if name in times else values)[name] = value
    return ChunkFacts(times=ChunkTimes(**times), **values)  # type: ignore[arg-type]


def session(warmup_chunks: int = 0, **kwargs: object) -> SessionMetrics:
    return SessionMetrics("s1", opened_at=0.0, fps=FPS, warmup_chunks=warmup_chunks, **kwargs)  # type: ignore[arg-type]


def test_percentiles_are_nearest_rank_within_the_stated_relative_error() -> None:
    rng = np.random.default_rng(0)
    samples = rng.lognormal(mean=-1.0, sigma=1.5, size=5000)
    stat = StreamStat()
    for v in samples:
        stat.add(float(v))
    for q in (1, 10, 50, 90, 95, 99, 100):
        exact = float(np.percentile(samples, q, method="inverted_cdf"))
        assert stat.percentile(q) == pytest.approx(exact, rel=StreamStat.RELATIVE_ERROR + 1e-9)
    assert stat.count == 5000 and stat.mean == pytest.approx(float(samples.mean()))
    assert stat.min == float(samples.min()) and stat.max == float(samples.max())


def test_percentile_of_small_sets_and_edge_values() -> None:
    stat = StreamStat()
    assert stat.percentile(50) is None and stat.mean is None
    for v in (4.0, 1.0, 3.0, 2.0):
        stat.add(v)
    assert stat.percentile(50) == pytest.approx(2.0, rel=0.01)
    assert stat.percentile(100) == 4.0  # clamped into the exact max
    zeros = StreamStat()
    for v in (0.0, 1e-9, 0.5):
        zeros.add(v)
    assert zeros.percentile(50) == 0.0 and zeros.percentile(100) == 0.5
    with pytest.raises(ValueError):
        zeros.add(math.nan)
    with pytest.raises(ValueError):
        zeros.percentile(0)


def test_latency_clock_starts_at_control_acceptance_not_at_condition_ingress() -> None:
    m = session()
    m.on_chunk(record(0, 10.0, condition_submitted=0.0, condition_ready=1.0, control_accepted=9.7))
    m.on_chunk(record(1, 11.0, condition_submitted=2.0, control_accepted=10.6))
    m.on_chunk(record(2, 12.0, control_accepted=None))  # no anchor: no latency sample
    assert m.latency.count == 2
    assert m.latency.max == pytest.approx(0.4) and m.latency.min == pytest.approx(0.3)


def test_chunk_period_is_the_interval_between_emissions() -> None:
    m = session()
    for i, t in enumerate((1.0, 1.5, 2.5, 3.0, 3.5)):
        m.on_chunk(record(i, t))
    period = m.summary().chunk_period_s
    assert period.count == 4
    assert period.mean == pytest.approx(2.5 / 4)
    assert period.max == pytest.approx(1.0)
    assert period.p50 == pytest.approx(0.5, rel=0.01)


def test_the_latest_period_is_known_from_the_second_chunk_warm_up_included() -> None:
    m = session(warmup_chunks=2)
    m.on_chunk(record(0, 1.0))
    assert m.last_period is None
    m.on_chunk(record(1, 1.75))
    assert m.last_period == pytest.approx(0.75)
    m.on_chunk(record(2, 2.25))
    assert m.last_period == pytest.approx(0.5)


def test_compute_fps_counts_lockstep_dit_spans_once_and_excludes_warmup() -> None:
    m = session(warmup_chunks=2)
    m.on_chunk(record(0, 5.0, frames=9, spans=(Span("denoise", 2, "denoise", 1.0, 1.0, 4.0),)))  # slow cold start
    m.on_chunk(record(1, 6.0))
    for i in range(2, 6):
        m.on_chunk(record(i, 6.0 + i))
    compute = m.summary().compute
    # steady chunk: condition 0.1 + denoise 0.2 (extent over ranks 2 and 3, not 0.2 + 0.19) + decode 0.1
    assert (compute.chunks, compute.frames) == (4, 48)
    assert compute.compute_s == pytest.approx(4 * 0.4) and compute.fps_weighted == pytest.approx(48 / (4 * 0.4))
    warm = m.summary().warmup
    assert warm.chunks == 2 and warm.frames == 21
    assert warm.compute_s == pytest.approx(3.0 + 0.1 + 0.4)  # chunk 0: its denoise span, decode from stage times
    assert warm.latency_s == (pytest.approx(0.5), pytest.approx(0.5))
    assert m.latency.count == 4 and m.period.count == 4  # warm-up chunks are out of the steady statistics


def test_compute_falls_back_to_stage_times_without_spans() -> None:
    r = record(0, 1.0, spans=())
    assert compute_seconds(r) == pytest.approx(0.2 + 0.1)  # denoise and decode times; condition unknown


def test_record_latency_window_and_stage_times_come_from_the_scheduler_times() -> None:
    times = ChunkTimes(control_accepted=1.0, condition_submitted=0.5, condition_ready=0.9, denoise_start=1.1,
                       denoise_end=1.3, decode_start=1.35, decode_end=1.45, emitted=1.5)
    got = ChunkFacts(4, 12, ChunkControl(), times)
    assert got.times.control_to_output == pytest.approx(0.5) and window(got) == (0.5, 1.5)
    assert compute_seconds(got) == pytest.approx(0.2 + 0.1)  # no spans: denoise and decode times
    no_control = ChunkFacts(5, 12, ChunkControl(), ChunkTimes(None, 0.5, 0.9, 1.1, 1.3, 1.35, 1.45, 1.6))
    assert no_control.times.control_to_output is None and window(no_control) == (0.5, 1.6)


def test_real_time_factor_is_p95_period_over_chunk_media_duration() -> None:
    m = session()
    for i in range(100):
        m.on_chunk(record(i, 0.5 * i + (0.3 if i == 99 else 0.0)))
    media = 12 / FPS
    assert m.summary().chunk_media_s == pytest.approx(media)
    assert m.real_time_factor() == pytest.approx(0.5 / media, rel=0.01)  # the one slow period is above p95


def test_dit_idle_totals_and_fractions_by_cause() -> None:
    m = session()
    m.on_idle(1.0, 1.5, IdleCause.CONTROL)
    m.on_idle(2.0, 2.25, "condition")
    m.on_idle(3.0, 4.0, IdleCause.CONTROL)
    m.close(10.0)
    idle = m.summary().dit_idle
    assert idle.total_s == pytest.approx(1.75) and idle.fraction == pytest.approx(0.175)
    by = idle.by_cause
    assert by.control == IdleShare(count=2, total_s=1.5, fraction=0.15)
    assert by.condition == IdleShare(count=1, total_s=0.25, fraction=0.025)
    assert by.edge.count == 0 and by.no_session.total_s == 0.0
    with pytest.raises(ValueError):
        m.on_idle(5.0, 6.0, "bored")
    with pytest.raises(ValueError):
        m.on_idle(6.0, 5.0, "edge")


def test_condition_prefetch_wait_counts_from_the_later_of_control_and_previous_denoise() -> None:
    m = session()
    m.on_chunk(record(0, 2.0, control_accepted=1.0, condition_ready=1.25, denoise_end=1.8))  # waited 0.25
    m.on_chunk(record(1, 3.0, control_accepted=1.5, condition_ready=1.9, denoise_end=2.8))  # DiT free at 1.8: 0.1
    m.on_chunk(record(2, 4.0, control_accepted=3.5, condition_ready=2.0))  # condition was early: 0
    wait = m.summary().condition_prefetch_wait_s
    assert wait.count == 3 and wait.total == pytest.approx(0.35)
    assert wait.max == pytest.approx(0.25) and wait.min == 0.0


def test_time_to_first_frame_from_open_and_from_first_control() -> None:
    m = SessionMetrics("s", opened_at=100.0, fps=FPS)
    assert m.summary().time_to_first_frame_s == TimeToFirstFrame(from_open=None, from_first_control=None)
    m.on_chunk(record(0, 104.0, control_accepted=103.0))
    m.on_chunk(record(1, 105.0))
    assert m.summary().time_to_first_frame_s == TimeToFirstFrame(from_open=4.0, from_first_control=1.0)


def test_out_of_order_chunks_are_refused() -> None:
    m = session()
    m.on_chunk(record(3, 5.0))
    with pytest.raises(ValueError):
        m.on_chunk(record(3, 6.0))
    with pytest.raises(ValueError):
        m.on_chunk(record(4, 4.0))


def test_peak_memory_keeps_the_maximum_per_rank() -> None:
    m = session()
    m.on_memory(2, 100)
    m.on_memory(2, 50)
    m.on_memory(0, 7)
    assert m.summary().peak_memory_bytes == {"0": 7, "2": 100}


def test_memory_stays_bounded_over_100k_chunks() -> None:
    server = ServerMetrics(started_at=0.0, fps=FPS, keep_last=16)
    server.on_open("long", now=0.0)
    m = server.sessions["long"]
    rng = np.random.default_rng(1)
    jitter = rng.lognormal(-3.0, 1.0, size=1000)
    sizes = []
    t = 0.0
    try:
        for i in range(100_000):
            t += 0.4 + float(jitter[i % 1000])
            server.on_chunk("long", record(i, t), {})
            if i % 1000 == 0:
                server.on_idle(t - 0.1, t - 0.05, IdleCause.CONTROL, (("long", IdleCause.CONTROL),))
            if i == 80_000:  # trace allocations over the last 20k chunks only (tracemalloc is slow)
                sizes.append(m.state_size())
                tracemalloc.start()
                before, _ = tracemalloc.get_traced_memory()
        sizes.append(m.state_size())
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sizes[0] == sizes[1]
    assert sizes[1] <= 3 * (StreamStat.MAX_BUCKETS + 1) + 16 + 2
    assert after - before < 64 * 1024  # one retained record per chunk would be megabytes
    assert len(list(m.recent())) == 16 and server.chunks_emitted == 100_000


def test_session_and_server_summaries_are_json_serialisable() -> None:
    server = ServerMetrics(started_at=0.0, fps=FPS)
    server.on_open("empty", now=0.5)
    server.on_open("busy", now=1.0)
    for i in range(5):
        server.on_chunk("busy", record(i, 2.0 + i), {1: {"rss": 1, "peak_rss": 2**33, "cuda_peak": 0}})
    server.on_idle(0.0, 0.5, IdleCause.NO_SESSION)
    server.on_reject("stale_revision")
    server.on_error("decode_failed")
    stats = server.stats(now=10.0)
    json.dumps(to_builtins(stats), allow_nan=False)
    live = msgspec.json.decode(msgspec.json.encode(stats), type=ServerStats)  # what a client reads
    assert live == stats and live.sessions == SessionCounts(open=2, total=2)
    assert live.chunks_emitted == 5 and live.frames_emitted == 60
    assert live.rejects == {"stale_revision": 1} and live.errors == {"decode_failed": 1}
    assert live.dit_idle and live.dit_idle.by_cause.no_session.fraction == pytest.approx(0.05)
    assert set(live.per_session) == {"empty", "busy"}
    busy = live.per_session["busy"]
    assert busy.recent_chunks[0].control and busy.recent_chunks[0].control.keys == {"w"}
    assert busy.peak_memory_bytes == {"1": 2**33}
    final = server.closing("busy", now=9.0)
    server.on_close("busy", now=9.0)
    json.dumps(to_builtins(final), allow_nan=False)
    assert final.closed_at == 9.0 and final.chunks == 5 and final.elapsed_s == 8.0
    assert server.stats(now=11.0).sessions == SessionCounts(open=1, total=2)


def test_server_counters_by_reason_are_capped() -> None:
    server = ServerMetrics(started_at=0.0, fps=FPS, max_reasons=4)
    for i in range(10):
        server.on_reject(f"reason{i}")
    rejects = server.stats(now=1.0).rejects
    assert len(rejects) == 4 and rejects[OTHER_REASON] == 7
    with pytest.raises(KeyError):
        server.on_chunk("nope", record(0, 1.0), {})
    server.on_open("a", now=0.0)
    with pytest.raises(ValueError):
        server.on_open("a", now=0.0)
