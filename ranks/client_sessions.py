"""The coordinator's per-session bookkeeping around the scheduler: the owning client, the accepted controls
of in-flight chunks, the spans reported by the ranks, and the conversion of all that to metrics and facts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ipc import protocol
from models.controls import ChunkControl
from runtime.clock import ClockSync
from runtime.control_service import LiveControls
from runtime.metrics import ChunkRecord, SessionMetrics, Span

# worker span name -> metric span name (stages and transfers)
SPAN_NAMES = {
    "encode": "encode",
    "denoise": "denoise",
    "denoise.cached": "denoise",
    "decode": "decode",
    "send_condition": "transfer:condition",
    "recv_condition": "transfer:condition",
    "send_context": "transfer:context",
    "recv_context": "transfer:context",
    "send_latent": "transfer:latent",
    "recv_latent": "transfer:latent",
    "send_frames": "transfer:frames",
    "recv_frames": "transfer:frames",
}


@dataclass
class ClientSession:
    id: str
    client: bytes  # the ROUTER identity chunks go to
    owner_token: bytes  # the identity that opened it (a reconnect with it may resume)
    open_req: int
    seed: int
    prompt: str
    image: bytes  # raw uint8 [H, W, 3]
    num_chunks: int | None
    live: LiveControls | None
    metrics: SessionMetrics
    last_heard: float
    controls: dict[int, ChunkControl] = field(default_factory=dict)  # accepted, not yet emitted (bounded)
    queued: dict[tuple[str, int], float] = field(default_factory=dict)  # (op, index) -> when handed to a role
    spans: dict[int, list[Span]] = field(default_factory=dict)  # in-flight chunks only
    decode_parts: dict[int, set[str]] = field(default_factory=dict)
    released: dict[str, list[int]] = field(default_factory=dict)  # stage -> ranks that confirmed the release
    last_emitted: float | None = None  # for the chunk period histogram
    closing: bool = False
    gone: bool = False  # the client can no longer be reached

    def add_span(self, index: int, span: Span) -> None:
        if index >= 0:
            self.spans.setdefault(index, []).append(span)

    def take_spans(self, index: int) -> tuple[Span, ...]:
        for key in [k for k in self.queued if k[1] == index]:
            del self.queued[key]
        return tuple(self.spans.pop(index, ()))

    def release_joined(self, stage: str, rank: int, ranks: int) -> bool:
        """A stage's release is complete when every rank holding its caches confirmed it."""
        confirmed = self.released.setdefault(stage, [])
        if rank not in confirmed:
            confirmed.append(rank)
        return len(confirmed) == ranks

    def decode_joined(self, index: int, part: str, frames_remote: bool) -> bool:
        """Decode of a chunk is complete when the decode rank is done and (if remote) its frames arrived."""
        if not frames_remote:
            return part == "decode"
        parts = self.decode_parts.setdefault(index, set())
        parts.add(part)
        if parts >= {"decode", "expect_frames"}:
            del self.decode_parts[index]
            return True
        return False


def spans_from_worker(done: protocol.Done, clock: ClockSync, queued: float) -> list[Span]:
    """A worker's ``[name, start, end]`` spans on its own clock -> metric spans on rank 0's clock."""
    out = []
    offset = clock.offset(done.rank) if done.rank in clock.ranks() or done.rank == 0 else 0.0
    for name, start, end in done.spans:
        metric_name = SPAN_NAMES.get(name)
        if metric_name is None:
            continue
        start0, end0 = start - offset, end - offset
        out.append(Span(name=metric_name, rank=done.rank, role=done.role, queued=min(queued, start0),
                        start=start0, end=max(start0, end0)))
    return out


def facts_of(record: ChunkRecord) -> dict[str, Any]:
    """What a client learns about one chunk: its times on the rank-0 clock and the spans of every rank."""
    times = record.times
    return {
        "times": {
            "control_accepted": times.control_accepted,
            "condition_submitted": times.condition_submitted,
            "encode_start": times.encode_start,
            "condition_ready": times.condition_ready,
            "denoise_start": times.denoise_start,
            "denoise_end": times.denoise_end,
            "decode_start": times.decode_start,
            "decode_end": times.decode_end,
            "emitted": times.emitted,
        },
        "control_to_output_s": times.control_to_output,
        "condition_wait_s": times.condition_wait,
        "cached": times.cached,
        "compute_s": record.compute_seconds(),
        "spans": [[s.name, s.rank, s.role, s.queued, s.start, s.end] for s in record.spans],
    }
