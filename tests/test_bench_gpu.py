"""scripts/bench_gpu.py on its CPU path (tiny sizes): every section runs and reports what the GPU run will report,
so the one prepared GPU command is known to work before a device is lent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts import bench_gpu

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
    assert set(results["targets"]) == {"dit_v1_over_floor", "vae_decode_s", "vae_encode_s", "split7_fps"}
    assert results["serve"]["chunk_indices"] == list(range(8)) and results["serve"]["period_p50_s"] > 0
