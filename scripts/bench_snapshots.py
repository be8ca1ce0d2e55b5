"""What a save and a restore cost: bytes, the stream's pause, the write, and the time to the first restored chunk.

    python scripts/bench_snapshots.py [--config cpu-tiny] [--before 4] [--repeats 3]

Starts a local server of ``--config`` with its snapshots in a temporary folder. Each repeat opens a session, runs
``--before`` chunks, saves it while it streams on (one control ahead), finishes it, then restores the snapshot
and runs its remaining chunks. Prints per repeat and the medians: the snapshot's bytes and files, the pause of the
DiT (``pause_s``: from the boundary to every rank's copy; ``wait_s``: from the request to the boundary), the
slowest rank's write and hash (``write_s``), the save round trip seen by the client, the time from
``open(restore=...)`` to its ``opened`` and to its first chunk, against a fresh ``open`` of the same session.
Saves everything to $OUT/bench_snapshots.json (``--json``: elsewhere; ``scripts.bench_json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ipc.client import Client
from scripts.bench_json import out_path, parse_args, write_json
from scripts.local_server import ROOT, LocalServer

IMAGE = (ROOT / "assets" / "start.png").read_bytes()


def one(client: Client, before: int, after: int) -> dict[str, Any]:
    started = time.monotonic()
    info = client.open(IMAGE, prompt="a harbour at dawn", seed=3, num_chunks=before + after)
    fresh_open_s = time.monotonic() - started
    for i in range(before):
        client.control(info.id, i, keys="w")
        client.next_chunk(info.id, timeout_s=300)
    client.control(info.id, before, keys="d")  # the stream is busy while it saves
    started = time.monotonic()
    snapshot = client.save(info.id, timeout_s=300)
    save_s = time.monotonic() - started
    for i in range(before + 1, before + after):
        client.control(info.id, i, keys="d")
    client.wait_closed(info.id, timeout_s=300)
    started = time.monotonic()
    restored = client.open(restore=snapshot.id)
    restore_open_s = time.monotonic() - started
    client.control(restored.id, snapshot.chunk, keys="d")
    client.next_chunk(restored.id, timeout_s=300)
    restore_first_chunk_s = time.monotonic() - started
    client.close(restored.id)
    return {"chunk": snapshot.chunk, "bytes": snapshot.bytes, "files": snapshot.files, "pause_s": snapshot.pause_s,
            "wait_s": snapshot.wait_s, "write_s": snapshot.write_s, "save_round_trip_s": save_s,
            "fresh_open_s": fresh_open_s, "restore_open_s": restore_open_s,
            "restore_first_chunk_s": restore_first_chunk_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="cpu-tiny")
    parser.add_argument("--before", type=int, default=4)
    parser.add_argument("--after", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=out_path("bench_snapshots.json"))
    # (after 2: the save is not of the last chunk, which the server refuses)
    args = parse_args(parser, argv, {"before": 2, "after": 2, "repeats": 1, "config": "cpu-mini"})
    with tempfile.TemporaryDirectory() as folder, \
            LocalServer(args.config, [f"--snapshots.dir={folder}"]) as server, Client(server.endpoint) as client:
        runs = [one(client, args.before, args.after) for _ in range(args.repeats)]
    medians = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    for run in runs:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in run.items()}))
    print("median", json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in medians.items()}))
    write_json(args.json, {"config": args.config, "runs": runs, "median": medians}, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
