"""Soak: long sessions at full speed, sampling every rank's RSS, to show that nothing grows with length.

    python scripts/soak.py --chunks 2400            # zero-cost synthetic stages on cpu-tiny, about a minute
    python scripts/soak.py --hold --chunks 5000     # one session per held key (W, S, A, D, a mouse turn)

The default session alternates W and L. ``--hold`` runs one session per motion that holds it for every chunk:
the camera walks (or turns) the whole way, and every per-session quantity that grows with it must stay finite and
cheap. Prints RSS per rank (MB) at a few points of each session, exits non-zero on any error, saves
out/soak.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ipc.client import Client
from ipc.protocol import to_builtins
from scripts.local_server import ROOT, LocalServer

ZERO_COST = ["--synthetic.encode_s=0", "--synthetic.denoise_s=0", "--synthetic.decode_s=0"]


HOLDS = {"w": {"keys": "w"}, "s": {"keys": "s"}, "a": {"keys": "a"}, "d": {"keys": "d"},
         "mouse": {"mouse": (30.0, 0.0)}}  # a turn of 30 degrees per chunk, for the whole session


def soak(client: Client, chunks: int, marks: set[int], control: Callable[[int], dict]) -> dict[str, object]:
    """One session of ``chunks`` chunks; RSS per rank at ``marks``."""
    info = client.open((ROOT / "assets" / "start.png").read_bytes(), num_chunks=chunks)
    errors: list[str] = []

    def send() -> None:
        try:
            for index in range(chunks):
                client.control(info.id, index, **control(index))
        except Exception as error:  # reported below: the soak fails
            errors.append(f"{type(error).__name__}: {error}")

    threading.Thread(target=send, daemon=True).start()
    samples: dict[int, dict[str, int]] = {}
    began = time.monotonic()
    for index in range(chunks):
        chunk = client.next_chunk(info.id, timeout_s=60)
        if chunk.index != index:
            errors.append(f"chunk {chunk.index} arrived where {index} was due")
        if index in marks:
            samples[index] = {r: m.rss // 2**20 for r, m in client.stats().ranks.items()}
    elapsed = time.monotonic() - began
    summary = client.wait_closed(info.id, timeout_s=60)
    if summary.reason != "complete":
        errors.append(f"closed with {summary.reason}: {summary.error}")
    return {"chunks": chunks, "seconds": elapsed, "rss_mb": samples, "errors": errors,
            "period_s": to_builtins(summary.chunk_period_s)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="cpu-tiny")
    parser.add_argument("--chunks", type=int, default=2400)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--hold", action="store_true", help="one session per held key and a mouse turn")
    parser.add_argument("--json", type=Path, default=ROOT / "out" / "soak.json")
    args, overrides = parser.parse_known_args(argv)
    marks = {round(args.chunks * k / args.samples) - 1 for k in range(1, args.samples + 1)} | {min(50, args.chunks - 1)}
    runs: dict[str, dict[str, object]] = {}
    sessions = HOLDS if args.hold else {"wl": None}
    with LocalServer(args.config, [*ZERO_COST, *overrides]) as server, Client(server.endpoint) as client:
        for name, held in sessions.items():
            control = (lambda _i, c=held: c) if held is not None else (lambda i: {"keys": "wl"[i % 2]})
            runs[name] = run = soak(client, args.chunks, marks, control)
            print(f"{name}: {run['chunks']} chunks in {run['seconds']:.1f} s; RSS per rank (MB) after chunk:")
            for index, rss in sorted(run["rss_mb"].items()):  # type: ignore[attr-defined]
                print(f"  {index + 1:6d}: {rss}")
            for error in run["errors"]:  # type: ignore[attr-defined]
                print(f"  ERROR {error}")
            sys.stdout.flush()  # one session's result as soon as it ends: a 5 x 5000-chunk soak takes a while
    failed = any(run["errors"] for run in runs.values())
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(runs, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
