"""The coordinator's Prometheus series: the server's counters and latency histograms, served by the probe server.

Enabled by ``metrics.prometheus_port > 0`` when ``prometheus-client`` is installed (the ``metrics`` extra); rank 0's
probe server (``ranks.probe_server``, on ``metrics.prometheus_host``) serves this registry at ``/metrics``, beside
the series of the loop's published snapshot (ranks in, warm, draining, rooms). It is one
``runtime.metrics.MetricsObserver`` of the coordinator core: it derives what it exports from the core's events
alone, like ``ServerMetrics``. The coordinator thread records into the (thread-safe) metric objects; the HTTP server
thread only reads them.
"""

from __future__ import annotations

import logging
from typing import Any

from ipc.protocol import ChunkFacts
from runtime.metrics import Memory

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


class Exporter:
    def __init__(self) -> None:
        import prometheus_client as prom

        self.registry = prom.CollectorRegistry()
        r = self.registry
        self.chunks = prom.Counter("worldstream_chunks_emitted", "Chunks emitted to clients", registry=r)
        self.frames = prom.Counter("worldstream_frames_emitted", "Video frames emitted to clients", registry=r)
        self.rejects = prom.Counter("worldstream_rejects", "Client messages rejected", ["reason"], registry=r)
        self.sessions_opened = prom.Counter("worldstream_sessions_opened", "Sessions opened", registry=r)
        self.open_sessions = prom.Gauge("worldstream_open_sessions", "Sessions open now", registry=r)
        self.rank_rss = prom.Gauge("worldstream_rank_rss_bytes", "Resident memory per rank", ["rank"], registry=r)
        self.dit_idle = prom.Counter("worldstream_dit_idle_seconds", "DiT idle time by cause", ["cause"], registry=r)
        self.latency = prom.Histogram("worldstream_control_to_output_seconds",
                                      "Control accepted -> frames emitted, per chunk", buckets=LATENCY_BUCKETS,
                                      registry=r)
        self.period = prom.Histogram("worldstream_chunk_period_seconds", "Interval between emissions of a session",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.first_frame = prom.Histogram("worldstream_time_to_first_frame_seconds",
                                          "Session open -> its first chunk emitted (a cold start included)",
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.errors = prom.Counter("worldstream_errors", "Failures by code (stage_failed, internal)", ["code"],
                                   registry=r)
        self.last_emitted: dict[str, float] = {}  # per open session: its latest emission (for the period)
        self.opened_at: dict[str, float] = {}  # per open session before its first chunk (for the first frame)

    # ---- runtime.metrics.MetricsObserver: the core's events, each once

    def on_open(self, session: str, now: float) -> None:
        self.sessions_opened.inc()
        self.opened_at[session] = now

    def on_chunk(self, session: str, facts: ChunkFacts, memory: Memory) -> None:
        self.chunks.inc()
        self.frames.inc(facts.frames)
        latency = facts.times.control_to_output
        if latency is not None:
            self.latency.observe(latency)
        opened = self.opened_at.pop(session, None)
        if opened is not None:
            self.first_frame.observe(max(0.0, facts.times.emitted - opened))
        previous = self.last_emitted.get(session)
        if previous is not None:  # the period between two emissions of the session, warm-up included
            self.period.observe(facts.times.emitted - previous)
        self.last_emitted[session] = facts.times.emitted

    def on_idle(self, start: float, end: float, cause: str, blocked: tuple[tuple[str, str], ...]) -> None:
        self.dit_idle.labels(cause=cause).inc(max(0.0, end - start))

    def on_reject(self, reason: str) -> None:
        self.rejects.labels(reason=reason).inc()

    def on_error(self, kind: str) -> None:
        self.errors.labels(code=kind).inc()

    def on_close(self, session: str, now: float) -> None:
        self.last_emitted.pop(session, None)
        self.opened_at.pop(session, None)

    def on_gauges(self, open_sessions: int, memory: Memory) -> None:
        self.open_sessions.set(open_sessions)
        for rank, facts in memory.items():
            self.rank_rss.labels(rank=str(rank)).set(facts["rss"])


def start(port: int) -> Any | None:
    """The exporter, or None when disabled or ``prometheus-client`` is missing (logged once)."""
    if port <= 0:
        return None
    try:
        return Exporter()
    except ImportError:
        log.warning("metrics.prometheus_port=%d but prometheus-client is not installed (pip install -e '.[metrics]')",
                    port)
        return None
