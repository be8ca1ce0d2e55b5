"""Smoke test of the benchmark A/B (issue 3: "the two schedules give identical frames").

Plays the first 6 chunks of the recorded trace on a serial and a prefetch server (7 ranks each, synthetic
stages E/D/V = 50/120/60 ms) and checks that the frames are bit-identical and that prefetch streams faster.
Starts two servers: skip it with ``-m "not multiprocess"``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.bench_common import DEFAULT_IMAGE, DEFAULT_TRACE, Costs, Play, compare_frames, serve_and_play, summarize

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

CHUNKS = 6


def test_serial_and_prefetch_give_identical_frames_and_prefetch_streams_faster(tmp_path: Path) -> None:
    costs = Costs.from_unit(0.2)
    serial, prefetch = (
        serve_and_play("cpu-tiny", mode, costs.overrides(), [Play(mode)], DEFAULT_IMAGE, DEFAULT_TRACE, CHUNKS,
                       log_dir=tmp_path)[0]
        for mode in ("serial", "prefetch")
    )
    assert [c["index"] for c in serial.chunks] == list(range(CHUNKS))
    assert [c["index"] for c in prefetch.chunks] == list(range(CHUNKS))
    assert compare_frames(serial, prefetch) == [], "serial and prefetch frames must be bit-identical"
    serial_period = summarize(serial, warmup=2)["period_s"]["mean"]
    prefetch_period = summarize(prefetch, warmup=2)["period_s"]["mean"]
    assert prefetch_period < serial_period, (prefetch_period, serial_period)
