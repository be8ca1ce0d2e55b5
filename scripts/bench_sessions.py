"""Two sessions at once (DESIGN.md section 10): the DiT stays the bottleneck, and the second session's first
frame does not wait for the first session's stream to end.

    python scripts/bench_sessions.py [--unit 0.2] [--chunks 24]

Synthetic backend, prefetch schedule, stage costs E:D:V = 0.25:0.60:0.30 x unit. Session A streams ``--chunks``
chunks eagerly; once A has emitted 4 chunks, session B opens and streams half as many. Reported: B's time to
first frame next to A's (alone), when B's first frame came relative to A's last, both sessions' chunk periods
while they overlap (ideal: 2 D each, the DiT alternating), the combined emission rate during the overlap against
the DiT's 1 / D, and the longest wait between two chunks of B (no starvation). Saves $OUT/bench_sessions.json.

Correctness: B plays the first half of A's controls with A's image and seed, so B's frames must equal A's first
chunks bit for bit (sharing the ranks changes nothing a session computes); exit code 2 when they do not.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ipc.client import Client
from scripts.bench_common import EXIT_FRAMES_DIFFER, frame_digest
from scripts.bench_json import out_path, parse_args, write_json
from scripts.client import Played, load_trace, play
from scripts.local_server import ROOT, LocalServer


def overlap_stats(a: Played, b: Played, d: float) -> dict[str, Any]:
    start, end = b.chunks[0].received, min(a.chunks[-1].received, b.chunks[-1].received)
    inside = sorted(c.received for c in a.chunks + b.chunks if start <= c.received <= end)
    rate = (len(inside) - 1) / (inside[-1] - inside[0]) if len(inside) > 2 else None

    def period(p: Played) -> float | None:
        times = [c.received for c in p.chunks if start <= c.received <= end]
        return float(np.median(np.diff(times))) if len(times) > 2 else None

    return {"window_s": end - start, "combined_chunks_per_s": rate, "dit_rate_per_s": 1 / d,
            "period_a_s": period(a), "period_b_s": period(b)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--unit", type=float, default=0.2)
    parser.add_argument("--chunks", type=int, default=24)
    parser.add_argument("--config", default="cpu-tiny")
    parser.add_argument("--json", type=Path, default=out_path("bench_sessions.json"))
    args = parse_args(parser, argv, {"unit": 0.02, "chunks": 8, "config": "cpu-mini"})
    e, d, v = 0.25 * args.unit, 0.60 * args.unit, 0.30 * args.unit
    costs = [f"--synthetic.encode_s={e}", f"--synthetic.denoise_s={d}", f"--synthetic.decode_s={v}"]
    trace = load_trace(ROOT / "assets" / "demo_trace.json")
    trace = {**trace, "chunks": (trace["chunks"] * 4)[: args.chunks]}
    image = (ROOT / "assets" / "start.png").read_bytes()
    results: dict[str, Played] = {}
    with (LocalServer(args.config, costs) as server, Client(server.endpoint) as client_a,
          Client(server.endpoint) as client_b):
        thread_a = threading.Thread(target=lambda: results.__setitem__("a", play(client_a, image, trace)))
        thread_a.start()
        while client_a.stats().chunks_emitted < 4:
            time.sleep(0.01)
        opened_b = time.monotonic()
        results["b"] = play(client_b, image, {**trace, "chunks": trace["chunks"][: args.chunks // 2]})
        thread_a.join(timeout=300)
    a, b = results["a"], results["b"]
    b_chunks = [c.received for c in b.chunks]
    facts = {
        "unit_s": args.unit, "E_s": e, "D_s": d, "V_s": v,
        "first_frame_a_s": a.summary.time_to_first_frame_s.from_open,
        "first_frame_b_s": b.summary.time_to_first_frame_s.from_open,
        "b_first_frame_before_a_end_s": a.chunks[-1].received - b.chunks[0].received,
        "b_opened_after_a_chunk": 4, "b_open_to_first_frame_wall_s": b.chunks[0].received - opened_b,
        "b_longest_gap_s": float(np.max(np.diff(b_chunks))) if len(b_chunks) > 1 else None,
        **overlap_stats(a, b, d),
    }
    a_digests, b_digests = [frame_digest(c) for c in a.chunks], [frame_digest(c) for c in b.chunks]
    differ = [i for i in range(args.chunks // 2) if i >= len(b_digests) or b_digests[i] != a_digests[i]]
    facts["frames_differ"] = differ
    write_json(args.json, facts, smoke=args.smoke)
    print(f"two sessions, synthetic E/D/V = {e * 1e3:.0f}/{d * 1e3:.0f}/{v * 1e3:.0f} ms, prefetch")
    for key, value in facts.items():
        print(f"  {key:32s} {value:.3f}" if isinstance(value, float) else f"  {key:32s} {value}")
    rate = facts["combined_chunks_per_s"]
    ratio = "n/a (the streams overlapped for two chunks or fewer)" if rate is None else f"{rate * d:.3f}"
    print(f"combined rate / DiT rate = {ratio} (ideal 1.0); B's first frame came "
          f"{facts['b_first_frame_before_a_end_s']:.2f} s before A's stream ended")
    if differ or len(a.chunks) != args.chunks:
        print(f"FAIL: B's frames are not A's first {args.chunks // 2} chunks bit for bit (chunks {differ}), or A "
              f"got {len(a.chunks)} of {args.chunks} chunks", file=sys.stderr)
        return EXIT_FRAMES_DIFFER
    print(f"frames: B's {len(b_digests)} chunks bit-identical to A's first {len(b_digests)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
