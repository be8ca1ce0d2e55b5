"""Scheduling efficiency (issue 3): serial vs prefetch on the synthetic backend with fixed stage costs.

    .venv/bin/python scripts/bench_schedule.py [--unit 0.5] [--chunks 24] [--config cpu-tiny]

Stage costs E:D:V = 0.25:0.60:0.30 times ``--unit`` seconds. The default unit 0.5 s (D = 300 ms) keeps the run
under a minute while the runtime's fixed per-chunk cost on the DiT's critical path (8-13 ms on a loaded 2-core
CPU box: mostly the condition broadcast to the DiT ranks, plus a control-plane round trip) stays under 5% of D;
with unit 0.2 (D = 120 ms) that fixed cost is 7% of D and the period and busy targets are missed, with 0.4
(D = 240 ms) they are borderline.

One run starts the serial server, plays the trace eagerly (every control sent as soon as the rules admit it),
then the prefetch server, which plays it eagerly and then reactively (control[i] only after frames[i-1]
arrived). Prints one table with a verdict per target and writes everything to ``$OUT/bench_schedule.json``.

Targets for the prefetch pipeline, eager client: steady chunk period within 5% of D; DiT busy >= 95% of the
steady window; serial/prefetch period ratio >= 1.8 (ideal (E+D+V)/D = 1.92). Reactive client: ideal period
D + V with control-to-output at its floor D + V (reported, no verdict).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.bench_common import (
    DEFAULT_IMAGE,
    DEFAULT_TRACE,
    Costs,
    Play,
    compare_frames,
    fmt,
    ratio,
    serve_and_play,
    summarize,
    table,
)
from scripts.bench_json import out_path, parse_args, write_json

PERIOD_TOLERANCE = 0.05
BUSY_TARGET = 0.95
SPEEDUP_TARGET = 1.8


def measure(args: argparse.Namespace, costs: Costs) -> dict[str, Any]:
    """Run both servers and return the per-run summaries and the frames check."""
    common = dict(overrides=costs.overrides(), image=args.image, trace=args.trace, num_chunks=args.chunks)
    serial = serve_and_play(args.config, "serial", plays=[Play("serial")], **common)
    prefetch = serve_and_play(args.config, "prefetch", plays=[Play("prefetch"), Play("prefetch-reactive", True)],
                              **common)
    runs = {r.label: r for r in [*serial, *prefetch]}
    return {
        "runs": runs,
        "summaries": {label: summarize(run, args.warmup) for label, run in runs.items()},
        "frames_differ": {label: compare_frames(runs["serial"], run) for label, run in runs.items()
                          if label != "serial"},
    }


def verdicts(s: dict[str, Any], costs: Costs) -> list[dict[str, Any]]:
    """The three targets of the prefetch pipeline (eager client), each with its measured value."""
    pre, ser = s["prefetch"], s["serial"]
    over_d = ratio(pre["period_s"]["mean"], costs.denoise_s)
    busy = pre["dit"]["busy_fraction"]
    speedup = ratio(ser["period_s"]["mean"], pre["period_s"]["mean"])
    return [
        {"target": f"prefetch period / D <= {1 + PERIOD_TOLERANCE:.2f}", "value": over_d,
         "ok": over_d is not None and over_d <= 1 + PERIOD_TOLERANCE},
        {"target": f"prefetch DiT busy >= {BUSY_TARGET:.0%}", "value": busy,
         "ok": busy is not None and busy >= BUSY_TARGET},
        {"target": f"serial/prefetch period >= {SPEEDUP_TARGET} (ideal {costs.serial_period / costs.denoise_s:.2f})",
         "value": speedup, "ok": speedup is not None and speedup >= SPEEDUP_TARGET},
    ]


def rows_of(s: dict[str, Any], costs: Costs, labels: list[str]) -> list[list[str]]:
    """One row per metric, one column per run."""
    def cells(get: Any, unit: str = "s") -> list[str]:
        return [fmt(get(s[label]), unit) for label in labels]

    d, floor = costs.denoise_s, costs.latency_floor
    return [
        ["period mean", *cells(lambda x: x["period_s"]["mean"])],
        ["period p50", *cells(lambda x: x["period_s"]["p50"])],
        ["period p90", *cells(lambda x: x["period_s"]["p90"])],
        ["period p99", *cells(lambda x: x["period_s"]["p99"])],
        ["period mean / D", *cells(lambda x: ratio(x["period_s"]["mean"], d), "x")],
        ["DiT busy (denoise spans, mean of ranks)", *cells(lambda x: x["dit"]["busy_fraction"], "%")],
        ["DiT busy, least busy DiT rank", *cells(lambda x: x["dit"]["busy_fraction_min"], "%")],
        ["DiT gap between denoises, mean", *cells(lambda x: x["dit"]["gap_mean_s"])],
        ["DiT idle (server summary, whole session)", *cells(lambda x: x["dit_idle_fraction"], "%")],
        ["control-to-output p50", *cells(lambda x: x["latency_s"]["p50"])],
        ["control-to-output p90", *cells(lambda x: x["latency_s"]["p90"])],
        ["control-to-output p50 / (D+V)", *cells(lambda x: ratio(x["latency_s"]["p50"], floor), "x")],
        ["first frame from open", *cells(lambda x: x["first_frame_from_open_s"])],
        ["first frame from first control", *cells(lambda x: x["first_frame_from_first_control_s"])],
        ["denoise extent (all DiT ranks) mean", *cells(lambda x: x["overhead"]["denoise_s"])],
        ["condition broadcast (off the DiT path)", *cells(lambda x: x["overhead"]["transfer_condition_s"])],
        ["denoise scheduled -> DiT rank starts", *cells(lambda x: x["overhead"]["dispatch_to_dit_s"])],
        ["denoise start skew across DiT ranks", *cells(lambda x: x["overhead"]["dit_start_skew_s"])],
        ["decode end -> emitted", *cells(lambda x: x["overhead"]["decode_to_emit_s"])],
    ]


def report(result: dict[str, Any], costs: Costs, args: argparse.Namespace) -> str:
    s = result["summaries"]
    labels = ["serial", "prefetch", "prefetch-reactive"]
    lines = [f"bench_schedule: {args.config}, {args.chunks} chunks, warm-up {args.warmup}, unit {args.unit} s: "
             f"E={fmt(costs.encode_s)} D={fmt(costs.denoise_s)} V={fmt(costs.decode_s)} "
             f"(ideal: serial E+D+V={fmt(costs.serial_period)}, eager prefetch D, reactive D+V="
             f"{fmt(costs.latency_floor)})", ""]
    lines.append(table(["metric", *labels], rows_of(s, costs, labels)))
    lines += ["", table(["target (prefetch, eager)", "measured", "verdict"],
                        [[v["target"], fmt(v["value"], "%" if "busy" in v["target"] else "x"),
                          "PASS" if v["ok"] else "MISS"] for v in result["verdicts"]])]
    reactive = s["prefetch-reactive"]
    lines += ["", f"reactive client (prefetch): period mean / (D+V) = "
              f"{fmt(ratio(reactive['period_s']['mean'], costs.latency_floor), 'x')}, control-to-output p50 / (D+V) = "
              f"{fmt(ratio(reactive['latency_s']['p50'], costs.latency_floor), 'x')}"]
    differ = {k: v for k, v in result["frames_differ"].items() if v}
    lines.append("frames: bit-identical across all runs" if not differ else f"frames DIFFER: {differ}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--unit", type=float, default=0.5, help="seconds; E, D, V = 0.25, 0.60, 0.30 units")
    parser.add_argument("--chunks", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=2, help="chunks left out of the steady statistics")
    parser.add_argument("--config", default="cpu-tiny")
    parser.add_argument("--image", type=Path, default=DEFAULT_IMAGE)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--json", type=Path, default=out_path("bench_schedule.json"))
    args = parse_args(parser, argv, {"unit": 0.02, "chunks": 4, "warmup": 1, "config": "cpu-mini"})
    costs = Costs.from_unit(args.unit)
    result = measure(args, costs)
    result["verdicts"] = verdicts(result["summaries"], costs)
    text = report(result, costs, args)
    print("\n" + text)
    write_json(args.json, {
        "config": args.config, "chunks": args.chunks, "warmup": args.warmup, "unit_s": args.unit,
        "costs": vars(costs), "verdicts": result["verdicts"],
        "summaries": result["summaries"], "frames_differ": result["frames_differ"], "table": text,
        "runs": {k: {"summary": r.summary, "chunks": r.chunks} for k, r in result["runs"].items()},
    }, smoke=args.smoke)
    print(f"wrote {args.json}")
    return 0 if all(v["ok"] for v in result["verdicts"]) and not any(result["frames_differ"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
