"""scripts/bench_gpu.py on its CPU path (tiny sizes): every section runs and reports what the GPU run will report,
so the one prepared GPU command is known to work before a device is lent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from scripts import bench_gpu, gpu_multi

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]


def test_bench_gpu_cpu_path_reports_every_section_and_serves_a_session(tmp_path: Path) -> None:
    out = tmp_path / "bench_gpu.json"
    assert bench_gpu.main(["--tiny", "--serve", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    for name in ("v1_sdpa", "v2_sdpa"):
        entry = results["dit"][name]
        assert entry["steady_s"] > 0 and entry["pflop_per_chunk"] > 0 and entry["fused_kernels_only"] is True
    assert results["dit"]["v2_sdpa"]["frames_per_chunk"] == 16 and results["dit"]["v1_sdpa"]["frames_per_chunk"] == 12
    assert set(results["vae"]) == {"float32", "tf32", "bfloat16"}
    assert "rel_l2_vs_fp32" in results["vae"]["bfloat16"] and results["umt5"]["prompt_s"] > 0
    assert {"v1_split7_gib", "v2_aggregated8_gib"} <= set(results["kv_cache"])
    assert {"split7", "fast4", "aggregated8"} <= set(results["projection"])
    assert results["projection"]["single"]["projected"] and not results["projection"]["split7"]["projected"]
    assert set(results["targets"]) == {"dit_v1_over_floor", "vae_decode_s", "vae_encode_s"}  # no SP=5: no split7 FPS
    top = results["dit"]["v1_sdpa"]["top_kernels"]["kernels"]
    assert 0 < len(top) <= 25 and [k["s"] for k in top] == sorted((k["s"] for k in top), reverse=True)
    assert {"default", "flash", "cudnn", "efficient"} <= set(results["sdpa"]) and results["sdpa"]["default"]["s"] > 0
    assert results["vae"]["tf32"]["decode_session_bytes_computed"] > 0
    served = results["serve"]
    assert served["chunk_indices"] == list(range(8)) and served["period_p50_s"] > 0
    assert served["size"] == [64, 96]  # the stream's own size: the start image is built at it, not resized to it
    assert served["first_chunk_s"] > 0 and served["steady_period_s"] > 0 and served["steady"]["denoise_s"] > 0


def test_multi_gpu_section_runs_its_dit_stage_at_sp_equal_to_the_world_size_on_5_gloo_ranks() -> None:
    result = gpu_multi.multi_gpu_world(bench_gpu.Sizes(tiny=True), 5, backend="gloo")
    assert result["world"] == 5 and result["sp_size"] == 5  # a one-rank stage here would project 5x too fast
    assert result["spN_chunk_s"] > 0 and result["frames_per_chunk"] == 12


def _measured(dit_s: float = 2.0, decode_s: float = 0.3, encode_s: float = 0.2, **multi: Any) -> dict[str, Any]:
    return {"dit": {"v1_sdpa": {"steady_s": dit_s, "frames_per_chunk": 12}},
            "vae": {"tf32": {"decode_steady_s": decode_s, "encode_steady_s": encode_s}},
            "multi_gpu": {f"sp{n}": {"world": n, "sp_size": n, "spN_chunk_s": s, "frames_per_chunk": 12}
                          for n, s in ((int(k[2:]), v) for k, v in multi.items())}}  # fmt: skip


def test_projection_adds_decode_and_encode_to_the_dit_on_co_located_layouts_only() -> None:
    out = bench_gpu.projection(_measured(sp5=0.5, sp4=0.6, sp8=0.35))
    assert out["single"]["period_s"] == pytest.approx(2.0 + 0.3 + 0.2)  # everything on one GPU
    assert out["fast4"]["period_s"] == pytest.approx(0.6 + 0.3 + 0.2)  # decode and encode share DiT ranks
    assert out["aggregated8"]["period_s"] == pytest.approx(0.35 + 0.3 + 0.2)
    assert out["split7"]["period_s"] == pytest.approx(0.5)  # own GPUs for the VAE: pipelined, the slowest stage
    assert out["fast4"]["fps"] == pytest.approx(12 / 1.1)


def test_projection_comes_only_from_a_dit_measured_at_the_layouts_sp_degree() -> None:
    one_gpu = bench_gpu.projection(_measured())
    assert one_gpu["single"]["projected"] and one_gpu["single"]["dit_from"] == "dit.v1_sdpa"
    for layout, ranks in (("split7", 5), ("fast4", 4), ("aggregated8", 8)):  # never steady / ranks
        assert one_gpu[layout] == {"projected": False, "why": one_gpu[layout]["why"]}
        assert f"SP={ranks}" in one_gpu[layout]["why"]
    five = bench_gpu.projection(_measured(sp5=0.55))
    assert five["split7"]["dit_s"] == 0.55 and five["split7"]["dit_from"] == "multi_gpu.sp5"
    assert not five["fast4"]["projected"]
    unsplit = _measured(sp5=0.55)
    unsplit["multi_gpu"]["sp5"]["sp_size"] = 1  # a 5-process run whose stage was not split is no SP=5 number
    assert not bench_gpu.projection(unsplit)["split7"]["projected"]
    table = bench_gpu.table({**_measured(), "projection": one_gpu})
    assert "not projected split7" in table and "PROJECTED single" in table
    assert bench_gpu.targets({"projection": one_gpu}, 790.0) == {}  # no split7 FPS target without SP=5


def test_sigterm_records_the_running_section_as_timed_out_and_keeps_the_finished_ones(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert bench_gpu.main(["--tiny", "--only", "kv_cache", "--out", str(out)]) == 0
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "scripts/bench_gpu.py", "--tiny", "--only", "serve", "--merge", "--out",
                             str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:  # SIGTERM once the section runs (the server is starting)
        if line.startswith("# serve"):
            proc.send_signal(signal.SIGTERM)
            break
    rest = proc.stdout.read()
    assert proc.wait(timeout=120) == 124, rest
    results = json.loads(out.read_text())
    assert "v1_single_gib" in results["kv_cache"]  # the earlier process's section survived
    assert results["serve"]["error"].startswith("timed out after")
