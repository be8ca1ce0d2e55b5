"""The design note's A/B (issue 6): serial baseline vs prefetch pipeline, same image, seed and control trace.

    .venv/bin/python scripts/bench.py                          # synthetic backend, E:D:V = 0.25:0.60:0.30 x unit
    .venv/bin/python scripts/bench.py --model                  # the tiny real model (configs/cpu-tiny-model.toml)
    .venv/bin/python scripts/bench.py --layout cpu-tiny cpu-aggregated   # layouts A vs B, same table, ratio B/A
    .venv/bin/python scripts/bench.py --overhead               # zero-cost stages: what the runtime itself costs

Prints one table (chunk period mean/p90/p99, compute FPS, first-frame latency, control-to-output p50/p90, DiT
idle fraction, peak RSS) with the ratio of the second column to the first, checks that both sides produced
bit-identical frames (exit code 2 and a loud message if not), and writes ``$OUT/bench.json`` and a timeline of
the first 8 chunks per rank and role for both sides (``$OUT/bench_timeline.png``; ``out/`` without ``$OUT``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.config import ConfigError, load, resolve_path
from scripts.bench_common import (
    DEFAULT_IMAGE,
    DEFAULT_TRACE,
    EXIT_FRAMES_DIFFER,
    Costs,
    Play,
    Run,
    compare_frames,
    fmt,
    plot_timeline,
    ratio,
    serve_and_play,
    summarize,
    table,
)
from scripts.bench_json import out_path, parse_args, write_json

MODEL_CONFIG = "cpu-tiny-model"

# (row label, how to read it from a summary, unit)
ROWS: list[tuple[str, Callable[[dict[str, Any]], Any], str]] = [
    ("chunk period mean", lambda s: s["period_s"]["mean"], "s"),
    ("chunk period p90", lambda s: s["period_s"]["p90"], "s"),
    ("chunk period p99", lambda s: s["period_s"]["p99"], "s"),
    ("stream FPS (frames / period, steady)", lambda s: s["stream_fps"], ""),
    ("compute FPS (frames / stage seconds)", lambda s: s["compute_fps"], ""),
    ("first frame from open", lambda s: s["first_frame_from_open_s"], "s"),
    ("first frame from first control", lambda s: s["first_frame_from_first_control_s"], "s"),
    ("control-to-output p50", lambda s: s["latency_s"]["p50"], "s"),
    ("control-to-output p90", lambda s: s["latency_s"]["p90"], "s"),
    ("DiT idle fraction (server summary)", lambda s: s["dit_idle_fraction"], "%"),
    ("DiT busy (denoise spans, mean of ranks)", lambda s: s["dit"]["busy_fraction"], "%"),
    ("peak RSS (max over reporting ranks)", lambda s: s["peak_rss_bytes"], "MiB"),
]


def ab_table(a: dict[str, Any], b: dict[str, Any], name_a: str, name_b: str) -> str:
    rows = [[label, fmt(get(a), unit), fmt(get(b), unit), fmt(ratio(get(b), get(a)), "x")] for label, get, unit in ROWS]
    return table(["metric", name_a, name_b, f"{name_b}/{name_a}"], rows)


def synthetic_overrides(config: str, costs: Costs | None) -> list[str]:
    """Stage-cost overrides when the config runs the synthetic backend (none for the real model)."""
    if costs is None or load(config).model.kind != "synthetic":
        return []
    return costs.overrides()


def sides(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(label, config, mode) of side A and side B."""
    if args.layout:
        a, b = args.layout
        return [(a, a, args.mode), (b, b, args.mode)]
    config = MODEL_CONFIG if args.model else args.config
    return [("serial", config, "serial"), ("prefetch", config, "prefetch")]


def run_sides(args: argparse.Namespace, costs: Costs | None) -> list[Run]:
    runs = []
    for label, config, mode in sides(args):
        played = serve_and_play(config, mode, synthetic_overrides(config, costs), [Play(label)], args.image,
                                args.trace, args.chunks)
        runs.extend(played)
    return runs


def check_configs(args: argparse.Namespace) -> None:
    """Fail early with a clear message when a config is missing (e.g. cpu-tiny-model not written yet)."""
    for _, config, _ in sides(args):
        try:
            resolve_path(config)
        except ConfigError as error:
            hint = " (--model needs configs/cpu-tiny-model.toml, the tiny real-model layout)" if args.model else ""
            raise SystemExit(f"bench: {error}{hint}") from None


def ab(args: argparse.Namespace) -> int:
    check_configs(args)
    costs = None if args.model else Costs.from_unit(args.unit)
    runs = run_sides(args, costs)
    a, b = runs
    summaries = [summarize(r, args.warmup) for r in runs]
    differ = compare_frames(a, b)
    what = "layouts" if args.layout else "modes"
    header = (f"bench A/B ({what}): {a.config}/{a.mode} vs {b.config}/{b.mode}, {args.chunks} chunks, seed from "
              f"{args.trace.name}, warm-up {args.warmup}"
              + (f", synthetic E/D/V = {fmt(costs.encode_s)}/{fmt(costs.denoise_s)}/{fmt(costs.decode_s)} "
                 f"(unit {args.unit} s)" if costs else ""))
    text = "\n".join([header, "", ab_table(*summaries, a.label, b.label), "",
                      frames_line(differ, len(a.chunks))])
    print("\n" + text)
    plot_timeline(runs, args.png, chunks=8, title=header)
    write_json(args.json, {"kind": f"ab-{what}", "costs": vars(costs) if costs else None, "table": text,
                           "summaries": summaries, "frames_differ": differ, "runs": runs_json(runs)},
               smoke=args.smoke)
    print(f"wrote {args.json} and {args.png}")
    strict = not args.layout or all(load(r.config).model.kind == "synthetic" for r in runs)
    if differ and strict:  # real-model layouts with other DiT degrees may legitimately differ in the last bits
        print(f"FAIL: frames of {a.label} and {b.label} are not bit-identical (chunks {differ})", file=sys.stderr)
        return EXIT_FRAMES_DIFFER
    return 0


def frames_line(differ: list[int], count: int) -> str:
    if not differ:
        return f"frames: bit-identical, all {count} chunks (sha256 per chunk)"
    return f"frames: NOT bit-identical: chunks {differ} differ"


def overhead(args: argparse.Namespace) -> int:
    """Zero-cost stages on the 7-rank layout: the period is what the runtime itself costs per chunk."""
    zero = Costs(0.0, 0.0, 0.0)
    runs = [*serve_and_play(args.config, "serial", zero.overrides(), [Play("serial")], args.image, args.trace,
                            args.chunks),
            *serve_and_play(args.config, "prefetch", zero.overrides(), [Play("prefetch")], args.image, args.trace,
                            args.chunks)]
    summaries = [summarize(r, args.warmup) for r in runs]
    differ = compare_frames(*runs)
    payloads = payload_bytes(args.config)
    rows = [[label, *[fmt(get(s), unit) for s in summaries]] for label, get, unit in OVERHEAD_ROWS]
    text = "\n".join([
        f"bench --overhead: {args.config}, all synthetic stage costs 0, {args.chunks} chunks, warm-up {args.warmup}",
        "", table(["metric", *[r.label for r in runs]], rows), "",
        "payload per chunk: " + ", ".join(f"{k} {v / 1024:.0f} KiB" for k, v in payloads.items()),
        frames_line(differ, len(runs[0].chunks))])
    print("\n" + text)
    png = args.png.with_name("bench_overhead_timeline.png")
    plot_timeline(runs, png, chunks=8, title=f"{args.config}, zero-cost stages")
    write_json(args.json.with_name("bench_overhead.json"), {"kind": "overhead", "table": text,
                                                            "payload_bytes": payloads, "summaries": summaries,
                                                            "frames_differ": differ, "runs": runs_json(runs)},
               smoke=args.smoke)
    print(f"wrote {args.json.with_name('bench_overhead.json')} and {png}")
    if differ:  # the schedule must never change what is computed
        print(f"FAIL: serial and prefetch frames are not bit-identical (chunks {differ})", file=sys.stderr)
        return EXIT_FRAMES_DIFFER
    return 0


OVERHEAD_ROWS: list[tuple[str, Callable[[dict[str, Any]], Any], str]] = [
    ("chunk period p50", lambda s: s["period_s"]["p50"], "s"),
    ("chunk period p99", lambda s: s["period_s"]["p99"], "s"),
    ("chunk period mean", lambda s: s["period_s"]["mean"], "s"),
    ("control-to-output p50", lambda s: s["latency_s"]["p50"], "s"),
    ("condition span (condition rank)", lambda s: s["overhead"]["condition_s"], "s"),
    ("denoise extent (all DiT ranks)", lambda s: s["overhead"]["denoise_s"], "s"),
    ("decode span (decode rank)", lambda s: s["overhead"]["decode_s"], "s"),
    ("condition broadcast (DiT rank)", lambda s: s["overhead"]["transfer_condition_s"], "s"),
    ("latent send (DiT leader)", lambda s: s["overhead"]["transfer_latent_s"], "s"),
    ("frames send (decode rank)", lambda s: s["overhead"]["transfer_frames_s"], "s"),
    ("denoise scheduled -> DiT rank starts", lambda s: s["overhead"]["dispatch_to_dit_s"], "s"),
    ("decode end -> emitted", lambda s: s["overhead"]["decode_to_emit_s"], "s"),
    ("DiT gap between denoises", lambda s: s["dit"]["gap_mean_s"], "s"),
    ("denoise start skew across DiT ranks", lambda s: s["overhead"]["dit_start_skew_s"], "s"),
    ("frame payload per chunk (KiB)", lambda s: s["frame_bytes_per_chunk"] / 1024, ""),
]


def payload_bytes(config: str) -> dict[str, int]:
    """Bytes that cross the tensor plane per chunk (synthetic geometry of the config)."""
    from models.synthetic import synthetic_geometry

    st = load(config).stream
    g = synthetic_geometry(st.height, st.width, st.chunk_latent_frames)
    frames = g.frames_in_chunk(1) * st.height * st.width * 3

    def size(shape: tuple[int, ...]) -> int:
        n = 4
        for d in shape:
            n *= d
        return n

    return {"condition (fp32, broadcast to each DiT rank)": size(g.condition_shape),
            "latent (fp32)": size(g.latent_shape), "frames (uint8)": frames}


def runs_json(runs: list[Run]) -> dict[str, Any]:
    return {r.label: {"config": r.config, "mode": r.mode, "summary": r.summary, "chunks": r.chunks} for r in runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--model", action="store_true", help=f"the tiny real model ({MODEL_CONFIG}) instead of synthetic")
    what.add_argument("--layout", nargs=2, metavar=("A", "B"), help="compare two layouts (configs) instead of modes")
    what.add_argument("--overhead", action="store_true", help="zero-cost stages: the runtime's own cost per chunk")
    parser.add_argument("--mode", choices=["prefetch", "serial"], default="prefetch", help="schedule for --layout")
    parser.add_argument("--config", default="cpu-tiny", help="layout of the mode A/B and of --overhead")
    parser.add_argument("--unit", type=float, default=0.2, help="synthetic E, D, V = 0.25, 0.60, 0.30 units (s)")
    parser.add_argument("--chunks", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=2, help="chunks left out of the steady statistics")
    parser.add_argument("--image", type=Path, default=DEFAULT_IMAGE)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="recorded controls (and the seed)")
    parser.add_argument("--json", type=Path, default=out_path("bench.json"))
    parser.add_argument("--png", type=Path, default=out_path("bench_timeline.png"))
    args = parse_args(parser, argv, {"unit": 0.02, "chunks": 4, "warmup": 1, "config": "cpu-mini"})
    return overhead(args) if args.overhead else ab(args)


if __name__ == "__main__":
    sys.exit(main())
