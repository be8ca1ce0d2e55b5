"""Every benchmark runs: each ``scripts/bench*.py`` at tiny sizes (``--smoke``, or its CPU path), as a user runs it
(its own process, ``$OUT`` set), ending without a traceback and writing JSON that parses and holds its verdict
keys (``scripts.bench_json``). Benchmarks rot when nothing runs them: ``bench_router.py`` ended in a ``TypeError``
for months once the metrics became typed.

Only correctness is asserted here (the JSON, frames bit-identical where a benchmark compares them, chunks in order):
a smoke run's numbers mean nothing, and no performance ratio is a test (issue 29). A MISS verdict (exit 1) is
allowed; a crash is not. Starts servers, routers and gloo ranks: skip it with ``-m "not multiprocess"``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARIES = {"bench_common.py", "bench_json.py"}  # shared by the benchmarks, not benchmarks


def frames_identical(data: dict[str, Any]) -> bool:
    differ = data["frames_differ"]
    return not any(differ.values()) if isinstance(differ, dict) else differ == []


# script -> (its arguments, its JSON file under $OUT, its verdict keys, what must hold even in a smoke run)
BENCHES: dict[str, tuple[list[str], str, set[str], Callable[[dict[str, Any]], bool] | None]] = {
    "bench.py": (["--smoke"], "bench.json", {"summaries", "frames_differ", "table"}, frames_identical),
    "bench_capacity.py": (["--smoke"], "bench_capacity.json", {"verdicts", "ladder_on", "ladder_off"}, None),
    # the GPU engineer's two: their own CPU paths (eager mode only: inductor's compile alone takes minutes on a CPU)
    "bench_compile.py": (["--tiny", "--chunks", "1", "--modes", "off"], "bench_compile.json", {"modes", "device"},
                         lambda d: "steady_s" in d["modes"]["off"]),
    "bench_dit.py": (["--smoke"], "bench_dit.json", {"sp1", "sp5", "flops"}, None),
    "bench_gpu.py": (["--tiny", "--only", "matmul", "--only", "kv_cache"], "bench_gpu.json", {"matmul", "kv_cache"},
                     lambda d: d["matmul"]["tflops"] > 0),
    "bench_migration.py": (["--smoke"], "bench_migration.json", {"ratio", "period_on_s", "period_off_s",
                                                                  "migrations", "autosaves"},
                           lambda d: len(d["migrations"]) == 1),
    "bench_router.py": (["--smoke"], "bench_router.json", {"added_latency_p50_s", "rate_ratio", "cost_player",
                                                            "router_chunk_hold_s", "every_chunk_in_order"},
                        lambda d: d["every_chunk_in_order"] is True and d["router_chunk_hold_s"]["count"] > 0),
    "bench_schedule.py": (["--smoke"], "bench_schedule.json", {"verdicts", "summaries", "frames_differ"},
                          frames_identical),
    "bench_sessions.py": (["--smoke"], "bench_sessions.json", {"combined_chunks_per_s", "b_longest_gap_s",
                                                                "frames_differ"}, frames_identical),
    "bench_snapshots.py": (["--smoke"], "bench_snapshots.json", {"runs", "median"}, lambda d: d["median"]["bytes"] > 0),
    "bench_vae.py": (["--smoke"], "bench_vae.json", {"presets", "flops_480x832"}, None),
    "bench_web.py": (["--smoke"], "bench_web.json", {"streams"}, lambda d: len(d["streams"]) > 0),
}


def test_every_benchmark_script_has_a_smoke_run() -> None:
    scripts = {path.name for path in (ROOT / "scripts").glob("bench*.py")} - LIBRARIES
    assert scripts == set(BENCHES), "a benchmark without a smoke run here rots unnoticed"


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("script", sorted(BENCHES))
def test_the_benchmark_runs_small_and_writes_json_with_its_verdict_keys(script: str, tmp_path: Path) -> None:
    args, name, keys, holds = BENCHES[script]
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    began = time.monotonic()
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=540)
    said = (run.stdout + run.stderr)[-4000:]
    assert run.returncode in (0, 1) and "Traceback" not in run.stderr, f"{script} exited {run.returncode}:\n{said}"
    data = json.loads((tmp_path / name).read_text())
    assert keys <= set(data), f"{script}: {sorted(keys - set(data))} missing from {name}"
    assert data.get("smoke") is True or "--smoke" not in args
    assert holds is None or holds(data), f"{script}: {name} does not hold what it must:\n{said}"
    print(f"{script}: {time.monotonic() - began:.1f} s")
