"""Every benchmark runs: each ``scripts/bench*.py`` at tiny sizes (``--smoke``, or its CPU path), as a user runs it
(its own process, ``$OUT`` set), ending without a traceback and writing JSON that parses and holds its verdict
keys (``scripts.bench_json``). Benchmarks rot when nothing runs them: ``bench_router.py`` ended in a ``TypeError``
unnoticed once the metrics became typed.

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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ipc.metrics_types import Distribution
from scripts.bench_json import write_json

ROOT = Path(__file__).resolve().parent.parent
# used by the benchmarks, not benchmarks (bench_split_rank.py: the split_rank section of bench_gpu.py)
LIBRARIES = {"bench_common.py", "bench_json.py", "bench_split_rank.py"}
AT_ONCE = 3  # benchmarks run at the same time
SCRIPT_TIMEOUT_S = 420


def frames_identical(data: dict[str, Any]) -> bool:
    differ = data["frames_differ"]
    return not any(differ.values()) if isinstance(differ, dict) else differ == []


# script -> (its arguments, its JSON file under $OUT, its verdict keys, what must hold even in a smoke run)
BENCHES: dict[str, tuple[list[str], str, set[str], Callable[[dict[str, Any]], bool] | None]] = {
    "bench.py": (["--smoke"], "bench.json", {"summaries", "frames_differ", "table"}, frames_identical),
    "bench_capacity.py": (["--smoke"], "bench_capacity.json", {"verdicts", "ladder_on", "ladder_off"}, None),
    # the GPU engineer's two: their own CPU paths (eager mode only: inductor's compile alone takes minutes on a CPU)
    "bench_chunk_path.py": (["--smoke"], "bench_chunk_path.json", {"measured", "before", "ratio"},
                            lambda d: d["frames_identical"] is True),
    "bench_compile.py": (["--tiny", "--chunks", "1", "--modes", "off"], "bench_compile.json", {"modes", "device"},
                         lambda d: "steady_s" in d["modes"]["off"]),
    "bench_dit.py": (["--smoke"], "bench_dit.json", {"sp1", "sp5", "flops"}, None),
    "bench_drain.py": (["--smoke"], "bench_drain.json", {"pause_s", "to_migrated_s", "repeated", "exit_codes"},
                       lambda d: d["exit_codes"] == [0] and d["repeated"]["max"] == 0),
    "bench_gpu.py": (["--tiny", "--only", "matmul", "--only", "kv_cache"], "bench_gpu.json", {"matmul", "kv_cache"},
                     lambda d: d["matmul"]["tflops"] > 0),
    "bench_migration.py": (["--smoke"], "bench_migration.json", {"ratio", "period_on_s", "period_off_s",
                                                                  "migrations", "autosaves"},
                           lambda d: [m["resume"] <= m["streamed"] for m in d["migrations"]] == [True]),
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


def test_a_benchmarks_typed_metrics_numpy_numbers_and_paths_write_as_plain_json(tmp_path: Path) -> None:
    """What ended ``bench_router.py`` (a ``Distribution`` given to ``json.dumps``), and what the others write."""
    hold = Distribution(count=3, mean=0.5, p50=0.4)
    payload = {"hold": hold, "n": np.int64(3), "rate": np.float32(0.5), "where": tmp_path, "keys": frozenset("wa")}
    path = write_json(tmp_path / "deep" / "bench_x.json", payload, smoke=True)
    data = json.loads(path.read_text())
    assert data["hold"]["p50"] == 0.4 and data["hold"]["count"] == 3 and "p95" not in data["hold"]
    assert (data["n"], data["rate"], data["where"], data["keys"]) == (3, 0.5, str(tmp_path), ["a", "w"])
    assert data["smoke"] is True and data["when"] and not list(path.parent.glob("*.partial"))
    with pytest.raises(TypeError):  # an object no reader could read back is a bug to hear about, never a str()
        write_json(tmp_path / "bad.json", {"x": object()})
    assert not (tmp_path / "bad.json").exists()


def test_every_benchmark_script_has_a_smoke_run() -> None:
    scripts = {path.name for path in (ROOT / "scripts").glob("bench*.py")} - LIBRARIES
    assert scripts == set(BENCHES), "a benchmark without a smoke run here rots unnoticed"


def smoke(script: str, out: Path) -> str | None:
    """Run ``script`` small with ``$OUT`` = ``out``: None when it ran and wrote what it must, else why not."""
    args, name, keys, holds = BENCHES[script]
    out.mkdir()
    env = {**os.environ, "OUT": str(out), "PYTHONPATH": str(ROOT)}
    began = time.monotonic()
    try:
        run = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], cwd=out, env=env,
                             capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"{script}: still running after {SCRIPT_TIMEOUT_S} s"
    said = (run.stdout + run.stderr)[-3000:]
    if run.returncode not in (0, 1) or "Traceback" in run.stderr:  # 1: a MISS verdict (numbers of a smoke run)
        return f"{script} exited {run.returncode}:\n{said}"
    try:
        data = json.loads((out / name).read_text())
    except (OSError, ValueError) as error:
        return f"{script}: no JSON {name} to read ({error}):\n{said}"
    if not keys <= set(data):
        return f"{script}: {sorted(keys - set(data))} missing from {name}"
    if "--smoke" in args and data.get("smoke") is not True:
        return f"{script}: {name} does not say it is a smoke run"
    if holds is not None and not holds(data):
        return f"{script}: {name} does not hold what it must:\n{said}"
    print(f"{script}: {time.monotonic() - began:.1f} s", flush=True)
    return None


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_every_benchmark_runs_small_and_writes_json_with_its_verdict_keys(tmp_path: Path) -> None:
    """Three at a time: most of a smoke run's wall time is processes starting and streams pacing, not CPU."""
    began = time.monotonic()
    with ThreadPoolExecutor(max_workers=AT_ONCE) as pool:
        problems = [p for p in pool.map(lambda s: smoke(s, tmp_path / s.removesuffix(".py")), sorted(BENCHES)) if p]
    print(f"{len(BENCHES)} benchmarks in {time.monotonic() - began:.1f} s")
    assert not problems, "\n\n".join(problems)
