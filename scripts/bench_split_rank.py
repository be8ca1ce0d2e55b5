"""One split7 DiT rank's own compute on one device, the ``split_rank`` section of ``scripts/bench_gpu.py`` (its
helpers: the all-to-all bytes and the memory model's peak beside the allocator's, which the ``dit`` section uses
too)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import torch

from models.dit_checkpoint import random_dit
from models.dit_config import DiTConfig
from models.lingbot_denoise import LingbotDenoiseStage
from models.stages import SessionSpec
from scripts.gpu_base import Sizes, chunk_times, geometry_of, peak_gib, reset_peak


def alltoall_bytes(cfg: DiTConfig, sp: int, height: int, width: int, dtype: torch.dtype) -> int:
    """Bytes one rank sends per chunk through the Ulysses all-to-alls (q, k, v out and the attention output back, per
    layer and pass), the part of each buffer that leaves the rank ((R - 1)/R of it)."""
    n = cfg.chunk_size * (height // 16) * (width // 16)
    local = -(-n // sp)
    per_layer = 4 * local * cfg.num_heads * cfg.head_dim * torch.tensor([], dtype=dtype).element_size()
    passes = len(cfg.timestep_indices) + 1
    return per_layer * cfg.num_layers * passes * (sp - 1) // sp


def dit_model_gib(stage: LingbotDenoiseStage, session: str, height: int, width: int) -> float:
    """What the memory model (``models.memory``) says one DiT rank holds at its peak with ``session`` open: the
    weights, the session's KV ring and text cache, and the working set of one steady chunk; set beside the
    allocator's measured peak (``peak_gib``), so the first GPU run checks the model and its margins."""
    from models import memory

    weights = memory.nbytes(list(stage.model.parameters()))
    text = stage.sessions[session].text
    session_bytes = stage.kv_cache_bytes(height, width) + memory.nbytes([text.k, text.v])
    working = memory.dit_working_bytes(stage.cfg, stage.dtype, stage.model.sp.size, height, width)
    return (weights + session_bytes + working) / 2**30


def split_rank(sizes: Sizes, device: torch.device) -> dict[str, Any]:
    """One DiT rank's own work at SP = 5 (split7) and SP = 8 (aggregated8) on this one device: its local heads over
    the whole sequence, its token shard, its share of the KV ring, with the all-to-alls replaced by a stand-in that
    returns the right shapes without communicating (``models.ulysses.StandInUlysses``). The steady chunk is the
    rank's compute; the bytes its all-to-alls would move are given beside it (their time is not in it)."""
    from models.ulysses import StandInUlysses

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = replace(DiTConfig.from_name(sizes.dit["v1"]), attention="sdpa")
    model = random_dit(cfg, device, dtype, seed=0)
    geometry = geometry_of(cfg, sizes.height, sizes.width)
    fill = math.ceil(cfg.kv_window / cfg.chunk_size)
    out: dict[str, Any] = {}
    for sp in (5, 8):
        if cfg.num_heads % sp:
            out[f"sp{sp}"] = {"skipped": f"{cfg.num_heads} heads do not split over {sp} ranks"}
            continue
        stage = LingbotDenoiseStage(cfg, geometry, device=device, dtype=dtype, group=StandInUlysses(sp),
                                    weights=model)  # fmt: skip
        g = torch.Generator(device="cpu").manual_seed(1)
        stage.open(SessionSpec("bench", 0, ""), torch.randn(cfg.text_len, cfg.text_dim, generator=g))
        condition = torch.randn(geometry.condition_shape, generator=g).to(device)
        reset_peak(device)
        times = chunk_times(stage, "bench", fill + 2, condition, device)
        n = cfg.chunk_size * (sizes.height // 16) * (sizes.width // 16)
        out[f"sp{sp}"] = {"sp_size": stage.model.sp.size, "local_heads": stage.model.sp.local_heads(cfg.num_heads),
                          "local_tokens": -(-n // sp), "chunk_s": times, "compute_s": min(times[-2:]),
                          "frames_per_chunk": 4 * cfg.chunk_size, "peak_gib": peak_gib(device),
                          "model_peak_gib": dit_model_gib(stage, "bench", sizes.height, sizes.width),
                          "kv_cache_gib": stage.kv_cache_bytes(sizes.height, sizes.width) / 2**30,
                          "alltoall_gb_per_chunk": alltoall_bytes(cfg, sp, sizes.height, sizes.width, dtype) / 1e9,
                          "note": "compute only: the all-to-alls' transfer time is not in compute_s"}  # fmt: skip
        stage.release("bench")
        del stage
        print(f"  split_rank sp{sp}: {json.dumps(out[f'sp{sp}'])[:400]}", flush=True)
    return out
