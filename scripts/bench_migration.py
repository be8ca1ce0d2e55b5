"""What ``[router] snapshot_every`` costs a stream, and how fast a session resumes when its replica dies.

    python scripts/bench_migration.py [--every 4] [--chunks 40] [--rounds 3] [--trials 2]

Two replicas (``cpu-mini``: 2 ranks each, synthetic backend, E/D/V = 25/60/30 ms) share one snapshot folder; two
routers in front of them, one with ``snapshot_every = 0`` (off) and one with ``snapshot_every = K``, in the same run.
Each round streams one session through each router (the order alternates), every control sent ahead (an eager
client: the stream runs at the replica's own pace): the chunk period is the median gap between arrivals after two
warm-up chunks. Reported: each mode's median period and their ratio (K over off), round by round and overall.

Then ``--trials`` times: a session through the K router is stepped one chunk at a time (control i once chunk i-1
arrived) until the router has saved it, rank 1 of the replica holding it is SIGKILLed, and we time kill -> the
client's ``migrated`` notice and kill -> the first frame on the survivor (the client sends the control of the resume
chunk when told). The killed replica is restarted at its endpoint before the next trial. Saves
``$OUT/bench_migration.json`` (``scripts.bench_json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
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
WARMUP = 2


def period(endpoint: str, chunks: int) -> float:
    """The median gap between chunk arrivals of one eager session through ``endpoint``."""
    with Client(endpoint, timeout_s=120) as client:
        info = client.open(IMAGE, seed=1, num_chunks=chunks)
        sender = threading.Thread(target=lambda: [client.control(info.id, i, keys="w") for i in range(chunks)])
        sender.start()
        arrivals = [client.next_chunk(info.id, timeout_s=120).received for _ in range(chunks)]
        sender.join()
        client.wait_closed(info.id, timeout_s=60)
    gaps = [b - a for a, b in zip(arrivals[WARMUP:], arrivals[WARMUP + 1:])]
    return statistics.median(gaps)


def migration(router: LocalRouter, servers: dict[str, LocalServer]) -> dict[str, Any]:
    with Client(router.endpoint, timeout_s=60) as client:
        saves = client.stats().router.autosaves
        info = client.open(IMAGE, seed=2, num_chunks=200)
        index = 0
        while index < 6 or client.stats().router.autosaves <= saves:
            client.control(info.id, index, keys="w")
            client.next_chunk(info.id, timeout_s=60)
            index += 1
        holder = replica_of(client, info.id)
        killed = time.monotonic()
        servers[holder].kill_rank(1)
        try:
            client.next_chunk(info.id, timeout_s=60)
            raise AssertionError("a chunk came before the migrated notice")
        except SessionMigrated as moved:
            told = time.monotonic() - killed
            resume = moved.chunk
        client.control(info.id, resume, keys="w")
        chunk = client.next_chunk(info.id, timeout_s=60)
        first = time.monotonic() - killed
        assert chunk.index == resume
        client.close(info.id)
    return {"replica": holder, "to_notice_s": told, "to_first_frame_s": first, "resume": resume,
            "streamed": index, "again": index - resume}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--json", type=Path, default=out_path("bench_migration.json"))
    args = parse_args(parser, argv, {"every": 2, "chunks": 6, "rounds": 1, "trials": 1})
    folder = tempfile.TemporaryDirectory(prefix="bench-migration-")
    ports = {"a": free_port(), "b": free_port()}

    def replica(name: str) -> LocalServer:
        return LocalServer("cpu-mini", [*COSTS, f"--server.port={ports[name]}", f"--snapshots.dir={folder.name}",
                                        "--server.send_hwm=512"])

    servers = {name: replica(name) for name in ports}
    listed = [(name, f"tcp://127.0.0.1:{port}", 2) for name, port in ports.items()]
    off = LocalRouter(listed, ROUTER)
    on = LocalRouter(listed, [*ROUTER, f"--router.snapshot_every={args.every}"])
    result: dict[str, Any] = {"every": args.every, "chunks": args.chunks, "rounds": [], "migrations": []}
    started = list(servers.values())
    with off, on:
        try:
            for s in started:
                s.start()
            for r in (off, on):
                with Client(r.endpoint, timeout_s=10) as c:
                    wait_for("replicas up", lambda c=c: all(x.state == "up" for x in c.stats().replicas
                                                            .values()), 60)
            for n in range(args.rounds):
                order = [("off", off), ("on", on)] if n % 2 == 0 else [("on", on), ("off", off)]
                got = {mode: period(r.endpoint, args.chunks) for mode, r in order}
                got["ratio"] = got["on"] / got["off"]
                result["rounds"].append(got)
                print(f"round {n}: period off {got['off'] * 1e3:.1f} ms, K={args.every} {got['on'] * 1e3:.1f} ms, "
                      f"ratio {got['ratio']:.3f}", flush=True)
            with Client(on.endpoint) as c:
                result["autosaves"] = c.stats().router.autosaves
            for n in range(args.trials):
                trial = migration(on, servers)
                result["migrations"].append(trial)
                print(f"trial {n}: SIGKILL -> migrated {trial['to_notice_s']:.3f} s, -> first frame "
                      f"{trial['to_first_frame_s']:.3f} s (resumed at {trial['resume']}, {trial['again']} again)",
                      flush=True)
                dead = trial["replica"]
                servers[dead].wait(timeout_s=30)
                if n == args.trials - 1:
                    break  # restarted for a next trial only
                servers[dead] = replica(dead)
                started.append(servers[dead])
                servers[dead].start()
                with Client(on.endpoint, timeout_s=10) as c:
                    wait_for("replica back", lambda c=c, dead=dead: c.stats().replicas[dead].state == "up", 60)
        finally:
            for s in started:
                s.stop()
    rounds = result["rounds"]
    result["period_off_s"] = statistics.median(r["off"] for r in rounds)
    result["period_on_s"] = statistics.median(r["on"] for r in rounds)
    result["ratio"] = statistics.median(r["ratio"] for r in rounds)
    print(json.dumps({k: v for k, v in result.items() if k not in ("rounds", "migrations")}))
    write_json(args.json, result, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
