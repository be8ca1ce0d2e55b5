"""Shared pieces of the benchmarks (``bench_schedule.py``, ``bench.py``): start a server, play a trace, measure.

Everything here reads the per-chunk ``facts`` (times on rank 0's clock, spans of every rank) and the closing
summary that the client gets, so a benchmark measures exactly what a client would see. Absolute times on a
shared CPU machine are noise: both sides of an A/B are run in the same process, one after the other, and the
tables show their ratio.

Definitions (the steady window skips the first ``warmup`` chunks, as the server's metrics do):

- chunk period: interval between consecutive emissions of steady chunks (the first steady chunk is measured
  from the last warm-up emission);
- DiT busy fraction: per DiT rank, the sum of its steady denoise spans over the window from its first steady
  denoise start to its last denoise end; the mean over the DiT ranks;
- DiT gap: per DiT rank, from the end of its denoise i-1 to the start of its denoise i (idle: control plane
  round trip, condition broadcast, or a missing input), averaged;
- control-to-output: ``emitted - control_accepted`` (the server's ``control_to_output_s``).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ipc.client import ChunkResult, Client
from ipc.metrics_types import ServerStats, SessionSummary
from ipc.protocol import ChunkFacts, Span
from runtime.metrics import stage_extent
from scripts.bench_json import out_dir
from scripts.client import Played, load_trace, play
from scripts.local_server import ROOT, LocalServer

RATIO = (0.25, 0.60, 0.30)  # E:D:V of the design note
DEFAULT_IMAGE = ROOT / "assets" / "start.png"
DEFAULT_TRACE = ROOT / "assets" / "demo_trace.json"
OUT_DIR = out_dir()  # $OUT, else out/ (``scripts.bench_json``)
EXIT_FRAMES_DIFFER = 2  # every benchmark's exit code when its frames are not what they must be
STAGE_COLOURS = {
    "condition": "#4c9be8",
    "denoise": "#e8554c",
    "decode": "#4cbf6a",
    "transfer:condition": "#b28ae0",
    "transfer:latent": "#f0a93b",
    "transfer:frames": "#8c8c8c",
}


@dataclass(frozen=True)
class Costs:
    """Stage costs of the synthetic backend, seconds per chunk."""

    encode_s: float
    denoise_s: float
    decode_s: float

    @classmethod
    def from_unit(cls, unit: float, ratio: Sequence[float] = RATIO) -> Costs:
        encode, denoise, decode = (round(unit * r, 6) for r in ratio)
        return cls(encode, denoise, decode)

    def overrides(self) -> list[str]:
        return [f"--synthetic.encode_s={self.encode_s}", f"--synthetic.denoise_s={self.denoise_s}",
                f"--synthetic.decode_s={self.decode_s}"]

    @property
    def serial_period(self) -> float:
        return self.encode_s + self.denoise_s + self.decode_s

    @property
    def latency_floor(self) -> float:
        return self.denoise_s + self.decode_s


@dataclass
class Run:
    """One played session: what the client got back, plus the digests of its frames."""

    label: str
    config: str
    mode: str
    reactive: bool
    chunks: list[dict[str, Any]]  # index, frames (count), frame_bytes, shape, digest, control, facts (typed)
    summary: SessionSummary
    server_start_s: float
    wall_s: float
    stats: ServerStats | None = None

    @property
    def digests(self) -> list[str]:
        return [c["digest"] for c in self.chunks]


def frame_digest(chunk: ChunkResult) -> str:
    return hashlib.sha256(np.ascontiguousarray(chunk.frames).tobytes()).hexdigest()


def _chunk_entry(chunk: ChunkResult) -> dict[str, Any]:
    return {"index": chunk.index, "frames": int(chunk.frames.shape[0]), "frame_bytes": int(chunk.frames.nbytes),
            "shape": list(chunk.frames.shape), "digest": frame_digest(chunk), "control": chunk.control,
            "facts": chunk.facts}


def _to_run(label: str, config: str, mode: str, reactive: bool, played: Played, start_s: float,
            stats: ServerStats) -> Run:
    return Run(label=label, config=config, mode=mode, reactive=reactive,
               chunks=[_chunk_entry(c) for c in played.chunks], summary=played.summary, server_start_s=start_s,
               wall_s=played.wall_s, stats=stats)


@dataclass(frozen=True)
class Play:
    """One session to play on a server: a label and the client behaviour."""

    label: str
    reactive: bool = False


def serve_and_play(config: str, mode: str, overrides: Sequence[str], plays: Sequence[Play], image: Path,
                   trace: Path, num_chunks: int | None, log_dir: Path = OUT_DIR) -> list[Run]:
    """Start one server (``--scheduler.mode=mode`` plus ``overrides``), play each session in turn, stop it."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"bench-{config}-{mode}-server.log"
    server = LocalServer(config, [f"--scheduler.mode={mode}", *overrides], log_path=log_path)
    runs = []
    image_bytes = image.read_bytes()
    recorded = load_trace(trace)
    with server:
        print(f"  {config}/{mode}: server up in {server.started_s:.1f} s", flush=True)
        with Client(server.endpoint, timeout_s=120.0) as client:
            for spec in plays:
                played = play(client, image_bytes, recorded, reactive=spec.reactive, num_chunks=num_chunks)
                stats = client.stats()
                runs.append(_to_run(spec.label, config, mode, spec.reactive, played, server.started_s, stats))
                print(f"  {spec.label}: {len(played.chunks)} chunks in {played.wall_s:.1f} s", flush=True)
    code = server.process.returncode if server.process else 1
    if code != 0:
        raise RuntimeError(f"server {config}/{mode} exited with {code}; log {log_path}")
    return runs


# ------------------------------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (the same definition as the server's metrics), exact."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


def distribution(values: Sequence[float]) -> dict[str, float | int | None]:
    return {"count": len(values), "mean": float(np.mean(values)) if values else None,
            "p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99),
            "max": max(values) if values else None}


def span_seconds(facts: ChunkFacts, name: str) -> float:
    """Total seconds of one span kind in a chunk, summed over the ranks that report it."""
    return sum(s.duration for s in facts.spans if s.name == name)


def _steady(run: Run, warmup: int) -> list[dict[str, Any]]:
    return [c for c in run.chunks if c["index"] >= warmup]


def periods(run: Run, warmup: int) -> list[float]:
    emitted = [c["facts"].times.emitted for c in run.chunks]
    return [emitted[i] - emitted[i - 1] for i in range(max(1, warmup), len(emitted))]


def dit_busy(run: Run, warmup: int) -> dict[str, Any]:
    """DiT busy fraction per DiT rank over the steady window, and the gaps between consecutive denoises.

    Each rank's busy fraction is the sum of its steady denoise spans over its window (first steady denoise start
    to last denoise end on that rank); the headline value is the mean over the DiT ranks (the minimum is kept
    too). Gaps are measured on each rank between its own consecutive denoises, then averaged over ranks.
    """
    per_rank: dict[int, list[tuple[float, float]]] = {}
    for chunk in run.chunks:
        if chunk["index"] < warmup:
            continue
        for s in chunk["facts"].spans:
            if s.name == "denoise" and s.role == "denoise":
                per_rank.setdefault(s.rank, []).append((s.start, s.end))
    busy, gaps = {}, []
    for rank, spans in sorted(per_rank.items()):
        if len(spans) < 2:
            continue
        window = spans[-1][1] - spans[0][0]
        busy[rank] = sum(end - start for start, end in spans) / window if window > 0 else None
        gaps += [b[0] - a[1] for a, b in itertools.pairwise(spans)]
    fractions = [b for b in busy.values() if b is not None]
    return {"busy_fraction": float(np.mean(fractions)) if fractions else None,
            "busy_fraction_min": min(fractions) if fractions else None, "busy_by_rank": busy,
            "gap_mean_s": float(np.mean(gaps)) if gaps else None, "gap_p90_s": percentile(gaps, 90)}


def dit_skew(run: Run, warmup: int) -> float | None:
    """Mean spread of the denoise start times across the DiT ranks (the condition broadcast's stragglers)."""
    spreads = []
    for chunk in run.chunks:
        starts = [s.start for s in chunk["facts"].spans if s.name == "denoise" and s.role == "denoise"]
        if chunk["index"] >= warmup and len(starts) > 1:
            spreads.append(max(starts) - min(starts))
    return float(np.mean(spreads)) if spreads else None


def overhead_breakdown(run: Run, warmup: int) -> dict[str, float | None]:
    """Mean seconds per steady chunk of each piece that is not stage compute (where the period goes)."""
    steady = _steady(run, warmup)

    def mean(values: Iterable[float | None]) -> float | None:
        kept = [v for v in values if v is not None]
        return float(np.mean(kept)) if kept else None

    def dispatch(c: dict[str, Any]) -> float | None:  # denoise scheduled -> DiT rank starts receiving
        spans = [s for s in c["facts"].spans if s.role == "denoise"]
        return min(s.start for s in spans) - c["facts"].times.denoise_start if spans else None

    def tail(c: dict[str, Any]) -> float | None:  # decode finished on its rank -> emitted to the client
        extent = stage_extent(c["facts"], "decode")
        return c["facts"].times.emitted - extent[1] if extent else None

    return {
        "condition_s": mean(_extent_len(c, "condition") for c in steady),
        "denoise_s": mean(_extent_len(c, "denoise") for c in steady),
        "decode_s": mean(_extent_len(c, "decode") for c in steady),
        "transfer_condition_s": mean(_rank_span(c, "transfer:condition", "condition_edge") for c in steady),
        "transfer_latent_s": mean(_rank_span(c, "transfer:latent", "denoise") for c in steady),
        "transfer_frames_s": mean(_rank_span(c, "transfer:frames", "decode") for c in steady),
        "dispatch_to_dit_s": mean(dispatch(c) for c in steady),
        "dit_start_skew_s": dit_skew(run, warmup),
        "decode_to_emit_s": mean(tail(c) for c in steady),
    }


def _extent_len(chunk: dict[str, Any], stage: str) -> float | None:
    extent = stage_extent(chunk["facts"], stage)
    return None if extent is None else extent[1] - extent[0]


def _rank_span(chunk: dict[str, Any], name: str, role: str) -> float | None:
    """Longest span of ``name`` reported by a rank of ``role`` (the sender side of a transfer)."""
    spans = [s.duration for s in chunk["facts"].spans if s.name == name and s.role == role]
    return max(spans) if spans else None


def summarize(run: Run, warmup: int) -> dict[str, Any]:
    """The measured facts of one run (see the module docstring for the definitions)."""
    steady = _steady(run, warmup)
    latencies = [t for c in steady if (t := c["facts"].times.control_to_output) is not None]
    summary = run.summary
    first, peak, idle = summary.time_to_first_frame_s, summary.peak_memory_bytes, summary.dit_idle
    return {
        "label": run.label, "config": run.config, "mode": run.mode, "reactive": run.reactive,
        "chunks": len(run.chunks), "frames": sum(c["frames"] for c in run.chunks),
        "period_s": distribution(periods(run, warmup)),
        "latency_s": distribution(latencies),
        "first_frame_from_open_s": first.from_open,
        "first_frame_from_first_control_s": first.from_first_control,
        "compute_fps": summary.compute.fps_weighted,
        "stream_fps": _stream_fps(run, warmup),
        "dit_idle_fraction": idle.fraction,
        "dit_idle_by_cause_s": {cause: share.total_s for cause, share in idle.by_cause.shares().items()},
        "dit": dit_busy(run, warmup),
        "peak_rss_bytes": max(peak.values()) if peak else None,
        "peak_rss_by_rank": peak,
        "overhead": overhead_breakdown(run, warmup),
        "frame_bytes_per_chunk": distribution([c["frame_bytes"] for c in steady])["mean"],
        "server_start_s": run.server_start_s, "wall_s": run.wall_s,
    }


def _stream_fps(run: Run, warmup: int) -> float | None:
    """Delivered frames per second in the steady window: mean frames per steady chunk / mean chunk period."""
    steady, gaps = _steady(run, warmup), periods(run, warmup)
    if not steady or not gaps:
        return None
    return float(np.mean([c["frames"] for c in steady]) / np.mean(gaps))


def compare_frames(a: Run, b: Run) -> list[int]:
    """Indices of the chunks whose frames differ (or exist on one side only)."""
    da, db = a.digests, b.digests
    return [i for i in range(max(len(da), len(db))) if i >= len(da) or i >= len(db) or da[i] != db[i]]


# ------------------------------------------------------------------------------------------------- tables


def fmt(value: float | int | None, unit: str = "s") -> str:
    if value is None:
        return "-"
    if unit == "s":
        return f"{value * 1000:.1f} ms" if abs(value) < 10 else f"{value:.2f} s"
    if unit == "%":
        return f"{value * 100:.1f} %"
    if unit == "MiB":
        return f"{value / 2**20:.0f} MiB"
    if unit == "x":
        return f"{value:.3f}"
    return f"{value:.2f}"


def ratio(b: float | None, a: float | None) -> float | None:
    return b / a if a not in (None, 0) and b is not None else None


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table, first column left-aligned, the rest right-aligned."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    lines = []
    for n, row in enumerate([headers, *rows]):
        cells = [str(c).ljust(widths[i]) if i == 0 else str(c).rjust(widths[i]) for i, c in enumerate(row)]
        lines.append("  ".join(cells))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- timeline


def _tracks(runs: Sequence[Run], chunks: int) -> list[tuple[int, str]]:
    seen = {(s.rank, s.role) for r in runs for c in r.chunks[:chunks] for s in c["facts"].spans}
    return sorted(seen)


def plot_timeline(runs: Sequence[Run], path: Path, chunks: int = 8, title: str = "") -> Path:
    """One panel per run (stacked, same time scale): a bar per span on a track per (rank, role), first chunks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    tracks = _tracks(runs, chunks)
    spans_of = [[(c["index"], s) for c in r.chunks[:chunks] for s in c["facts"].spans] for r in runs]
    origins = [min((s.queued for _, s in spans), default=0.0) for spans in spans_of]
    ends = [max((c["facts"].times.emitted for c in r.chunks[:chunks]), default=0.0) - o
            for r, o in zip(runs, origins, strict=True)]
    fig, axes = plt.subplots(len(runs), 1, figsize=(13, 1.1 + 0.55 * (len(tracks) + 1) * len(runs)), sharex=True,
                             squeeze=False)
    for ax, run, spans, origin in zip(axes[:, 0], runs, spans_of, origins, strict=True):
        _draw_panel(ax, run, spans, origin, tracks, chunks)
    axes[-1, 0].set_xlim(0, max(ends) * 1.02 if ends else 1)
    axes[-1, 0].set_xlabel("seconds since the first chunk's first span (rank-0 clock)")
    handles = [Patch(color=c, label=n) for n, c in STAGE_COLOURS.items()]
    handles.append(Patch(facecolor="none", edgecolor="black", label="emit (chunk out)"))
    height = fig.get_size_inches()[1]
    top = 1 - 0.75 / height  # room for the title and the legend, in inches whatever the panel count
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, top), ncol=len(handles), fontsize=8,
               frameon=False)
    if title:
        fig.suptitle(title, y=1 - 0.08 / height, fontsize=9, va="top")
    fig.tight_layout(rect=(0, 0, 1, top))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _draw_panel(ax: Any, run: Run, spans: list[tuple[int, Span]], origin: float,
                tracks: list[tuple[int, str]], chunks: int) -> None:
    rows = {track: i for i, track in enumerate(tracks)}
    emit_row = len(tracks)
    for index, span in spans:
        name, start, end = span.name, span.start, span.end
        row = rows[(span.rank, span.role)]
        is_transfer = name.startswith("transfer")
        height = 0.35 if is_transfer else 0.7
        offset = 0.35 if is_transfer else 0.0  # transfers sit in the upper half of the row, under the stage
        ax.barh(row - offset / 2, end - start, left=start - origin, height=height,
                color=STAGE_COLOURS.get(name, "#cccccc"), edgecolor="black", linewidth=0.3)
        if name in ("condition", "denoise", "decode") and end - start > 0:
            ax.text(start - origin + (end - start) / 2, row, str(index), ha="center", va="center", fontsize=7)
    for chunk in run.chunks[:chunks]:
        t = chunk["facts"].times.emitted - origin
        ax.plot([t, t], [emit_row - 0.35, emit_row + 0.35], color="black", linewidth=1.2)
        ax.text(t + 0.004, emit_row, str(chunk["index"]), ha="left", va="center", fontsize=7)
    ax.set_yticks(range(len(tracks) + 1))
    ax.set_yticklabels([f"rank {r} {role}" for r, role in tracks] + ["emitted"], fontsize=8)
    ax.set_ylim(len(tracks) + 0.9, -0.7)
    ax.set_title(f"{run.config} / {run.mode}{' / reactive' if run.reactive else ''}: first {chunks} chunks",
                 fontsize=9, loc="left")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)


def now_stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")
