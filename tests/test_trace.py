"""Chrome/Perfetto trace export of a simulated multi-rank run, with worker clocks converted to rank 0's."""

from __future__ import annotations

import json

import msgspec
import numpy as np

from ipc.protocol import ChunkControl, ChunkFacts, ChunkTimes, Span
from runtime.clock import ClockSync
from runtime.trace import ROLE_TIDS, chrome_trace, spans_outside_window

SKEWS = {1: 12.5, 2: -3.25, 3: 0.75}  # worker clock minus rank-0 clock
ROLES = {0: "condition", 1: "decode", 2: "denoise", 3: "denoise"}


def synced_clock(rng: np.random.Generator) -> ClockSync:
    sync = ClockSync()
    for rank, skew in SKEWS.items():
        for k in range(40):
            t0 = 0.05 * k
            t1 = t0 + 1e-4 + rng.exponential(1e-3) + skew
            t2 = t1 + rng.uniform(0, 2e-4)
            sync.add(rank, t0, t1, t2, t2 - skew + 1e-4 + rng.exponential(3e-3))
    return sync


def simulate(sync: ClockSync | None, rng: np.random.Generator) -> list[tuple[str, ChunkFacts]]:
    """Two interleaved sessions, 6 chunks each; spans timed on each worker's clock, then converted."""

    def span(name: str, rank: int, queued: float, start: float, end: float) -> Span:
        to0 = (lambda t: sync.to_rank0(rank, t)) if sync is not None else (lambda t: t)
        skew = SKEWS.get(rank, 0.0)
        return Span(name, rank, ROLES[rank], to0(queued + skew), to0(start + skew), to0(end + skew))

    out = []
    t = 1.0
    for i in range(6):
        for session in ("alice", "bob"):
            submitted, accepted = t, t + 0.05
            enc_end = submitted + 0.04
            den_start = max(enc_end, accepted) + 0.01
            den_end = den_start + 0.2 + rng.uniform(0, 0.02)
            dec_start = den_end + 0.02
            dec_end = dec_start + 0.08
            spans = (
                span("condition", 0, submitted, submitted + 0.005, enc_end),
                span("transfer:condition", 2, enc_end, den_start - 0.008, den_start - 0.002),
                span("denoise", 2, den_start - 0.002, den_start, den_end),
                span("denoise", 3, den_start - 0.002, den_start, den_end),
                span("transfer:latent", 1, den_end, den_end + 0.002, dec_start - 0.002),
                span("decode", 1, dec_start, dec_start, dec_end),
            )
            times = ChunkTimes(
                control_accepted=accepted, condition_submitted=submitted, condition_ready=enc_end,
                denoise_start=den_start, denoise_end=den_end, decode_start=dec_start, decode_end=dec_end,
                emitted=dec_end + 0.01,
            )
            control = ChunkControl(keys=frozenset("w"), revision=i)
            out.append((session, ChunkFacts(index=i, frames=12, times=times, control=control, spans=spans)))
            t = den_end
    return out


def test_export_is_valid_chrome_trace_json_with_one_track_per_rank_and_role() -> None:
    rng = np.random.default_rng(3)
    chunks = simulate(synced_clock(rng), rng)
    trace = json.loads(json.dumps(chrome_trace(chunks), allow_nan=False))
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    for e in events:
        assert e["ph"] in ("X", "M") and isinstance(e["name"], str)
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float))
            assert e["ts"] >= 0 and e["dur"] >= 0
    complete = [e for e in events if e["ph"] == "X"]
    meta = [e for e in events if e["ph"] == "M"]
    processes = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert processes == {r: f"rank {r}" for r in (0, 1, 2, 3)}
    assert set(threads) == {(e["pid"], e["tid"]) for e in complete}  # every track is named
    assert threads[(2, ROLE_TIDS["denoise"])] == "denoise" and threads[(0, ROLE_TIDS["chunks"])] == "chunks"
    names = {e["name"] for e in complete}
    assert {"denoise alice#0", "decode bob#5", "transfer:latent alice#3", "chunk bob#2"} <= names
    assert len(complete) == len(chunks) * 7  # 6 spans + 1 window per chunk


def test_every_span_lies_inside_its_chunk_window_after_clock_conversion() -> None:
    rng = np.random.default_rng(4)
    sync = synced_clock(rng)
    chunks = simulate(sync, rng)
    slack = max(sync.uncertainty(r) for r in SKEWS)
    assert all(not spans_outside_window(record, slack) for _, record in chunks)
    trace = chrome_trace(chunks)
    windows = {(e["args"]["session"], e["args"]["chunk"]): (e["ts"], e["ts"] + e["dur"])
               for e in trace["traceEvents"] if e.get("cat") == "chunk"}  # type: ignore[union-attr]
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e.get("cat") != "chunk"]  # type: ignore[index]
    assert len(windows) == len(chunks) and len(spans) == len(chunks) * 6
    for e in spans:
        start, end = windows[(e["args"]["session"], e["args"]["chunk"])]
        assert start - slack * 1e6 - 1 <= e["ts"] and e["ts"] + e["dur"] <= end + slack * 1e6 + 1


def test_unconverted_worker_timestamps_fall_outside_their_windows() -> None:
    rng = np.random.default_rng(5)
    chunks = simulate(None, rng)  # worker clocks left as they are
    outside = {(s.rank, s.name) for _, record in chunks for s in spans_outside_window(record)}
    assert {r for r, _ in outside} == set(SKEWS)  # every skewed worker rank, never rank 0


def test_a_change_of_steps_is_an_instant_event_at_the_chunk_where_it_took_effect() -> None:
    chunks = simulate(None, np.random.default_rng(0))
    session, record = chunks[4]
    chunks[4] = (session, msgspec.structs.replace(record, steps=2, steps_changed="ladder_down"))
    trace = chrome_trace(chunks, origin=0.0)
    (event,) = [e for e in trace["traceEvents"] if e.get("cat") == "steps"]  # type: ignore[union-attr]
    assert event["ph"] == "i" and event["name"] == f"steps 2 (ladder_down) {session}#{record.index}"
    assert event["ts"] == round(record.times.denoise_start * 1e6, 3) and event["tid"] == ROLE_TIDS["chunks"]
    assert event["args"]["why"] == "ladder_down"
