"""What a drain costs a stream: the pause at the hand-off, and the chunks streamed twice.

    python scripts/bench_drain.py [--trials 5] [--before 6]

Two replicas (``cpu-mini``: 2 ranks each, synthetic backend, E/D/V = 25/60/30 ms) share one snapshot folder behind a
router (``snapshot_every`` off: the drain's own save is the only one). Each trial streams one session through the
router one chunk at a time (control i once chunk i-1 arrived) for ``--before`` chunks, then sends its replica a
SIGTERM and goes on: the client gets ``migrated`` and sends the controls again from its chunk. Reported per trial:
the stream's pause at the hand-off (the gap between the last chunk before it and the first chunk from the other
replica, next to the median gap before it), SIGTERM -> ``migrated``, the chunks streamed twice, and how long the
drained replica took to exit (and its exit code). The drained replica is restarted before the next trial. p50 and
max over the trials; saves ``$OUT/bench_drain.json`` (``scripts.bench_json``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ipc.client import Client, SessionMigrated
from scripts.bench_json import out_path, parse_args, write_json
from scripts.local_router import LocalRouter, replica_of, wait_for
from scripts.local_server import ROOT, LocalServer
from scripts.ports import free_port

IMAGE = (ROOT / "assets" / "start.png").read_bytes()
COSTS = ["--synthetic.encode_s=0.025", "--synthetic.denoise_s=0.06", "--synthetic.decode_s=0.03"]
ROUTER = ["--router.heartbeat_s=0.25", "--router.replica_dead_s=3", "--router.stats_interval_s=0.5"]
AFTER = 3  # chunks streamed on the new replica after the hand-off


def trial(router: LocalRouter, servers: dict[str, LocalServer], before: int) -> dict[str, Any]:
    with Client(router.endpoint, timeout_s=60) as client:
        info = client.open(IMAGE, seed=3, num_chunks=before + AFTER + 8)
        arrivals = []
        for index in range(before):
            client.control(info.id, index, keys="w")
            arrivals.append(client.next_chunk(info.id, timeout_s=60).received)
        holder = replica_of(client, info.id)
        client.control(info.id, before, keys="w")  # on its way when the signal comes
        process = servers[holder].process
        assert process is not None
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        last, resume = before - 1, None
        while resume is None:
            try:
                chunk = client.next_chunk(info.id, timeout_s=60)
                last, arrivals = chunk.index, [*arrivals, chunk.received]
            except SessionMigrated as moved:
                told, resume = time.monotonic() - signalled, moved.chunk
        pause = 0.0
        for index in range(resume, resume + AFTER):
            client.control(info.id, index, keys="w")
            chunk = client.next_chunk(info.id, timeout_s=60)
            assert chunk.index == index
            if index == resume:
                pause = chunk.received - arrivals[-1]
        client.close(info.id)
        code = servers[holder].wait(timeout_s=60)
        exit_s = time.monotonic() - signalled
    gaps = [b - a for a, b in itertools.pairwise(arrivals[1:])]
    return {"replica": holder, "to_migrated_s": told, "pause_s": pause, "period_s": statistics.median(gaps),
            "resume": resume, "last_before": last, "repeated": last + 1 - resume, "exit_code": code,
            "exit_s": exit_s}


def spread(values: list[float]) -> dict[str, float]:
    return {"p50": statistics.median(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--before", type=int, default=6)
    parser.add_argument("--json", type=Path, default=out_path("bench_drain.json"))
    args = parse_args(parser, argv, {"trials": 1, "before": 4})
    folder = tempfile.TemporaryDirectory(prefix="bench-drain-")
    ports = {"a": free_port(), "b": free_port()}

    overrides = {name: [*COSTS, f"--server.port={port}", f"--snapshots.dir={folder.name}", "--server.drain_s=30"]
                 for name, port in ports.items()}  # a drained replica restarts with the same
    servers = {name: LocalServer("cpu-mini", overrides[name]) for name in ports}
    router = LocalRouter([(name, f"tcp://127.0.0.1:{port}", 2) for name, port in ports.items()], ROUTER)
    started = list(servers.values())
    trials: list[dict[str, Any]] = []

    def all_up(client: Client) -> bool:
        return all(x.state == "up" for x in client.stats().replicas.values())

    with router:
        try:
            for s in started:
                s.start()
            for n in range(args.trials):
                with Client(router.endpoint, timeout_s=10) as c:
                    wait_for("replicas up", lambda c=c: all_up(c), 60)
                got = trial(router, servers, args.before)
                trials.append(got)
                print(f"trial {n}: pause {got['pause_s'] * 1e3:.0f} ms (period {got['period_s'] * 1e3:.0f} ms), "
                      f"SIGTERM -> migrated {got['to_migrated_s']:.3f} s, {got['repeated']} chunks again, "
                      f"exit {got['exit_code']} after {got['exit_s']:.2f} s", flush=True)
                dead = got["replica"]
                if n < args.trials - 1:  # restarted for a next trial only
                    servers[dead] = LocalServer("cpu-mini", overrides[dead])
                    started.append(servers[dead])
                    servers[dead].start()
        finally:
            for s in started:
                s.stop()
        router.stop()
    result: dict[str, Any] = {
        "trials": trials, "pause_s": spread([t["pause_s"] for t in trials]),
        "to_migrated_s": spread([t["to_migrated_s"] for t in trials]),
        "period_s": statistics.median(t["period_s"] for t in trials),
        "repeated": {"p50": statistics.median(t["repeated"] for t in trials),
                     "max": max(t["repeated"] for t in trials)},
        "exit_codes": sorted({t["exit_code"] for t in trials}), "exit_s": spread([t["exit_s"] for t in trials])}
    print(json.dumps({k: v for k, v in result.items() if k != "trials"}))
    write_json(args.json, result, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
