"""What the router costs and how fast it fails over (issue 14), measured side by side on one machine.

    python scripts/bench_router.py [--sessions 4] [--chunks 40] [--rounds 3] [--no-failover]

Two replicas (``cpu-mini``: 2 ranks each, synthetic backend, E/D/V = 25/60/30 ms) and one router, all on loopback.
Each round runs four phases of K sessions, one after the other (the order rotates between rounds):

- **direct** (eager clients: every control sent ahead, as a recorded trace): K/2 sessions straight to replica a and
  K/2 straight to replica b at once: the two replicas' own chunk rates, saturated;
- **routed** (eager): K sessions through the router, which places K/2 on each replica: the aggregate rate through it;
- **mixed** (players at the media rate: control[i] sent when chunk i's turn comes in real time, 12 frames at 16 fps
  = 0.75 s, or once chunk i-1 arrived if later): K/2 sessions through the router, K/2 straight to the replicas (K/4
  to each) and K/2 through a bare forwarder per replica (its own process:
  one DEALER per client, frames passed on with no decoding and no rules: the floor of any router that is a ZeroMQ
  hop), all at the same time, so their chunks leave the same replicas in the same seconds under the same machine
  load and their latencies compare side by side even on a shared, loaded machine;
- **player** (reactive): K sessions through the router: the router's CPU per stream for player-like clients.

Delivery latency of a chunk = its client's arrival time - the replica's emission time (``facts.times.emitted``; one
machine: every process reads the same CLOCK_MONOTONIC); the first two chunks of each session are warm-up and left
out. Reported: the router's added latency per chunk, p50 and p99 of routed minus direct within the mixed phases
(headline; the eager phases' difference too), and how much of it one more ZeroMQ hop costs by itself (bare minus
direct); the router's CPU per stream (its process CPU seconds over the phase's
wall time, less what it spends idle, divided by K) and per forwarded chunk, with the client messages it carried per
chunk (eager clients resend a control at the server's retry hint while its edge is full: that, not the chunks, is
most of an eager stream's cost); the aggregate chunk rate through the router (routed) over the sum of the two
replicas' own rates (direct), each over the window in which all its sessions stream.

Failover (unless ``--no-failover``), with the router's default deadlines (heartbeat 0.5 s, replica_dead_s 5 s):
one session streams on each replica, a rank of replica b is SIGKILLed (rank 1: the replica's rank 0 notices and
tells the router; rank 0: only the router's heartbeat deadline notices), and we time kill -> b's client gets
``rank_failed``, kill -> a new session opened through the router (on a), and, after b is restarted at its endpoint,
restart -> b serving -> the router has it up again. Saves ``out/bench_router.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import psutil
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ipc.client import Busy, Client
from ipc.metrics_types import RouterCounters
from scripts.bench_common import distribution, fmt, ratio, table
from scripts.bench_json import out_path, parse_args, write_json
from scripts.client import Played, load_trace, play
from scripts.local_router import LocalRouter, Streamer
from scripts.local_server import ROOT, LocalServer
from scripts.ports import free_port

WARMUP = 2
IDLE_S = 5.0  # the router's idle CPU is measured this long (``--idle-s``)


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def overlap_rate(plays: list[Played]) -> float | None:
    """Chunks per second while every one of ``plays`` streams (from the latest first steady chunk to the earliest
    last chunk)."""
    steady = [[c.received for c in p.chunks if c.index >= WARMUP] for p in plays]
    if any(len(s) < 2 for s in steady):
        return None
    start, end = max(s[0] for s in steady), min(s[-1] for s in steady)
    inside = sorted(t for s in steady for t in s if start <= t <= end)
    return (len(inside) - 1) / (inside[-1] - inside[0]) if len(inside) > 2 else None


def bare_forwarder(port: int, replica: str) -> None:
    """One process forwarding clients on ``port`` to ``replica`` and back with nothing else: a DEALER per client
    identity, each frame passed on as it came (``copy=False``). The floor of any router that is a ZeroMQ hop."""
    context = zmq.Context()
    front = context.socket(zmq.ROUTER)
    front.bind(f"tcp://127.0.0.1:{port}")
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    backs: dict[bytes, zmq.Socket] = {}
    owner: dict[zmq.Socket, bytes] = {}
    while True:
        for sock in dict(poller.poll()):
            if sock is front:
                identity, frame = front.recv_multipart(copy=False)
                back = backs.get(identity.bytes)
                if back is None:
                    back = backs[identity.bytes] = context.socket(zmq.DEALER)
                    back.connect(replica)
                    owner[back] = identity.bytes
                    poller.register(back, zmq.POLLIN)
                back.send(frame, copy=False)
            else:  # every part as it came (a chunk is its map and its frames part)
                front.send_multipart([owner[sock], *sock.recv_multipart(copy=False)], copy=False)


def play_paced(client: Client, image: bytes, trace: dict[str, Any], pace_s: float) -> Played:
    """A player at the media rate: control[i] leaves at open + i * ``pace_s`` (or when chunk i-1 arrived, if
    later); the session streams about as fast as it is watched, as a person plays it."""
    steps = trace["chunks"]
    started = time.monotonic()
    info = client.open(image, num_chunks=len(steps))
    played = Played(session=info.id, fps=info.fps, opened_s=time.monotonic() - started)
    ready = time.monotonic()
    for index, step in enumerate(steps):
        time.sleep(max(0.0, ready + index * pace_s - time.monotonic()))
        client.control(info.id, index, keys=step.get("keys", ""), mouse=tuple(step.get("mouse", (0, 0))))
        played.chunks.append(client.next_chunk(info.id, timeout_s=60))
    played.summary = client.wait_closed(info.id)
    played.wall_s = time.monotonic() - started
    return played


def router_counters(router: LocalRouter) -> RouterCounters:
    with Client(router.endpoint, timeout_s=10) as probe:
        return probe.stats().router


def run_phase(endpoints: list[str], image: bytes, trace: dict[str, Any], router: LocalRouter, reactive: bool,
              measure_router: bool, bare: tuple[str, ...] = (), pace_s: float | None = None) -> dict[str, Any]:
    """Play one session per endpoint at once; what each client saw (latencies split by the router's endpoint)."""
    router_endpoint = router.endpoint
    router_pid = router.process.pid if measure_router and router.process is not None else None
    before = router_counters(router) if router_pid else RouterCounters()
    plays: dict[int, Played] = {}
    errors: list[BaseException] = []
    clients = [Client(e, timeout_s=120) for e in endpoints]

    def run(n: int) -> None:
        try:
            plays[n] = (play(clients[n], image, trace, reactive=reactive) if pace_s is None
                        else play_paced(clients[n], image, trace, pace_s))
        except BaseException as error:  # surfaced below
            errors.append(error)

    cpu0 = cpu_seconds(router_pid) if router_pid else 0.0
    began = time.monotonic()
    threads = [threading.Thread(target=run, args=(n,)) for n in range(len(endpoints))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    wall = time.monotonic() - began
    cpu = (cpu_seconds(router_pid) - cpu0) if router_pid else None
    after = router_counters(router) if router_pid else RouterCounters()
    for c in clients:
        c.close_client()
    if errors:
        raise errors[0]
    ordered = [plays[n] for n in range(len(endpoints))]

    def delivery(kind: str) -> list[float]:
        return [c.received - c.facts.times.emitted for e, p in zip(endpoints, ordered)
                if kind_of(e) == kind for c in p.chunks if c.index >= WARMUP]

    def kind_of(endpoint: str) -> str:
        return "routed" if endpoint == router_endpoint else "bare" if endpoint in bare else "direct"

    latencies = delivery("routed") + delivery("direct")
    by_endpoint: dict[str, list[Played]] = {}
    for endpoint, p in zip(endpoints, ordered):
        by_endpoint.setdefault(endpoint, []).append(p)
    rates = {e: overlap_rate(ps) for e, ps in by_endpoint.items()}
    chunks = sum(len(p.chunks) for p in ordered)
    return {"latencies": latencies, "routed_latencies": delivery("routed"), "direct_latencies": delivery("direct"),
            "bare_latencies": delivery("bare"),
            "rates": rates, "rate": overlap_rate(ordered), "wall_s": wall,
            "router_cpu_s": cpu, "chunks": chunks,
            "client_messages": after.client_messages - before.client_messages,
            "in_order": all([c.index for c in p.chunks] == list(range(len(trace["chunks"]))) for p in ordered)}


def settle(router: LocalRouter) -> None:
    """Wait until the router's view of every replica is empty again (its stats are read every second): the next
    phase starts from the same placement."""
    with Client(router.endpoint, timeout_s=10) as probe:
        while any(r.load for r in probe.stats().replicas.values()):
            time.sleep(0.1)


def failover(kind: int, router: LocalRouter, a: LocalServer, b: LocalServer, image: bytes,
             b_overrides: list[str]) -> tuple[dict[str, float], LocalServer]:
    """Kill rank ``kind`` of b under a streaming session; time what follows. Returns the timings and the new b."""
    clients = [Client(router.endpoint, timeout_s=30) for _ in range(3)]
    try:
        streamers = []
        for client in clients[:2]:
            info = client.open(image)
            streamers.append(Streamer(client, info.id, client.stats().per_session[info.id].replica))
        assert sorted(s.replica for s in streamers) == ["a", "b"], [s.replica for s in streamers]
        threads = [s.start() for s in streamers]
        while not all(len(s.chunks) >= 3 for s in streamers):
            time.sleep(0.02)
        lost = next(s for s in streamers if s.replica == "b")
        kept = next(s for s in streamers if s.replica == "a")
        killed = time.monotonic()
        b.kill_rank(kind)
        while lost.error is None:
            time.sleep(0.005)
        told = lost.error_at - killed
        while True:
            try:
                opened = clients[2].open(image, num_chunks=2)
                break
            except Busy as error:
                time.sleep(min(0.2, error.retry_after_s or 0.2))
        new_session = time.monotonic() - killed
        where = clients[2].stats().per_session[opened.id].replica
        clients[2].close(opened.id)
        b.wait(timeout_s=60)
        relaunched = time.monotonic()
        restarted = LocalServer("cpu-mini", b_overrides).start()
        serving = time.monotonic()
        with Client(router.endpoint, timeout_s=10) as probe:
            while probe.stats().replicas["b"].state != "up":
                time.sleep(0.02)
        up = time.monotonic()
        kept.stop.set()
        for t in threads:
            t.join(timeout=30)
        assert kept.error is None and lost.error is not None and lost.error.code == "rank_failed", lost.error
        assert "replica b" in lost.error.message and where == "a"
        return {"kill_to_client_error_s": told, "kill_to_new_session_s": new_session,
                "restart_to_serving_s": serving - relaunched, "serving_to_rejoined_s": up - serving,
                "restart_to_rejoined_s": up - relaunched, "error": lost.error.message}, restarted
    finally:
        for c in clients:
            c.close_client()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=4, help="K, even: K/2 per replica")
    parser.add_argument("--chunks", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--pace", type=float, default=0.75, help="seconds per chunk of the mixed phase's players "
                        "(0.75: the media rate of a 12-frame chunk at 16 fps)")
    parser.add_argument("--paced-chunks", type=int, default=20)
    parser.add_argument("--no-failover", action="store_true")
    parser.add_argument("--size", default="160x256", help="frame height x width of the replicas' streams")
    parser.add_argument("--idle-s", type=float, default=IDLE_S, help="seconds the router's idle CPU is measured")
    parser.add_argument("--json", type=Path, default=out_path("bench_router.json"))
    args = parse_args(parser, argv, {"sessions": 2, "chunks": 6, "rounds": 1, "pace": 0.05, "paced_chunks": 4,
                                     "no_failover": True, "idle_s": 0.5})
    k = args.sessions
    if k < 2 or k % 2:
        parser.error("--sessions must be even and >= 2")
    trace = load_trace(ROOT / "assets" / "demo_trace.json")
    def cut(n: int) -> dict[str, Any]:
        return {**trace, "chunks": (trace["chunks"] * (n // len(trace["chunks"]) + 1))[:n]}

    paced, trace = cut(args.paced_chunks), cut(args.chunks)
    image = (ROOT / "assets" / "start.png").read_bytes()
    ports = {"a": free_port(), "b": free_port()}
    height, width = (int(v) for v in args.size.split("x"))
    replica = [f"--server.max_sessions={2 * k}", "--server.send_hwm=512",  # the mixed phase holds 3K/2
               f"--stream.height={height}", f"--stream.width={width}"]
    overrides = {n: [*replica, f"--server.port={p}"] for n, p in ports.items()}
    log_dir = args.json.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    a = LocalServer("cpu-mini", overrides["a"], log_path=log_dir / "bench-router-a.log")
    b = LocalServer("cpu-mini", overrides["b"], log_path=log_dir / "bench-router-b.log")
    router = LocalRouter([(n, f"tcp://127.0.0.1:{p}", 2 * k) for n, p in ports.items()],
                         log_path=log_dir / "bench-router.log")
    phases: dict[str, list[dict[str, Any]]] = {"direct": [], "routed": [], "mixed": [], "player": []}
    hold: dict[str, Any] = {}
    failovers: dict[str, dict[str, float]] = {}
    servers = [a, b]
    bare_ports = [free_port(), free_port()]
    bare_ends = [f"tcp://127.0.0.1:{port}" for port in bare_ports]
    forwarders = [multiprocessing.get_context("spawn").Process(target=bare_forwarder, daemon=True,
                                                               args=(port, f"tcp://127.0.0.1:{ports[name]}"))
                  for port, name in zip(bare_ports, ("a", "b"))]
    try:
        for server in (a, b):
            server.start()
        router.start()
        for forwarder in forwarders:
            forwarder.start()
        assert router.process is not None
        with Client(router.endpoint) as probe:
            while {r.state for r in probe.stats().replicas.values()} != {"up"}:
                time.sleep(0.05)
        print(f"two cpu-mini replicas and the router up; {k} sessions x {args.chunks} chunks, {args.rounds} rounds",
              flush=True)
        cpu0, began = cpu_seconds(router.process.pid), time.monotonic()
        time.sleep(args.idle_s)  # its heartbeats, stats reads and timer turns with no session: subtracted below
        idle_cores = (cpu_seconds(router.process.pid) - cpu0) / (time.monotonic() - began)
        modes = ("direct", "routed", "mixed", "player")
        direct_ends = [a.endpoint] * (k // 2) + [b.endpoint] * (k // 2)
        plans = {"direct": direct_ends, "routed": [router.endpoint] * k, "player": [router.endpoint] * k,
                 "mixed": [router.endpoint] * (k // 2) + [a.endpoint] * (k // 4) + [b.endpoint] * (k // 2 - k // 4)
                 + [bare_ends[0]] * (k // 4) + [bare_ends[1]] * (k // 2 - k // 4)}
        for n in range(args.rounds):
            for mode in modes[n % 4:] + modes[: n % 4]:
                result = run_phase(plans[mode], image, trace if mode != "mixed" else paced, router,
                                   reactive=mode == "player", measure_router=mode in ("routed", "player"),
                                   bare=tuple(bare_ends), pace_s=args.pace if mode == "mixed" else None)
                phases[mode].append(result)
                print(f"  round {n + 1} {mode}: p50 delivery routed "
                      f"{fmt(distribution(result['routed_latencies'])['p50'])}, direct "
                      f"{fmt(distribution(result['direct_latencies'])['p50'])}; {result['chunks']} chunks in "
                      f"{result['wall_s']:.1f} s", flush=True)
                settle(router)
        if not args.no_failover:
            for kind, label in ((1, "kill_rank_1"), (0, "kill_rank_0")):
                settle(router)
                failovers[label], b = failover(kind, router, a, b, image, overrides["b"])
                servers.append(b)
                timings = {key: round(v, 3) for key, v in failovers[label].items() if key != "error"}
                print(f"  failover {label}: {json.dumps(timings)}", flush=True)
        hold = msgspec.to_builtins(router_counters(router).chunk_hold_s)  # a typed Distribution: read as a dict
    finally:
        for forwarder in forwarders:
            if forwarder.is_alive():
                forwarder.terminate()
        for server in servers:
            server.stop()
        router.stop()

    def pooled(mode: str, key: str) -> dict[str, Any]:
        return distribution([x for r in phases[mode] for x in r[key]])

    mixed_direct, mixed_routed = pooled("mixed", "direct_latencies"), pooled("mixed", "routed_latencies")
    mixed_bare = pooled("mixed", "bare_latencies")
    direct_rate = [sum(v for v in r["rates"].values() if v) for r in phases["direct"]]
    routed_rate = [r["rate"] or 0.0 for r in phases["routed"]]

    def cost(mode: str) -> dict[str, float]:
        runs = phases[mode]
        wall = sum(r["wall_s"] for r in runs)
        cores = sum(r["router_cpu_s"] for r in runs) / wall - idle_cores
        chunks = sum(r["chunks"] for r in runs)
        return {"router_cores": cores, "router_cores_per_stream": cores / k,
                "router_cpu_per_chunk_s": cores * wall / chunks,
                "client_messages_per_chunk": sum(r["client_messages"] for r in runs) / chunks}

    facts = {
        "sessions": k, "chunks": args.chunks, "rounds": args.rounds, "layout": "cpu-mini", "pace_s": args.pace,
        "size": args.size,
        "paced_chunks": args.paced_chunks,
        "load_average": list(os.getloadavg()), "cpus": os.cpu_count(), "router_idle_cores": idle_cores,
        "mixed_delivery_latency_direct_s": mixed_direct, "mixed_delivery_latency_routed_s": mixed_routed,
        "added_latency_p50_s": mixed_routed["p50"] - mixed_direct["p50"],
        "added_latency_p99_s": mixed_routed["p99"] - mixed_direct["p99"],
        "added_latency_p50_by_mixed_round_s": [distribution(r["routed_latencies"])["p50"]
                                               - distribution(r["direct_latencies"])["p50"] for r in phases["mixed"]],
        "mixed_delivery_latency_bare_s": mixed_bare,
        "bare_hop_p50_s": mixed_bare["p50"] - mixed_direct["p50"],
        "bare_hop_p99_s": mixed_bare["p99"] - mixed_direct["p99"],
        "router_beyond_bare_hop_p50_s": mixed_routed["p50"] - mixed_bare["p50"],
        "delivery_latency_player_routed_s": pooled("player", "latencies"),
        "delivery_latency_direct_eager_s": pooled("direct", "latencies"),
        "delivery_latency_routed_eager_s": pooled("routed", "latencies"),
        "cost_player": cost("player"), "cost_eager": cost("routed"), "router_chunk_hold_s": hold,
        "aggregate_rate_direct_per_s": direct_rate, "aggregate_rate_routed_per_s": routed_rate,
        "rate_ratio": ratio(sum(routed_rate), sum(direct_rate)),  # None: no window where all sessions streamed
        "rate_ratio_by_round": [ratio(r, d) for d, r in zip(direct_rate, routed_rate)],
        "every_chunk_in_order": all(r["in_order"] for rs in phases.values() for r in rs),
        "failover": failovers,
    }
    write_json(args.json, facts, smoke=args.smoke)
    eager, routed_eager = pooled("direct", "latencies"), pooled("routed", "latencies")
    rows = [
        ["mixed (players): delivery p50", fmt(mixed_direct["p50"]), fmt(mixed_routed["p50"]),
         fmt(facts["added_latency_p50_s"])],
        ["mixed (players): delivery p99", fmt(mixed_direct["p99"]), fmt(mixed_routed["p99"]),
         fmt(facts["added_latency_p99_s"])],
        ["mixed: a bare ZeroMQ hop instead, p50", fmt(mixed_direct["p50"]), fmt(mixed_bare["p50"]),
         fmt(facts["bare_hop_p50_s"])],
        ["mixed: a bare ZeroMQ hop instead, p99", fmt(mixed_direct["p99"]), fmt(mixed_bare["p99"]),
         fmt(facts["bare_hop_p99_s"])],
        ["eager phases: delivery p50", fmt(eager["p50"]), fmt(routed_eager["p50"]),
         fmt(routed_eager["p50"] - eager["p50"])],
        ["aggregate chunk rate (eager, chunks/s)", f"{sum(direct_rate) / len(direct_rate):.2f}",
         f"{sum(routed_rate) / len(routed_rate):.2f}", f"ratio {fmt(facts['rate_ratio'], 'x')}"],
    ]
    print(table(["", "direct", "routed", "router adds"], rows))
    def us(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e6:.0f} us"

    print(f"a chunk's stay in the router (read off the replica's socket -> queued for its client): p50 "
          f"{us(hold.get('p50'))}, p99 {us(hold.get('p99'))} over {hold.get('count')} chunks")
    print(f"router CPU idle (heartbeats, stats, timers): {idle_cores:.4f} cores; above that:")
    for label, c in (("player clients", facts["cost_player"]), ("eager clients", facts["cost_eager"])):
        print(f"router CPU, {label}: {c['router_cores']:.3f} cores for {k} streams = "
              f"{c['router_cores_per_stream']:.4f} cores per stream, {c['router_cpu_per_chunk_s'] * 1e6:.0f} us per "
              f"chunk ({c['client_messages_per_chunk']:.1f} client messages per chunk)")
    for label, f in failovers.items():
        print(f"{label}: kill -> client error {f['kill_to_client_error_s']:.2f} s, kill -> new session on the "
              f"survivor {f['kill_to_new_session_s']:.2f} s, restart -> serving {f['restart_to_serving_s']:.1f} s, "
              f"serving -> rejoined {f['serving_to_rejoined_s']:.2f} s")
    print(f"saved {args.json}")
    return 0 if facts["every_chunk_in_order"] else 1


if __name__ == "__main__":
    sys.exit(main())
