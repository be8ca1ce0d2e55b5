"""Benchmark of the DiT on CPU: per-pass and per-chunk time, SP=1 vs SP=5 (5 gloo processes), FLOPs.

Usage: ``python scripts/bench_dit.py [--chunks 3] [--out $OUT/bench_dit.json]``. Absolute CPU times are noise
on a shared machine; the ratios printed at the end (SP=5 / SP=1, small / tiny) are measured in one run. The
FLOP count per chunk comes from the config (``models.dit.chunk_flops``), so GPU runs can report utilisation;
the full v1 model at 480x832 with an 18-frame window is printed for comparison with DESIGN.md (~1.15 PFLOP).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.dit import WanModelFast, apply_sequence_parallel, chunk_flops
from models.dit_config import DiTConfig
from models.kv_cache import new_kv_cache
from models.lingbot_denoise import NoiseSource, denoise_chunk
from models.schedule import FlowMatchSchedule
from scripts.bench_json import out_path, parse_args, write_json
from scripts.ports import free_port

# (preset, latent height, latent width): the tiny fixture grid and a small 64x96-pixel stream.
CASES = [("tiny", 4, 6), ("small", 8, 12)]
SP_RANKS = 5


def measure(preset: str, lat_h: int, lat_w: int, chunks: int, group: dist.ProcessGroup | None) -> dict[str, float]:
    """Median per-pass and per-chunk wall time (ms) of a seeded stream; chunk 0 is warm-up."""
    torch.manual_seed(0)
    cfg = DiTConfig.from_name(preset, attention="sdpa")
    model = apply_sequence_parallel(WanModelFast(cfg).eval(), group)
    fs = (lat_h // 2) * (lat_w // 2)
    heads = model.sp.local_heads(cfg.num_heads)
    cache = new_kv_cache(cfg, fs, heads, "cpu", torch.float32)
    steps = FlowMatchSchedule.build(cfg.shift).steps(cfg.timestep_indices)
    g = torch.Generator().manual_seed(1)
    cs = cfg.chunk_size
    chunk_ms, pass_ms = [], []
    with torch.no_grad():
        text = model.text_cache(torch.randn(cfg.text_len, cfg.text_dim, generator=g))
        noise = NoiseSource(2)
        for k in range(chunks + 1):
            y = torch.randn(20, cs, lat_h, lat_w, generator=g)
            control = torch.randn(1, 384, cs, lat_h, lat_w, generator=g)
            _barrier(group)
            t0 = time.perf_counter()
            cam = model.camera_modulation(control)
            x0 = denoise_chunk(model, steps, noise, k, y, cam, text, cache)
            t1 = time.perf_counter()
            for _ in range(2):  # extra refresh-style passes: rewrite the same slots, state unchanged
                _barrier(group)
                t2 = time.perf_counter()
                model(x0, y, 0.0, k * cs, text, cam, cache)
                if k > 0:
                    pass_ms.append(1e3 * (time.perf_counter() - t2))
            if k > 0:
                chunk_ms.append(1e3 * (t1 - t0))
    return {"pass_ms": statistics.median(pass_ms), "chunk_ms": statistics.median(chunk_ms), "tokens": cs * fs}


def _barrier(group: dist.ProcessGroup | None) -> None:
    if group is not None:
        dist.barrier(group)


def _worker(rank: int, port: int, chunks: int, out_dir: str, cases: list[tuple[str, int, int]]) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=SP_RANKS)
    try:
        results = {f"{p}_{h}x{w}": measure(p, h, w, chunks, dist.group.WORLD) for p, h, w in cases}
        if rank == 0:
            (Path(out_dir) / "sp.json").write_text(json.dumps(results))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=3, help="measured chunks after one warm-up chunk")
    parser.add_argument("--out", type=Path, default=out_path("bench_dit.json"))
    parser.add_argument("--presets", default="tiny,small", help="comma-separated subset of the presets measured")
    args = parse_args(parser, argv, {"chunks": 1, "presets": "tiny"})
    cases = [case for case in CASES if case[0] in args.presets.split(",")]
    torch.set_num_threads(1)
    sp1 = {f"{p}_{h}x{w}": measure(p, h, w, args.chunks, None) for p, h, w in cases}
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(free_port(), args.chunks, tmp, cases), nprocs=SP_RANKS, join=True)
        sp5 = json.loads((Path(tmp) / "sp.json").read_text())
    flops = {f"{p}_{h}x{w}": chunk_flops(DiTConfig.from_name(p), h, w) for p, h, w in cases}
    for name, (lh, lw) in {
        "lingbot-world-fast-v1_480x832": (60, 104),
        "lingbot-world-fast-v2_480x832": (60, 104),
    }.items():
        flops[name] = chunk_flops(DiTConfig.from_name(name.rsplit("_", 1)[0]), lh, lw)
    result = {"sp1": sp1, f"sp{SP_RANKS}": sp5, "flops": flops, "threads_per_rank": 1, "chunks": args.chunks}
    write_json(args.out, result, smoke=args.smoke)
    for case in sp1:
        a, b = sp1[case], sp5[case]
        gflop = flops[case]["per_chunk"] / 1e9
        print(
            f"{case:12s} tokens/chunk={a['tokens']:4d}  SP1 pass {a['pass_ms']:7.2f} ms chunk {a['chunk_ms']:7.2f} ms"
            f"  | SP{SP_RANKS} pass {b['pass_ms']:7.2f} ms chunk {b['chunk_ms']:7.2f} ms"
            f"  | SP{SP_RANKS}/SP1 chunk {b['chunk_ms'] / a['chunk_ms']:.2f}x  | {gflop:.4f} GFLOP/chunk"
            f" ({gflop / (a['chunk_ms'] / 1e3):.2f} GFLOP/s at SP1)"
        )
    if {"small_8x12", "tiny_4x6"} <= set(sp1):
        small, tiny = sp1["small_8x12"], sp1["tiny_4x6"]
        print(f"small/tiny chunk time at SP1: {small['chunk_ms'] / tiny['chunk_ms']:.2f}x")
    for name in ("lingbot-world-fast-v1_480x832", "lingbot-world-fast-v2_480x832"):
        f = flops[name]
        print(f"{name}: {f['per_chunk'] / 1e15:.3f} PFLOP/chunk ({f['per_pass'] / 1e15:.3f} per pass)")
    print(f"full results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
