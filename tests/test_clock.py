"""Clock offsets from NTP-style round trips: skew recovery, drift following, bad samples refused."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.clock import ClockSample, ClockSync


def ping(rng: np.random.Generator, t0: float, skew: float) -> tuple[float, float, float, float]:
    """One round trip with random, asymmetric one-way delays and worker processing time."""
    there = 50e-6 + rng.exponential(2e-3)
    back = 80e-6 + rng.exponential(5e-3)
    work = rng.uniform(0, 1e-3)
    t1 = t0 + there + skew  # worker clock = rank-0 clock + skew
    t2 = t1 + work
    t3 = t2 - skew + back
    return t0, t1, t2, t3


def test_recovers_injected_skew_within_a_millisecond_from_asymmetric_delays() -> None:
    rng = np.random.default_rng(7)
    skews = {1: 3.2178, 2: -41.5, 3: 0.0007}
    sync = ClockSync()
    for rank, skew in skews.items():
        for k in range(50):
            sync.add(rank, *ping(rng, 100.0 + 0.1 * k, skew))
    for rank, skew in skews.items():
        error = abs(sync.offset(rank) - skew)
        assert error < 1e-3
        assert error <= sync.uncertainty(rank) + 1e-12
        assert sync.to_rank0(rank, 500.0 + skew) == pytest.approx(500.0, abs=1e-3)
    assert sync.ranks() == (1, 2, 3)


def test_keeps_the_sample_with_the_smallest_round_trip() -> None:
    sync = ClockSync()
    sync.add(1, 0.0, 10.001, 10.001, 0.010)  # rtt 10 ms, offset 9.996
    sync.add(1, 1.0, 11.0005, 11.0005, 1.001)  # rtt 1 ms, offset 10.0
    sync.add(1, 2.0, 12.004, 12.004, 2.005)  # rtt 5 ms
    assert sync.offset(1) == pytest.approx(10.0)
    assert sync.uncertainty(1) == pytest.approx(0.0005)


def test_a_bounded_window_follows_clock_drift() -> None:
    sync = ClockSync(window=4)
    sync.add(1, 0.0, 5.0001, 5.0001, 0.0002)  # very good sample at offset 5
    for k in range(4):
        t0 = 10.0 + k
        sync.add(1, t0, t0 + 0.001 + 5.5, t0 + 0.001 + 5.5, t0 + 0.002)  # later samples: the clock drifted to 5.5
    assert sync.offset(1) == pytest.approx(5.5)


def test_rank0_is_the_reference_and_unknown_ranks_raise() -> None:
    sync = ClockSync()
    assert sync.offset(0) == 0.0 and sync.to_rank0(0, 3.0) == 3.0
    with pytest.raises(KeyError, match="rank 4"):
        sync.to_rank0(4, 1.0)
    with pytest.raises(ValueError):
        sync.add(0, 0.0, 0.0, 0.0, 0.0)


@pytest.mark.parametrize(
    "sample",
    [(1.0, 5.0, 4.0, 2.0), (2.0, 5.0, 5.0, 1.0), (0.0, 5.0, 8.0, 1.0)],  # reply before receipt; t3 < t0; rtt < 0
)
def test_inconsistent_samples_are_refused_and_change_nothing(sample: tuple[float, float, float, float]) -> None:
    sync = ClockSync()
    sync.add(1, 0.0, 2.0, 2.0, 0.0)
    with pytest.raises(ValueError):
        sync.add(1, *sample)
    assert sync.offset(1) == 2.0


def test_sample_offset_and_round_trip_formulas() -> None:
    s = ClockSample(t0=1.0, t1=11.2, t2=11.3, t3=1.6)
    assert s.offset == pytest.approx(((11.2 - 1.0) + (11.3 - 1.6)) / 2)
    assert s.round_trip == pytest.approx(0.5)
