"""The DiT under ``[model] compile = off | blocks | graphs``, side by side: steady seconds per chunk, compile time,
graphs compiled, peak memory, and the ratios to eager.

    python scripts/bench_compile.py --tiny                # CPU: the tiny preset at 32x48 (graphs runs as blocks there)
    python scripts/bench_compile.py                       # CUDA: v1 at 480x832 in bf16, one H200-sized GPU
    python scripts/bench_compile.py --out out/bench_compile.json --chunks 3

Each mode runs one session on one set of random weights through the window's fill (chunks 0 to the first whose
window is full: every compile and capture happens there) and then ``--chunks`` steady chunks (window full, ring
wrapping). ``steady_s`` is the fastest of those; ``compile_s`` is what the filling chunks took beyond as many steady
chunks (tracing, inductor, CUDA-graph capture; for ``off``: kernel warm-up), slightly low since a filling chunk
attends to fewer keys. Inductor's on-disk cache is pointed at a fresh directory per mode, so compile times are cold
(``--warm-cache`` keeps the default cache); the first compiled mode also pays the process's one-time inductor
start-up. On CUDA the floor is the chunk's matmul FLOPs at the measured bf16 GEMM rate, and each mode's seconds are
also given as a multiple of it. A full-size run may take about 10 minutes (``--chunks 2`` or ``--modes`` shorten it;
the time is an estimate: it has not run on a GPU yet).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.controls import ChunkControl
from models.dit import chunk_flops
from models.dit_checkpoint import random_dit
from models.dit_config import DiTConfig
from models.lingbot_denoise import LingbotDenoiseStage
from models.stages import SessionSpec, StreamGeometry

MODES = ("off", "blocks", "graphs")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def save(results: dict[str, Any], path: Path) -> None:
    """Write ``results`` whole (to a temporary name first: a kill mid-write keeps the last complete file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str))
    tmp.replace(path)


def gemm_tflops(device: torch.device, n: int = 8192, repeat: int = 10) -> float:
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    a @ b
    sync(device)
    began = time.perf_counter()
    for _ in range(repeat):
        a @ b
    sync(device)
    return 2 * n**3 * repeat / (time.perf_counter() - began) / 1e12


def run_mode(mode: str, cfg: DiTConfig, model: torch.nn.Module, geometry: StreamGeometry, device: torch.device,
             dtype: torch.dtype, chunks: int, warm_cache: bool) -> dict[str, Any]:  # fmt: skip
    """One session of ``fill + chunks`` chunks under ``mode``; times per chunk and what was compiled."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    if not warm_cache:  # a cold inductor cache per mode: compile times as a fresh process would see them
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"inductor-{mode}-")
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    stage = LingbotDenoiseStage(replace(cfg, compile=mode), geometry, device=device, dtype=dtype, weights=model)
    g = torch.Generator().manual_seed(1)
    stage.open(SessionSpec("bench", 0, ""), torch.randn(cfg.text_len, cfg.text_dim, generator=g))
    condition = torch.randn(geometry.condition_shape, generator=g).to(device)
    full = math.ceil(cfg.kv_window / cfg.chunk_size) - 1  # the first chunk with the window full (it evicts)
    times, graphs = [], []
    for k in range(full + 1 + chunks):
        sync(device)
        began = time.perf_counter()
        stage.denoise("bench", k, condition, ChunkControl(keys=frozenset("wl")))
        sync(device)
        times.append(time.perf_counter() - began)
        graphs.append(counters["stats"]["unique_graphs"])
    steady = min(times[full + 1 :])
    runner, graphs_pass = stage.model.block_runner, getattr(stage.model, "graphs", None)
    # either layer may have fallen back: the compiled block (to eager) or the graph capture (to the compiled block)
    failure = next((f for f in (getattr(graphs_pass, "failure", None), getattr(runner, "failure", None)) if f), None)
    out = {
        "runs_as": stage.compile,
        "chunk_s": times,
        "steady_s": steady,
        "compile_s": sum(times[: full + 1]) - (full + 1) * steady,
        "graphs_compiled": graphs[-1],
        "graphs_compiled_after_full": graphs[-1] - graphs[full],
        "graph_breaks": sum(counters["graph_break"].values()),
        "fell_back": None if failure is None else repr(failure)[:300],
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }
    stage.release("bench")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny preset at 32x48 (the CPU path; default without CUDA)")
    parser.add_argument("--chunks", type=int, default=3, help="steady chunks after the window is full")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of off,blocks,graphs")
    parser.add_argument("--warm-cache", action="store_true", help="keep inductor's on-disk cache (warm compile times)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")) / "bench_compile.json")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if not cuda:
        torch.set_num_threads(1)  # steadier on a shared CPU
    cfg = DiTConfig.from_name("lingbot-world-fast-v1" if cuda else "tiny", attention="sdpa")
    height, width = (480, 832) if cuda else (32, 48)
    cs, h, w = cfg.chunk_size, height // 8, width // 8
    geometry = StreamGeometry(height=height, width=width, chunk_latent_frames=cs,
                              context_shape=(cfg.text_len, cfg.text_dim), condition_shape=(20, cs, h, w),
                              latent_shape=(16, cs, h, w))  # fmt: skip
    model = random_dit(cfg, device, dtype, seed=0)  # one set of weights for every mode
    flops = chunk_flops(cfg, h, w)["per_chunk"]
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if cuda else "cpu",
                               "preset": "v1" if cuda else "tiny", "frame": [height, width], "dtype": str(dtype),
                               "torch": torch.__version__, "pflop_per_chunk": flops / 1e15, "modes": {}}  # fmt: skip
    if cuda:
        results["gemm_tflops"] = gemm_tflops(device)
        results["floor_s"] = flops / (results["gemm_tflops"] * 1e12)
    # CUDA refuses to capture a graph on the legacy default stream (graphs would run as blocks and say nothing); the
    # server runs each role on its own stream, so every mode runs on one side stream here, as it would there
    side = torch.cuda.Stream(device) if cuda else None
    for mode in args.modes.split(","):
        try:
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                results["modes"][mode] = run_mode(mode, cfg, model, geometry, device, dtype, args.chunks,
                                                  args.warm_cache)  # fmt: skip
        except Exception as error:  # one mode failing still reports the others
            results["modes"][mode] = {"error": f"{type(error).__name__}: {error}"[:500]}
        print(f"  {mode}: {json.dumps(results['modes'][mode])[:400]}", flush=True)
        save(results, args.out)  # each mode's numbers on disk as it ends: a run cut short keeps what it measured
    off = results["modes"].get("off", {}).get("steady_s")
    print(f"\n{'mode':8s} {'runs as':8s} {'steady s':>10s} {'x off':>7s} {'x floor':>8s} {'compile s':>10s} "
          f"{'graphs':>6s} {'peak GiB':>9s}")
    for mode, r in results["modes"].items():
        if "error" in r:
            print(f"{mode:8s} error: {r['error'][:100]}")
            continue
        r["ratio_to_off"] = r["steady_s"] / off if off else None
        r["ratio_to_floor"] = r["steady_s"] / results["floor_s"] if cuda else None
        print(f"{mode:8s} {r['runs_as']:8s} {r['steady_s']:10.4f} {r['ratio_to_off'] or float('nan'):7.3f} "
              f"{r['ratio_to_floor'] or float('nan'):8.3f} {r['compile_s']:10.2f} {r['graphs_compiled']:6d} "
              f"{r['peak_gib'] if r['peak_gib'] is not None else float('nan'):9.2f}")
    save(results, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
