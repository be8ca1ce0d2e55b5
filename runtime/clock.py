"""Clock offsets of the worker ranks relative to rank 0, estimated from control-plane round trips (NTP style).

Pure: the caller takes the four timestamps and hands them in. One sample is a ping from rank 0 to a worker:

    t0  rank 0 sends           (rank-0 clock)
    t1  the worker receives    (worker clock)
    t2  the worker replies     (worker clock)
    t3  rank 0 receives        (rank-0 clock)

    offset     = ((t1 - t0) + (t2 - t3)) / 2     worker clock minus rank-0 clock
    round_trip = (t3 - t0) - (t2 - t1)           time on the wire, both ways

Rules:

- The estimate of a rank is the sample with the smallest round trip among its last ``window`` samples: its error
  is at most ``round_trip / 2`` (reported as ``uncertainty``), whatever the asymmetry of the two delays. Keeping
  only a recent window lets the estimate follow slow clock drift; memory per rank is bounded by ``window``.
- A sample with a negative round trip or a reply before its receipt is rejected (``ValueError``), nothing stored.
- Rank 0 is the reference: offset 0, uncertainty 0. Converting for a rank with no sample raises ``KeyError``.
- ``to_rank0(rank, t) = t - offset(rank)``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ipc.metrics_types import ClockOffset


@dataclass(frozen=True)
class ClockSample:
    """One round trip between rank 0 and a worker (see the module docstring)."""

    t0: float
    t1: float
    t2: float
    t3: float

    def __post_init__(self) -> None:
        if self.t2 < self.t1 or self.t3 < self.t0 or self.round_trip < 0:
            raise ValueError(f"inconsistent clock sample {self}: need t1 <= t2, t0 <= t3 and a round trip >= 0")

    @property
    def offset(self) -> float:
        return ((self.t1 - self.t0) + (self.t2 - self.t3)) / 2

    @property
    def round_trip(self) -> float:
        return (self.t3 - self.t0) - (self.t2 - self.t1)


class ClockSync:
    """Per-rank clock offsets from round-trip samples; converts worker timestamps to rank-0 time."""

    def __init__(self, window: int = 64) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._samples: dict[int, deque[ClockSample]] = {}
        self._best: dict[int, ClockSample] = {}

    def add(self, rank: int, t0: float, t1: float, t2: float, t3: float) -> ClockSample:
        """Record one round trip with ``rank``; returns the sample. Samples for rank 0 are refused."""
        if rank == 0:
            raise ValueError("rank 0 is the reference clock; it takes no samples")
        sample = ClockSample(t0, t1, t2, t3)
        samples = self._samples.setdefault(rank, deque(maxlen=self.window))
        samples.append(sample)
        self._best[rank] = min(samples, key=lambda s: s.round_trip)
        return sample

    def ranks(self) -> tuple[int, ...]:
        """Ranks with at least one sample."""
        return tuple(sorted(self._best))

    def offset(self, rank: int) -> float:
        """Worker clock minus rank-0 clock, seconds."""
        return 0.0 if rank == 0 else self._sample(rank).offset

    def uncertainty(self, rank: int) -> float:
        """Bound on the offset error: half the round trip of the sample in use."""
        return 0.0 if rank == 0 else self._sample(rank).round_trip / 2

    def to_rank0(self, rank: int, t: float) -> float:
        """A timestamp of ``rank``'s clock expressed on rank 0's clock."""
        return t - self.offset(rank)

    def offsets(self) -> dict[str, ClockOffset]:
        """Each rank's offset and its uncertainty, by rank as text (a summary's and the stats' ``clock_offsets``)."""
        return {str(r): ClockOffset(offset_s=self.offset(r), uncertainty_s=self.uncertainty(r)) for r in self.ranks()}

    def _sample(self, rank: int) -> ClockSample:
        try:
            return self._best[rank]
        except KeyError:
            raise KeyError(f"no clock sample for rank {rank}; ranks with samples: {list(self.ranks())}") from None
