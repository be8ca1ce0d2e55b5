"""The ``multi_gpu`` section of ``scripts/bench_gpu.py``: the DiT stage sharded over N processes (SP = N, one per
GPU with NCCL; gloo on CPU in the tests), and the concurrent collectives of the co-located layouts."""

from __future__ import annotations

import json
import math
import os
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from models.dit import WanModelFast
from models.dit_checkpoint import random_dit
from models.dit_config import DiTConfig
from models.lingbot_denoise import LingbotDenoiseStage
from models.stages import SessionSpec
from scripts.gpu_base import LAYOUTS, Sizes, chunk_times, geometry_of, timed
from scripts.ports import free_port


def multi_gpu_stage(cfg: DiTConfig, sizes: Sizes, device: torch.device, dtype: torch.dtype,
                    group: Any) -> LingbotDenoiseStage:  # fmt: skip
    """The DiT stage the multi-GPU section times, sharded over every rank of ``group`` (SP = the group's size). The
    stage applies the split itself: a model split beforehand and handed over with no group is made one-rank again."""
    model: WanModelFast = random_dit(cfg, device, dtype, seed=0)  # the same seeded weights on every rank
    return LingbotDenoiseStage(replace(cfg, attention="sdpa"), geometry_of(cfg, sizes.height, sizes.width),
                               device=device, dtype=dtype, group=group, weights=model)  # fmt: skip


def _multi_gpu_worker(rank: int, world: int, port: int, sizes_tiny: bool, out_dir: str, backend: str) -> None:
    """One rank of the multi-GPU section: ``nccl`` on GPU ``rank``, or ``gloo`` on CPU (the tests' path)."""
    import torch.distributed as dist

    from models.ulysses import Ulysses

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device, dtype = torch.device("cuda", rank), torch.bfloat16
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    else:
        torch.set_num_threads(1)
        device, dtype = torch.device("cpu"), torch.float32
        dist.init_process_group("gloo", rank=rank, world_size=world)
    result: dict[str, Any] = {}
    sizes = Sizes(sizes_tiny)
    cfg = DiTConfig.from_name(sizes.dit["v1"])
    fs = (sizes.height // 16) * (sizes.width // 16)
    n = cfg.chunk_size * fs
    sp = Ulysses(dist.group.WORLD)
    local = -(-n // world)
    q = torch.randn(local, cfg.num_heads, cfg.head_dim, device=device, dtype=dtype)
    a2a = timed(lambda: (sp.heads_to_seq(sp.qkv_to_heads(q, q, q, n)[0])), device, repeat=10)
    result["alltoall_s_per_layer"] = a2a
    stage = multi_gpu_stage(cfg, sizes, device, dtype, dist.group.WORLD)
    result["sp_size"] = stage.model.sp.size
    result["frames_per_chunk"] = 4 * cfg.chunk_size
    g = torch.Generator(device="cpu").manual_seed(1)
    stage.open(SessionSpec("b", 0, ""), torch.randn(cfg.text_len, cfg.text_dim, generator=g))
    cond = torch.randn(20, cfg.chunk_size, sizes.height // 8, sizes.width // 8, generator=g).to(device)
    fill = math.ceil(cfg.kv_window / cfg.chunk_size)
    times = chunk_times(stage, "b", fill + 2, cond, device, keys="w", before=dist.barrier)
    result["spN_chunk_s"] = min(times[-2:])
    result["chunk_s"] = times
    # two NCCL groups per GPU used from two threads at once (the decode and coordinator ranks' pattern)
    if world >= 2 and backend == "nccl":
        result["concurrent_groups"] = _concurrent_groups(rank, device)
    if rank == 0:
        (Path(out_dir) / "multi.json").write_text(json.dumps({"world": world, **result}))
    dist.barrier()
    dist.destroy_process_group()


def _concurrent_groups(rank: int, device: torch.device, rounds: int = 200) -> dict[str, Any]:
    """Ranks 0 and 1: on group A rank 0 sends to rank 1 while on group B rank 1 sends to rank 0, each from its own
    thread and stream, as the coordinator (frames in, conditions out) and decode ranks (latents in, frames out)
    do. A deadlock shows as the group timeout."""
    import datetime

    import torch.distributed as dist

    world = dist.get_world_size()
    timeout = datetime.timedelta(seconds=60)
    group_a = dist.new_group([0, 1], timeout=timeout)
    group_b = dist.new_group([0, 1], timeout=timeout)
    if rank > 1:
        return {}
    errors: list[str] = []
    tensor_a = torch.ones(1 << 20, device=device)
    tensor_b = torch.ones(1 << 18, device=device)

    def edge(group: Any, buf: torch.Tensor, sender: int) -> None:
        torch.cuda.set_device(device)
        stream = torch.cuda.Stream(device)
        try:
            with torch.cuda.stream(stream):
                for _ in range(rounds):
                    if rank == sender:
                        dist.send(buf, dst=1 - rank, group=group)
                    else:
                        dist.recv(buf, src=1 - rank, group=group)
                stream.synchronize()
        except Exception as error:
            errors.append(f"{type(error).__name__}: {error}")

    began = time.perf_counter()
    threads = [threading.Thread(target=edge, args=(group_a, tensor_a, 0)),
               threading.Thread(target=edge, args=(group_b, tensor_b, 1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"rounds": rounds, "seconds": time.perf_counter() - began, "errors": errors, "world": world}


def multi_gpu_world(sizes: Sizes, world: int, backend: str = "nccl") -> dict[str, Any]:
    """The multi-GPU measurements with ``world`` processes (one per GPU with ``nccl``; CPU ranks with ``gloo``)."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_multi_gpu_worker, args=(world, free_port(), sizes.tiny, tmp, backend), nprocs=world, join=True)
        return json.loads((Path(tmp) / "multi.json").read_text())


def multi_gpu(sizes: Sizes) -> dict[str, Any]:
    """SP = N for each layout's DiT group size N that fits on this machine's GPUs (and N = all of them)."""
    gpus = torch.cuda.device_count()
    worlds = sorted({ranks for ranks, _ in LAYOUTS.values() if 1 < ranks <= gpus} | {gpus})
    out: dict[str, Any] = {}
    for world in worlds:
        try:
            out[f"sp{world}"] = multi_gpu_world(sizes, world)
        except Exception as error:
            out[f"sp{world}"] = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()[-1500:]}
    return out
