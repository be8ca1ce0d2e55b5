"""What the GPU benchmark's sections share (``scripts/bench_gpu.py``, ``scripts/bench_split_rank.py``,
``scripts/gpu_multi.py``): the sizes, the layouts, the device timers and peaks, and one DiT stage's timed chunks."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from models.controls import ChunkControl
from models.dit_config import DiTConfig
from models.lingbot_denoise import LingbotDenoiseStage
from models.stages import StreamGeometry

# layout -> (DiT ranks, whether the VAE roles share GPUs with DiT ranks)
LAYOUTS = {"split7": (5, False), "fast4": (4, True), "aggregated8": (8, True), "single": (1, True)}


class Sizes:
    """Full size on CUDA; ``--tiny``: the tiny presets at 32x48 so the CPU path runs in seconds."""

    def __init__(self, tiny: bool) -> None:
        self.tiny = tiny
        self.height, self.width = (32, 48) if tiny else (480, 832)
        self.dit = {"v1": "tiny", "v2": "tiny"} if tiny else {"v1": "lingbot-world-fast-v1",
                                                              "v2": "lingbot-world-fast-v2"}  # fmt: skip
        self.v2_recipe = {"chunk_size": 4, "timestep_indices": (0, 250, 500, 750)}
        self.vae = "tiny" if tiny else "wan2.1"
        self.t5 = "tiny" if tiny else "umt5-xxl"
        self.gemm = 256 if tiny else 8192


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, repeat: int = 3) -> float:
    fn()  # warm-up: kernel selection, autotuning, lazy module loading
    sync(device)
    began = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync(device)
    return (time.perf_counter() - began) / repeat


def peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def allocated(device: torch.device) -> int | None:
    """Bytes the allocator holds in live tensors (CUDA only: the CPU allocator keeps no such count)."""
    if device.type != "cuda":
        return None
    sync(device)
    return torch.cuda.memory_allocated(device)


def peak_over(before: int | None, device: torch.device) -> float | None:
    """GiB the allocator's peak since the last ``reset_peak`` rose above ``before`` (CUDA only)."""
    if before is None or device.type != "cuda":
        return None
    return (torch.cuda.max_memory_allocated(device) - before) / 2**30


def delta(before: int | None, device: torch.device) -> int | None:
    now = allocated(device)
    return None if now is None or before is None else now - before


def geometry_of(cfg: DiTConfig, height: int, width: int) -> StreamGeometry:
    cs, h, w = cfg.chunk_size, height // 8, width // 8
    return StreamGeometry(height=height, width=width, chunk_latent_frames=cs, context_shape=(cfg.text_len,
                          cfg.text_dim), condition_shape=(20, cs, h, w), latent_shape=(16, cs, h, w))  # fmt: skip


def chunk_times(stage: LingbotDenoiseStage, session: str, chunks: int, condition: torch.Tensor, device: torch.device,
                keys: str = "wl", before: Callable[[], Any] | None = None) -> list[float]:
    """Seconds of each of ``chunks`` denoised chunks of ``session`` (the device synchronised around each; ``before``:
    what lines the ranks up first, e.g. a barrier)."""
    times = []
    for k in range(chunks):
        if before is not None:
            before()
        sync(device)
        began = time.perf_counter()
        stage.denoise(session, k, condition, ChunkControl(keys=frozenset(keys)))
        sync(device)
        times.append(time.perf_counter() - began)
    return times
