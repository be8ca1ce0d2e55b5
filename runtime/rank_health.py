"""Rank health on rank 0 (sans-io): pings out, beats in, each rank's clock offset and memory, and the deadlines that
end the job (a rank silent for ``timeouts.rank_dead_s``, a task whose join is older than ``timeouts.stage_s``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

from ipc import protocol
from ipc.protocol import Phase
from runtime.clock import ClockSync
from runtime.config import TimeoutsConfig
from runtime.core_types import JobFailed, MemorySampled, ToWorker
from runtime.placement import HEARTBEAT, identity
from runtime.session import Session


class RankHealth:
    """What rank 0 knows of every rank's life; ``check`` raises ``JobFailed`` when a deadline passed."""

    def __init__(self, heartbeat_ranks: Iterable[int], timeouts: TimeoutsConfig, now: float) -> None:
        self.timeouts = timeouts
        self.clock = ClockSync()
        self.last_beat = {rank: now for rank in heartbeat_ranks}
        self.memory: dict[int, dict[str, int]] = {}  # each rank's latest memory sample
        self.ping_seq = 0
        self.next_ping = now

    def beat(self, beat: protocol.Beat, now: float) -> None:
        self.last_beat[beat.rank] = now
        with contextlib.suppress(ValueError):  # an impossible sample (clock step): keep the estimate
            self.clock.add(beat.rank, beat.echo, beat.received, beat.sent, now)
        self.memory[beat.rank] = {"rss": beat.rss, "peak_rss": beat.peak_rss, "cuda_peak": beat.cuda_peak}

    def sampled(self, event: MemorySampled) -> None:
        """Rank 0's own sample (it has no heartbeat thread)."""
        self.memory[event.rank] = {"rss": event.rss, "peak_rss": event.peak_rss, "cuda_peak": event.cuda_peak}

    def pings(self, now: float) -> list[ToWorker]:
        """Every heartbeat rank's ping when one is due (the beats answer them), else none."""
        if now < self.next_ping:
            return []
        self.next_ping = now + self.timeouts.heartbeat_s
        ping = protocol.Ping(seq=self.ping_seq, sent=now)
        self.ping_seq += 1
        return [ToWorker(identity(rank, HEARTBEAT), ping) for rank in self.last_beat]

    def check(self, sessions: Iterable[Session], now: float) -> None:
        """``JobFailed`` for a rank silent too long or a session's task past ``timeouts.stage_s``."""
        for rank, seen in self.last_beat.items():
            if now - seen > self.timeouts.rank_dead_s:
                raise JobFailed(f"rank {rank} stopped answering (silent for {now - seen:.1f} s)")
        for session in sessions:
            for (stage, phase, index), join in session.joins.items():
                if now - join.sent > self.timeouts.stage_s:
                    ranks = ", ".join(str(rank) for _, rank in sorted(join.waiting))
                    what = f"{stage.value} of chunk {index}" if phase is Phase.CHUNK else f"{stage.value} {phase.value}"
                    if phase is Phase.CHUNK and index < 0:  # a NewPrompt's encode
                        what = f"encode of prompt revision {protocol.revision_of(index)}"
                    raise JobFailed(f"rank {ranks} did not finish the {what} of session {session.id} within "
                                    f"{self.timeouts.stage_s:.0f} s")
