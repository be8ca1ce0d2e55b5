"""Soak: one long session at full speed, sampling every rank's RSS, to show that nothing grows with length.

    python scripts/soak.py --chunks 2400            # zero-cost synthetic stages on cpu-tiny, about a minute

Prints RSS per rank (MB) at a few points of the session and saves them to out/soak.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ipc.client import Client
from scripts.local_server import ROOT, LocalServer

ZERO_COST = ["--synthetic.encode_s=0", "--synthetic.denoise_s=0", "--synthetic.decode_s=0"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="cpu-tiny")
    parser.add_argument("--chunks", type=int, default=2400)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--json", type=Path, default=ROOT / "out" / "soak.json")
    args, overrides = parser.parse_known_args(argv)
    marks = {round(args.chunks * k / args.samples) - 1 for k in range(1, args.samples + 1)} | {min(50, args.chunks - 1)}
    samples: dict[int, dict[str, int]] = {}
    with LocalServer(args.config, [*ZERO_COST, *overrides]) as server, Client(server.endpoint) as client:
        info = client.open((ROOT / "assets" / "start.png").read_bytes())

        def send() -> None:
            for index in range(args.chunks):
                client.control(info.id, index, keys="wl"[index % 2])

        threading.Thread(target=send, daemon=True).start()
        began = time.monotonic()
        for index in range(args.chunks):
            client.next_chunk(info.id, timeout_s=60)
            if index in marks:
                samples[index] = {r: m["rss"] // 2**20 for r, m in client.stats()["ranks"].items()}
        elapsed = time.monotonic() - began
        summary = client.close(info.id)
    print(f"{args.chunks} chunks in {elapsed:.1f} s; RSS per rank (MB) after chunk:")
    for index, rss in sorted(samples.items()):
        print(f"  {index + 1:6d}: {rss}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"chunks": args.chunks, "seconds": elapsed, "rss_mb": samples,
                                     "period_s": summary.get("chunk_period_s")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
