"""One prepared check of the GPU paths, for a session that has a GPU (nothing else needs one).

    python scripts/gpu_check.py --out out/gpu_check.json

Records, on the first CUDA device: bf16 vs fp32 of the DiT (`small` preset, one chunk through the real
denoise stage: the bf16 path is checked against its own fp32 path, as the golden README says), SageAttention vs
SDPA on the same inputs (if sageattention imports), the full-size v1 DiT with a few layers at 480x832 (time
per pass, extrapolated to 40 layers, and the FLOP utilisation), the Wan2.1 VAE decode of one chunk at 480x832,
and an NCCL process group of one rank (send/recv to itself is not allowed, so an all-reduce). It never fails
on a missing optional piece: each check records its result or its error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.controls import ChunkControl
from models.dit import DiTConfig, chunk_flops
from models.lingbot_denoise import LingbotDenoiseStage
from models.stages import SessionSpec, StreamGeometry

H, W = 480, 832


def timed(fn: Callable[[], Any], repeat: int = 3) -> tuple[float, Any]:
    out = fn()  # warm-up (kernels, autotuning)
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - began) / repeat, out


def dit_stage(cfg: DiTConfig, h: int, w: int, dtype: torch.dtype) -> tuple[LingbotDenoiseStage, StreamGeometry]:
    cs = cfg.chunk_size
    geometry = StreamGeometry(height=h * 8, width=w * 8, chunk_latent_frames=cs,
                              context_shape=(cfg.text_len, cfg.text_dim), condition_shape=(20, cs, h, w),
                              latent_shape=(16, cs, h, w))
    return LingbotDenoiseStage(cfg, geometry, device="cuda", dtype=dtype), geometry


def run_chunk(stage: LingbotDenoiseStage, geometry: StreamGeometry, session: str) -> torch.Tensor:
    cfg = stage.cfg
    torch.manual_seed(0)
    context = torch.randn(cfg.text_len, cfg.text_dim, device="cuda")
    stage.open(SessionSpec(session, 1, ""), context)
    condition = torch.randn(geometry.condition_shape, device="cuda")
    out = stage.denoise(session, 0, condition, ChunkControl(keys=frozenset("w")))
    stage.release(session)
    return out.float()


def check_bf16_vs_fp32() -> dict[str, Any]:
    cfg = DiTConfig.from_name("small")
    fp32, geometry = dit_stage(cfg, 30, 52, torch.float32)
    bf16, _ = dit_stage(cfg, 30, 52, torch.bfloat16)
    a, b = run_chunk(fp32, geometry, "a"), run_chunk(bf16, geometry, "b")
    return {"max_abs_diff": float((a - b).abs().max()), "rel_l2": float((a - b).norm() / a.norm())}


def check_sage() -> dict[str, Any]:
    from models.attention import sdpa, select_attention

    sage = select_attention("sage")
    q, k, v = (torch.randn(5, 4680, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    keys = k.clone()
    ref = sdpa(q, k, v).float()
    got = sage(q, k, v).float()
    t_sdpa, _ = timed(lambda: sdpa(q, k, v))
    t_sage, _ = timed(lambda: sage(q, k, v))
    return {"max_abs_diff": float((ref - got).abs().max()), "keys_untouched": bool(torch.equal(keys, k)),
            "sdpa_ms": t_sdpa * 1e3, "sage_ms": t_sage * 1e3}


def check_v1_pass(layers: int) -> dict[str, Any]:
    cfg = DiTConfig.from_name("lingbot-world-fast-v1", num_layers=layers)
    stage, geometry = dit_stage(cfg, H // 8, W // 8, torch.bfloat16)
    seconds, _ = timed(lambda: run_chunk(stage, geometry, "v1"), repeat=2)
    full = DiTConfig.from_name("lingbot-world-fast-v1")
    flops = chunk_flops(full, H // 8, W // 8)
    per_chunk_40 = seconds * full.num_layers / layers
    total = flops["per_chunk"]
    return {"layers": layers, "chunk_s_measured": seconds, "chunk_s_extrapolated_40_layers": per_chunk_40,
            "flops_per_chunk_full": flops, "tflops_achieved": total / per_chunk_40 / 1e12,
            "note": "first chunk: the KV window is not full yet, so this underestimates steady-state attention"}


def check_vae_decode() -> dict[str, Any]:
    from models.vae import VAEConfig, WanVAE
    from models.vae_stream import FrameDecoder

    vae = WanVAE(VAEConfig.preset("wan2.1")).cuda().eval()
    latent = torch.randn(16, 3, H // 8, W // 8, device="cuda")

    def decode() -> torch.Tensor:
        with torch.no_grad():
            return FrameDecoder(vae).decode(latent)

    seconds, frames = timed(decode, repeat=2)
    return {"first_chunk_decode_s": seconds, "frames_shape": list(frames.shape),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def check_nccl() -> dict[str, Any]:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)
    ok = bool(x[0].item() == 1.0)
    dist.destroy_process_group()
    return {"all_reduce_ok": ok}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")) / "gpu_check.json")
    parser.add_argument("--v1-layers", type=int, default=4)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here")
        return 2
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    checks = {"nccl": check_nccl, "bf16_vs_fp32": check_bf16_vs_fp32, "sage_vs_sdpa": check_sage,
              "v1_pass": lambda: check_v1_pass(args.v1_layers), "vae_decode": check_vae_decode}
    for name, check in checks.items():
        try:
            results[name] = check()
        except Exception as error:
            results[name] = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()[-2000:]}
        print(name, json.dumps(results[name])[:400], flush=True)
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
