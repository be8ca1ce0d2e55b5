"""Per-chunk records, per-session summaries and server counters: the metrics contract of DESIGN.md section 8.

Pure and clock-free: every time is given in as rank-0 seconds (worker timestamps are converted with
``runtime.clock.ClockSync`` before they get here). The coordinator feeds, per session, the ``ChunkFacts`` of each
emitted chunk (in emission order; the same value the client receives), the DiT idle intervals and the ranks' peak
memory; ``summary`` gives the typed summary (``ipc.metrics_types.SessionSummary``) returned on close and in a live
``stats`` reply. ``ServerMetrics`` is one ``MetricsObserver`` of the core's events (the Prometheus exporter is
another); the core feeds each event once, to every observer (``Observers``).

Rules:

- **Latency anchor.** Control-to-output latency of chunk i = ``emitted - control_accepted``: the clock starts
  when control[i] was accepted, never at a condition-only ingress. A chunk without ``control_accepted`` adds no
  latency sample.
- **Warm-up.** Chunks with ``index < warmup_chunks`` are warm-up: they are excluded from the steady statistics
  (latency, period, compute FPS, prefetch wait) and reported on their own under ``warmup``. Time to first frame
  covers the cold start. The period of the first steady chunk is measured from the last warm-up emission.
- **Compute seconds of a chunk** = sum over the condition, denoise and decode stages of the stage's extent (latest
  span end minus earliest span start of that stage, so the lockstep spans of a DiT group count once, not once per
  rank); a stage with no span falls back to its ``*_start``/``*_end`` times when given. Transfers are not compute.
  Compute FPS (weighted) = sum of frames / sum of compute seconds.
- **Real-time factor** = p95 chunk period / chunk media duration, the media duration being the mean frames per
  steady chunk divided by ``fps``; below 1 the stream keeps up.
- **Condition prefetch wait** of chunk i = ``max(0, condition_ready - max(control_accepted, denoise_end of
  chunk i-1))``: how long the DiT, free and holding the control, still waited for the condition.
- **DiT idle** intervals carry a cause (``IdleCause``); totals, counts and fraction of the elapsed time by cause.
- **Bounded memory.** Nothing grows with session length: each distribution is a ``StreamStat`` (exact count,
  sum, min, max; percentiles from a log-bucketed histogram with at most ``StreamStat.MAX_BUCKETS`` buckets), the
  last ``keep_last`` chunk records are kept, counters by reason are capped at ``max_reasons`` distinct names.

Percentile error: percentiles use the nearest-rank definition (the ceil(q/100 * n)-th smallest sample). The
histogram returns that sample within a relative error of ``StreamStat.RELATIVE_ERROR`` (1%) for values in
[1 microsecond, 1e5 s]; smaller values (including negatives from clock-offset noise) read as 0, values above
1e5 s read as at most 1e5 s. Every reported percentile is further clamped into the exact [min, max].
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Protocol

from ipc.metrics_types import (
    Compute,
    Distribution,
    Idle,
    IdleByCause,
    IdleCause,
    IdleShare,
    RecentChunk,
    ServerStats,
    SessionCounts,
    SessionSummary,
    TimeToFirstFrame,
    WarmUpCompute,
)
from ipc.protocol import ChunkFacts, Stage
from runtime.parts import Answer, Part

COMPUTE_STAGES = tuple(stage.value for stage in Stage)  # condition, denoise, decode
REPORTED_PERCENTILES = (50, 90, 99)


class StreamStat:
    """Exact count/sum/min/max plus a log-bucketed histogram for percentiles, in constant memory.

    A positive value v lands in bucket ``ceil(log_gamma(v))`` with ``gamma = (1 + a) / (1 - a)``; the bucket's
    representative ``2 gamma^i / (gamma + 1)`` is within relative error ``a`` of every value in the bucket.
    """

    RELATIVE_ERROR = 0.01
    MIN_VALUE = 1e-6  # values at or below read as 0
    MAX_VALUE = 1e5  # values above share the top bucket
    _GAMMA = (1 + RELATIVE_ERROR) / (1 - RELATIVE_ERROR)
    _LOG_GAMMA = math.log(_GAMMA)
    _LOW = math.ceil(math.log(MIN_VALUE) / _LOG_GAMMA)
    _HIGH = math.ceil(math.log(MAX_VALUE) / _LOG_GAMMA)
    MAX_BUCKETS = _HIGH - _LOW + 1

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.min = math.inf
        self.max = -math.inf
        self._zero = 0  # values <= MIN_VALUE
        self._buckets: dict[int, int] = {}

    def add(self, value: float) -> None:
        if not math.isfinite(value):
            raise ValueError(f"metric sample must be finite, got {value}")
        self.count += 1
        self.total += value
        self.min = min(self.min, value)
        self.max = max(self.max, value)
        if value <= self.MIN_VALUE:
            self._zero += 1
            return
        index = min(max(math.ceil(math.log(value) / self._LOG_GAMMA), self._LOW), self._HIGH)
        self._buckets[index] = self._buckets.get(index, 0) + 1

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def percentile(self, q: float) -> float | None:
        """The nearest-rank q-th percentile (0 < q <= 100) within the documented error; None when empty."""
        if not 0 < q <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {q}")
        if not self.count:
            return None
        rank = max(1, math.ceil(q / 100 * self.count))
        if rank <= self._zero:
            estimate = 0.0
        else:
            seen = self._zero
            estimate = self.max
            for index in sorted(self._buckets):
                seen += self._buckets[index]
                if seen >= rank:
                    estimate = 2 * self._GAMMA**index / (self._GAMMA + 1)
                    break
        return min(max(estimate, self.min), self.max)

    def state_size(self) -> int:
        """Number of stored histogram buckets (bounded by ``MAX_BUCKETS + 1``)."""
        return len(self._buckets) + 1

    def distribution(self, p95: bool = False, total: bool = False) -> Distribution:
        """The reported figures; ``p95`` and ``total`` add the 95th percentile and the sum."""
        return Distribution(
            count=self.count, mean=self.mean, min=self.min if self.count else None,
            max=self.max if self.count else None, **{f"p{q}": self.percentile(q) for q in REPORTED_PERCENTILES},
            **({"p95": self.percentile(95)} if p95 else {}), **({"total": self.total} if total else {}))


def stage_extent(facts: ChunkFacts, stage: str) -> tuple[float, float] | None:
    """(earliest start, latest end) of one stage's spans over every rank; falls back to the chunk's times for the
    denoise and decode stages; None when unknown."""
    spans = [s for s in facts.spans if s.name == stage]
    if spans:
        return min(s.start for s in spans), max(s.end for s in spans)
    t = facts.times
    return {"denoise": (t.denoise_start, t.denoise_end), "decode": (t.decode_start, t.decode_end)}.get(stage)


def stage_seconds(facts: ChunkFacts, stage: str) -> float:
    """Extent of one stage (see the module rules); 0 when unknown."""
    extent = stage_extent(facts, stage)
    return 0.0 if extent is None else extent[1] - extent[0]


def compute_seconds(facts: ChunkFacts) -> float:
    return sum(stage_seconds(facts, stage) for stage in COMPUTE_STAGES)


def window(facts: ChunkFacts) -> tuple[float, float]:
    """The chunk's lifetime: from the earlier of control accepted / condition submitted to emission."""
    t = facts.times
    start = t.condition_submitted if t.control_accepted is None else min(t.control_accepted, t.condition_submitted)
    return (start, t.emitted)


def brief(facts: ChunkFacts) -> RecentChunk:
    """A chunk in a session summary's ``recent_chunks``."""
    return RecentChunk(index=facts.index, emitted=facts.times.emitted, frames=facts.frames,
                       latency_s=facts.times.control_to_output, compute_s=compute_seconds(facts), control=facts.control)


class _IdleTotals:
    def __init__(self) -> None:
        self.count = {c: 0 for c in IdleCause}
        self.seconds = {c: 0.0 for c in IdleCause}

    def add(self, start: float, end: float, cause: IdleCause | str) -> None:
        cause = IdleCause(cause)
        if end < start:
            raise ValueError(f"idle interval ends before it starts: {start} > {end}")
        self.count[cause] += 1
        self.seconds[cause] += end - start

    def idle(self, elapsed: float | None) -> Idle:
        total = sum(self.seconds.values())

        def fraction(seconds: float) -> float | None:
            return seconds / elapsed if elapsed else None

        by_cause = IdleByCause(**{c.value: IdleShare(count=self.count[c], total_s=self.seconds[c],
                                                     fraction=fraction(self.seconds[c])) for c in IdleCause})
        return Idle(total_s=total, fraction=fraction(total), by_cause=by_cause)


class _Compute:
    def __init__(self) -> None:
        self.chunks = 0
        self.frames = 0
        self.seconds = 0.0

    def add(self, facts: ChunkFacts) -> None:
        self.chunks += 1
        self.frames += facts.frames
        self.seconds += compute_seconds(facts)

    def compute(self) -> Compute:
        return Compute(chunks=self.chunks, frames=self.frames, compute_s=self.seconds, fps_weighted=self.fps())

    def fps(self) -> float | None:
        return self.frames / self.seconds if self.seconds > 0 else None


class SessionMetrics:
    """Streaming metrics of one session; feed ``on_chunk`` in emission order. See the module rules."""

    def __init__(
        self, session: str, opened_at: float, fps: float, warmup_chunks: int = 2, keep_last: int = 16
    ) -> None:
        if fps <= 0 or warmup_chunks < 0 or keep_last < 0:
            raise ValueError(f"need fps > 0, warmup_chunks >= 0, keep_last >= 0; got {fps}, {warmup_chunks}, "
                             f"{keep_last}")
        self.session = session
        self.opened_at = opened_at
        self.fps = fps
        self.warmup_chunks = warmup_chunks
        self.closed_at: float | None = None
        self.latency = StreamStat()
        self.period = StreamStat()
        self.prefetch_wait = StreamStat()
        self.steady = _Compute()
        self.warmup = _Compute()
        self.idle = _IdleTotals()
        self.peak_memory: dict[int, int] = {}  # rank -> bytes (bounded by the world size)
        self._warmup_latencies: list[float | None] = []  # at most warmup_chunks entries
        self._recent: deque[ChunkFacts] = deque(maxlen=keep_last)
        self._last_index = -1
        self._last_emitted: float | None = None
        self._last_period: float | None = None  # between the last two emissions, warm-up included
        self._last_denoise_end: float | None = None
        self._first_emitted: float | None = None
        self._first_control: float | None = None

    def on_chunk(self, record: ChunkFacts) -> None:
        """Fold in one emitted chunk. Chunks must come in increasing index order (ordered emission)."""
        if record.index <= self._last_index:
            raise ValueError(f"session {self.session}: chunk {record.index} after chunk {self._last_index}")
        if self._last_emitted is not None and record.times.emitted < self._last_emitted:
            raise ValueError(f"session {self.session}: chunk {record.index} emitted before chunk {self._last_index}")
        warm = record.index < self.warmup_chunks
        latency = record.times.control_to_output
        if warm:
            self.warmup.add(record)
            self._warmup_latencies.append(latency)
        else:
            self.steady.add(record)
            if latency is not None:
                self.latency.add(latency)
            if self._last_emitted is not None:
                self.period.add(record.times.emitted - self._last_emitted)
            wait = self._prefetch_wait(record)
            if wait is not None:
                self.prefetch_wait.add(wait)
        if record.times.control_accepted is not None and self._first_control is None:
            self._first_control = record.times.control_accepted
        if self._first_emitted is None:
            self._first_emitted = record.times.emitted
        self._last_index = record.index
        if self._last_emitted is not None:
            self._last_period = record.times.emitted - self._last_emitted
        self._last_emitted = record.times.emitted
        self._last_denoise_end = record.times.denoise_end
        self._recent.append(record)

    def _prefetch_wait(self, record: ChunkFacts) -> float | None:
        anchors = [t for t in (record.times.control_accepted, self._last_denoise_end) if t is not None]
        return max(0.0, record.times.condition_ready - max(anchors)) if anchors else None

    def on_idle(self, start: float, end: float, cause: IdleCause | str) -> None:
        """A DiT idle interval attributed to this session."""
        self.idle.add(start, end, cause)

    def on_memory(self, rank: int, peak_bytes: int) -> None:
        """A rank's peak memory (the maximum reported is kept)."""
        self.peak_memory[rank] = max(self.peak_memory.get(rank, 0), peak_bytes)

    def close(self, at: float) -> None:
        self.closed_at = at

    @property
    def last_emitted(self) -> float | None:
        """When the session's latest chunk was emitted (the start of the next chunk period)."""
        return self._last_emitted

    @property
    def last_period(self) -> float | None:
        """Seconds between the session's last two emitted chunks; None before its second chunk."""
        return self._last_period

    def recent(self) -> Iterator[ChunkFacts]:
        """The last ``keep_last`` chunk records, oldest first (for traces and debugging)."""
        return iter(tuple(self._recent))

    def state_size(self) -> int:
        """Stored items: histogram buckets, recent records, warm-up latencies, memory entries (all bounded)."""
        stats = (self.latency, self.period, self.prefetch_wait)
        return sum(s.state_size() for s in stats) + len(self._recent) + len(self._warmup_latencies) + len(
            self.peak_memory
        )

    def real_time_factor(self) -> float | None:
        p95 = self.period.percentile(95)
        compute = self.steady if self.steady.chunks else self.warmup
        if p95 is None or not compute.chunks or not compute.frames:
            return None
        return p95 / (compute.frames / compute.chunks / self.fps)

    def summary(self, now: float | None = None) -> SessionSummary:
        """The typed summary. ``now`` (rank-0 seconds) bounds the elapsed time of a session still open."""
        end = self.closed_at if self.closed_at is not None else now if now is not None else self._last_emitted
        elapsed = None if end is None else max(0.0, end - self.opened_at)
        first = self._first_emitted
        compute = self.steady if self.steady.chunks else self.warmup
        warmup = self.warmup
        return SessionSummary(
            session=self.session,
            opened_at=self.opened_at,
            closed_at=self.closed_at,
            elapsed_s=elapsed,
            chunks=self.steady.chunks + self.warmup.chunks,
            frames=self.steady.frames + self.warmup.frames,
            time_to_first_frame_s=TimeToFirstFrame(
                from_open=None if first is None else first - self.opened_at,
                from_first_control=None if first is None or self._first_control is None
                else first - self._first_control),
            latency_s=self.latency.distribution(),
            chunk_period_s=self.period.distribution(p95=True),
            compute=self.steady.compute(),
            warmup=WarmUpCompute(chunks=warmup.chunks, frames=warmup.frames, compute_s=warmup.seconds,
                                 fps_weighted=warmup.fps(), latency_s=tuple(self._warmup_latencies)),
            chunk_media_s=compute.frames / compute.chunks / self.fps if compute.chunks else None,
            real_time_factor=self.real_time_factor(),
            dit_idle=self.idle.idle(elapsed),
            condition_prefetch_wait_s=self.prefetch_wait.distribution(total=True),
            peak_memory_bytes={str(rank): b for rank, b in sorted(self.peak_memory.items())},
            percentile_relative_error=StreamStat.RELATIVE_ERROR,
            recent_chunks=tuple(brief(r) for r in self._recent),
        )


OTHER_REASON = "other"


class _Counter:
    """Counts by name, at most ``limit`` distinct names; further names count under ``OTHER_REASON``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.counts: dict[str, int] = {}

    def add(self, name: str) -> None:
        if name not in self.counts and len(self.counts) >= self.limit - 1:
            name = OTHER_REASON
        self.counts[name] = self.counts.get(name, 0) + 1


Memory = Mapping[int, Mapping[str, int]]  # rank -> its latest sample ("rss", "peak_rss", "cuda_peak": bytes)


class MetricsObserver(Protocol):
    """What the coordinator core tells every metrics observer (``ServerMetrics``, ``ranks.prometheus.Exporter``):
    each event once, when it happens, in rank-0 seconds. In memory, no I/O; an observer derives what it reports
    from these alone (nothing is computed in the core for one observer)."""

    def on_open(self, session: str, now: float) -> None:
        """A session was created (opened or restored); its chunks follow."""

    def on_chunk(self, session: str, facts: ChunkFacts, memory: Memory) -> None:
        """A chunk left rank 0 with these facts (in emission order per session); ``memory``: the ranks' now."""

    def on_idle(self, start: float, end: float, cause: str, blocked: tuple[tuple[str, str], ...]) -> None:
        """The DiT sat idle for ``cause``; ``blocked``: (session, its own cause) of every session kept waiting."""

    def on_reject(self, reason: str) -> None:
        """A client message was refused."""

    def on_error(self, kind: str) -> None:
        """Something failed ("stage_failed", "internal")."""

    def on_close(self, session: str, now: float) -> None:
        """A session ended (after its last chunk): its metrics are done."""

    def on_gauges(self, open_sessions: int, memory: Memory) -> None:
        """The periodic turn (every heartbeat): the open sessions and every rank's latest memory."""


class Observers(Part):
    """Every observer of the core, fed as one: each event goes to each observer once, in order. A part of each
    session (``runtime.parts``): its open and its end (closed or dropped: its metrics are bounded by sessions)."""

    def __init__(self, *observers: MetricsObserver) -> None:
        self.observers = observers

    def on_open(self, session: str, now: float) -> None:
        for o in self.observers:
            o.on_open(session, now)

    def on_chunk(self, session: str, facts: ChunkFacts, memory: Memory) -> None:
        for o in self.observers:
            o.on_chunk(session, facts, memory)

    def on_idle(self, start: float, end: float, cause: str, blocked: tuple[tuple[str, str], ...]) -> None:
        for o in self.observers:
            o.on_idle(start, end, cause, blocked)

    def on_reject(self, reason: str) -> None:
        for o in self.observers:
            o.on_reject(reason)

    def on_error(self, kind: str) -> None:
        for o in self.observers:
            o.on_error(kind)

    def on_close(self, session: str, now: float) -> None:
        for o in self.observers:
            o.on_close(session, now)

    def on_gauges(self, open_sessions: int, memory: Memory) -> None:
        for o in self.observers:
            o.on_gauges(open_sessions, memory)

    def opened(self, sid: str, now: float) -> list[Answer]:
        self.on_open(sid, now)
        return []

    def closed(self, sid: str, now: float, reason: str = "") -> list[Answer]:
        self.on_close(sid, now)  # the summary was read before (``ServerMetrics.closing``)
        return []


class ServerMetrics:
    """Server-wide counters and the open sessions' metrics, for the live ``stats`` request and the summary on close
    (a ``MetricsObserver``)."""

    def __init__(self, started_at: float, fps: float, warmup_chunks: int = 2, keep_last: int = 16,
                 max_reasons: int = 32) -> None:
        if max_reasons < 2:
            raise ValueError(f"max_reasons must be >= 2, got {max_reasons}")
        self.started_at = started_at
        self.fps, self.warmup_chunks, self.keep_last = fps, warmup_chunks, keep_last  # of every session
        self.sessions: dict[str, SessionMetrics] = {}  # open sessions only
        self.sessions_total = 0
        self.chunks_emitted = 0
        self.frames_emitted = 0
        self.rejects = _Counter(max_reasons)
        self.errors = _Counter(max_reasons)
        self.idle = _IdleTotals()

    def on_open(self, session: str, now: float) -> None:
        if session in self.sessions:
            raise ValueError(f"session {session} is already open")
        self.sessions[session] = SessionMetrics(session, now, self.fps, self.warmup_chunks, self.keep_last)
        self.sessions_total += 1

    def on_chunk(self, session: str, facts: ChunkFacts, memory: Memory) -> None:
        metrics = self._get(session)
        for rank, sample in memory.items():
            metrics.on_memory(rank, max(sample["peak_rss"], sample["cuda_peak"]))
        metrics.on_chunk(facts)
        self.chunks_emitted += 1
        self.frames_emitted += facts.frames

    def on_idle(self, start: float, end: float, cause: str, blocked: tuple[tuple[str, str], ...] = ()) -> None:
        """A DiT idle interval: counted server-wide by its cause, and for each blocked open session by its own."""
        self.idle.add(start, end, cause)
        for session, own in blocked:
            if session in self.sessions:
                self.sessions[session].on_idle(start, end, own)

    def on_reject(self, reason: str) -> None:
        self.rejects.add(reason)

    def on_error(self, kind: str) -> None:
        self.errors.add(kind)

    def on_close(self, session: str, now: float) -> None:
        """Forget a closed session's metrics (read its final ``closing`` summary first)."""
        self.sessions.pop(session, None)

    def on_gauges(self, open_sessions: int, memory: Memory) -> None:
        """Nothing: the stats reply reads the open sessions and memory when asked."""

    def closing(self, session: str, now: float) -> SessionSummary:
        """A session's final summary, closed at ``now`` (what the client gets on close)."""
        metrics = self._get(session)
        metrics.close(now)
        return metrics.summary()

    def stats(self, now: float, visible: set[str] | None = None) -> ServerStats:
        """Server-wide counters, and the per-session metrics of ``visible`` sessions only (None: all of them; a
        client's ``stats`` sees its own sessions, never another client's ids). The core adds what it knows."""
        uptime = max(0.0, now - self.started_at)
        shown = self.sessions if visible is None else {s: m for s, m in self.sessions.items() if s in visible}
        return ServerStats(
            uptime_s=uptime,
            sessions=SessionCounts(open=len(self.sessions), total=self.sessions_total),
            chunks_emitted=self.chunks_emitted,
            frames_emitted=self.frames_emitted,
            rejects=dict(self.rejects.counts),
            errors=dict(self.errors.counts),
            dit_idle=self.idle.idle(uptime),
            per_session={sid: m.summary(now) for sid, m in shown.items()},
            open_sessions=len(self.sessions),
        )

    def _get(self, session: str) -> SessionMetrics:
        try:
            return self.sessions[session]
        except KeyError:
            raise KeyError(f"no open session {session!r} in metrics") from None


def final_summary(server: ServerMetrics, observers: Observers, session: str, now: float) -> SessionSummary:
    """A session's summary as it closes; its metrics are done (every observer hears of the close)."""
    summary = server.closing(session, now)
    observers.on_close(session, now)
    return summary
