"""How many players hold real time: admission by real-time capacity with the degrade ladder, against fixed 4 steps.

    python scripts/bench_capacity.py [--settle 4] [--hold 8] [--max-sessions 8]

CPU layout ``configs/cpu-capacity.toml`` (3 ranks, synthetic backend; a denoise costs 0.3 s at 4 steps and in
proportion to its passes: 0.18 s at 2, 0.12 s at 1; a chunk is 0.75 s of media). Sessions arrive one by one: each
new one opens once every session present has run ``--settle`` chunks since the last change, until the server
refuses (``busy``) or ``--max-sessions`` are open; then all are held for ``--hold`` more chunks. Run twice, side by
side: the ladder on (``capacity.ladder = newest``, floors at 1 step) and off (fixed 4 steps).

Each phase (n sessions present) records the server's predicted chunk period and each session's measured periods
(rank-0 emission times) over the phase's steady chunks (those after ``--settle``). Verdicts (exit 1 on a FAIL):

- the ladder holds at least 2x the sessions fixed steps hold, every one admitted in real time;
- every admitted session's measured real-time factor (media / period) is >= 0.97 at p10 over its steady chunks of
  the final phase;
- no session was refused while the model said there was room: at each refusal, the server's own stage estimates
  put n + 1 sessions at their lowest steps beyond real time with the margin;
- the predicted period is within 10 % of the measured one at p50 over every session of every phase.

Saves everything to $OUT/bench_capacity.json (``scripts.bench_json``).
"""

from __future__ import annotations

import argparse
import io
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ipc.client import Busy, ChunkResult, Client, ServerError
from ipc.metrics_types import CapacityStats, SeatStats
from scripts.bench_common import fmt, table
from scripts.bench_json import out_path, parse_args, write_json
from scripts.local_server import LocalServer

CONFIG = "cpu-capacity"
MEDIA_S = 12 / 16  # a steady chunk of the config: 12 frames at 16 fps


def png() -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((160, 256, 3), 90, dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


class Player:
    """One session sending its controls as fast as the server takes them (eager), its chunks collected."""

    def __init__(self, endpoint: str, **open_args: Any) -> None:
        self.client = Client(endpoint)
        try:
            self.info = self.client.open(png(), seed=1, **open_args)
        except Exception:
            self.client.close_client()
            raise
        self.chunks: list[ChunkResult] = []
        self.stop = threading.Event()
        for target in (self._send, self._receive):
            threading.Thread(target=target, daemon=True).start()

    def _send(self) -> None:
        index = 0
        while not self.stop.is_set():
            try:
                self.client.control(self.info.id, index, keys="d")
            except (ServerError, TimeoutError):
                return
            index += 1

    def _receive(self) -> None:
        try:
            for chunk in self.client.chunks(self.info.id, timeout_s=60):
                self.chunks.append(chunk)
        except (ServerError, TimeoutError):
            return

    def wait_for(self, what: str, test: Callable[[ChunkResult], bool], after: int = 0, timeout_s: float = 60) -> int:
        """Index of the first chunk from ``after`` on that passes ``test``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for chunk in list(self.chunks):
                if chunk.index >= after and test(chunk):
                    return chunk.index
            time.sleep(0.02)
        raise AssertionError(f"session {self.info.id}: no chunk {what} within {timeout_s} s: "
                             f"{[(c.index, c.facts.steps, c.facts.steps_changed) for c in self.chunks]}")

    def own_stats(self, ready: Callable[[SeatStats], bool], timeout_s: float = 60) -> SeatStats:
        """This session's entry in the server's capacity stats, once ``ready`` holds (or at the deadline)."""
        deadline = time.monotonic() + timeout_s
        while True:
            mine = self.client.stats().capacity.sessions[self.info.id]
            if ready(mine) or time.monotonic() > deadline:
                return mine
            time.sleep(0.1)

    def close(self) -> None:
        self.stop.set()
        try:
            self.client.close(self.info.id, timeout_s=60)
        finally:
            self.client.close_client()


def floor_period(stage_s: dict[str, float], n: int, floor: int) -> float | None:
    """The period of ``n`` sessions at ``floor`` steps from the server's stage estimates (``stats.capacity.stage_s``,
    keyed ``stage/steps/HxW``), a missing steps setting of the DiT scaled by its passes as the model does."""
    per_stage: dict[str, float] = {}
    for stage in ("condition", "denoise", "decode"):
        known = {int(k.split("/")[1]): v for k, v in stage_s.items() if k.split("/")[0] == stage}
        if floor in known:
            per_stage[stage] = known[floor]
        elif known:
            steps, t = next(iter(sorted(known.items(), reverse=True)))
            per_stage[stage] = t * (floor + 1) / (steps + 1) if stage == "denoise" else t
        else:
            return None
    return n * max(per_stage.values())


def run(ladder: str, settle: int, hold: int, max_sessions: int) -> dict[str, Any]:
    floor = 1 if ladder != "off" else 4
    phases: list[dict[str, Any]] = []
    refusal: dict[str, Any] | None = None
    players: list[Player] = []
    with LocalServer(CONFIG, [f"--capacity.ladder={ladder}", f"--server.max_sessions={max_sessions}"]) as server, \
            Client(server.endpoint) as admin:
        try:
            while True:
                before = admin.stats().capacity
                try:
                    players.append(Player(server.endpoint, steps=4, min_steps=floor))
                except Busy as busy:
                    n = len(players)
                    room = floor_period(before.stage_s, n + 1, floor)
                    refusal = {"sessions": n, "message": str(busy), "retry_after_s": busy.retry_after_s,
                               "floor_period_s": room,
                               "model_had_room": room is not None and room * (1 + before.margin) <= MEDIA_S}
                    break
                # settle: every session runs `settle` chunks at what the ladder gave it, then `hold` more are measured
                marks = {p.info.id: len(p.chunks) for p in players}
                for p in players:
                    p.wait_for("settled", lambda c, m=marks[p.info.id]: c.index >= m + settle, timeout_s=120)
                starts = {p.info.id: max(c.index for c in p.chunks) for p in players}
                final = len(players) >= max_sessions
                measure = hold if final else max(3, hold // 2)
                for p in players:
                    p.wait_for("measured", lambda c, s=starts[p.info.id] + measure: c.index >= s,
                               timeout_s=120)
                stats = admin.stats().capacity
                phases.append(phase_record(players, starts, stats))
                if final:
                    break
            if refusal is not None and players:  # hold the final set once more: its steady chunks
                starts = {p.info.id: max(c.index for c in p.chunks) for p in players}
                for p in players:
                    p.wait_for("held", lambda c, s=starts[p.info.id]: c.index >= s + hold, timeout_s=120)
                phases.append(phase_record(players, starts, admin.stats().capacity))
        finally:
            for p in players:
                p.close()
        code = server.stop()
    return {"ladder": ladder, "floor": floor, "phases": phases, "refusal": refusal, "exit_code": code,
            "sessions_held": len(players)}


def phase_record(players: list[Player], starts: dict[str, int], stats: CapacityStats) -> dict[str, Any]:
    sessions = {}
    for p in players:
        steady = sorted((c for c in p.chunks if c.index > starts[p.info.id]), key=lambda c: c.index)
        emitted = [c.facts.times.emitted for c in steady]
        periods = list(np.diff(emitted)) if len(emitted) > 1 else []
        sessions[p.info.id] = {"steps": [c.facts.steps for c in steady], "periods_s": [float(x) for x in periods],
                               "rtf": [MEDIA_S / x for x in periods if x > 0]}  # fmt: skip
    return {"n": len(players), "predicted_period_s": stats.predicted_period_s, "headroom": stats.headroom,
            "stage_s": stats.stage_s, "sessions": sessions}


def verdicts(on: dict[str, Any], off: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    rows = []
    held = (on["sessions_held"], off["sessions_held"])
    rows.append(("sessions held in real time: ladder vs fixed 4", f"{held[0]} vs {held[1]}", ">= 2x",
                 held[1] > 0 and held[0] >= 2 * held[1]))
    for r in (on, off):
        final = r["phases"][-1] if r["phases"] else {"sessions": {}}
        rtfs = [x for s in final["sessions"].values() for x in s["rtf"]]
        p10 = min(float(np.percentile(s["rtf"], 10)) for s in final["sessions"].values() if s["rtf"]) \
            if rtfs else None
        rows.append((f"worst session's p10 real-time factor ({r['ladder']})", fmt(p10, "x"), ">= 0.97",
                     p10 is not None and p10 >= 0.97))
        refused = r["refusal"]
        rows.append((f"refused while the model had room ({r['ladder']})",
                     "no refusal" if refused is None else str(refused["model_had_room"]), "False",
                     refused is None or not refused["model_had_room"]))
    errors = []
    for r in (on, off):
        for phase in r["phases"]:
            for s in phase["sessions"].values():
                if s["periods_s"] and phase["predicted_period_s"]:
                    errors.append(abs(phase["predicted_period_s"] / float(np.median(s["periods_s"])) - 1))
    p50 = float(np.median(errors)) if errors else None
    rows.append(("period prediction error, p50 over sessions and phases", fmt(p50, "%"), "<= 10 %",
                 p50 is not None and p50 <= 0.10))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settle", type=int, default=4, help="chunks per session after each change before measuring")
    parser.add_argument("--hold", type=int, default=8, help="chunks per session measured in the final phase")
    parser.add_argument("--max-sessions", type=int, default=8)
    parser.add_argument("--json", type=Path, default=out_path("bench_capacity.json"))
    args = parse_args(parser, argv, {"settle": 1, "hold": 2, "max_sessions": 2})
    on = run("newest", args.settle, args.hold, args.max_sessions)
    off = run("off", args.settle, args.hold, args.max_sessions)
    rows = [("phase", "sessions", "steps", "predicted period", "measured p50", "predicted RTF", "measured RTF p10")]
    for r in (on, off):
        for phase in r["phases"]:
            periods = [x for s in phase["sessions"].values() for x in s["periods_s"]]
            rtfs = [x for s in phase["sessions"].values() for x in s["rtf"]]
            steps = ",".join(str(s["steps"][-1]) if s["steps"] else "-" for s in phase["sessions"].values())
            pred = phase["predicted_period_s"]
            rows.append((f"ladder {r['ladder']}", str(phase["n"]), steps, fmt(pred),
                         fmt(float(np.median(periods)) if periods else None),
                         fmt(MEDIA_S / pred if pred else None, "x"),
                         fmt(float(np.percentile(rtfs, 10)) if rtfs else None, "x")))
    print(table(rows[0], rows[1:]))
    print()
    checks = verdicts(on, off)
    print(table(("verdict", "value", "target", "result"),
                [(name, value, target, "PASS" if ok else "FAIL") for name, value, target, ok in checks]))
    for r in (on, off):
        if r["refusal"]:
            print(f"ladder {r['ladder']}: refused session {r['refusal']['sessions'] + 1}: {r['refusal']['message']}")
    write_json(args.json, {"config": CONFIG, "media_s": MEDIA_S, "ladder_on": on, "ladder_off": off,
                           "verdicts": [{"name": n, "value": v, "target": t, "pass": ok} for n, v, t, ok in checks]},
               smoke=args.smoke)
    print(f"saved {args.json}")
    return 0 if all(ok for *_, ok in checks) and on["exit_code"] == 0 == off["exit_code"] else 1


if __name__ == "__main__":
    sys.exit(main())
