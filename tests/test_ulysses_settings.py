"""The split7 settings (``model.fused_qkv``, ``model.overlap_all_to_all``) on 5 gloo ranks compute what one process
computes without them, within the golden bound (``shared/fixtures/golden/README.md`` section 11)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from models.dit import DiTConfig
from scripts.ports import free_port
from tests.test_ulysses import RANKS, run_stream

# name: (fused_qkv, overlap_all_to_all)
SETTINGS = {"default": (False, False), "fused": (True, False), "overlap": (False, True), "both": (True, True)}


def golden_bound(reference: torch.Tensor) -> float:
    return 2e-5 * max(1.0, float(reference.abs().max()))


def stream(group: dist.ProcessGroup | None, fused_qkv: bool = False, overlap: bool = False) -> torch.Tensor:
    """The latents of ``tests/test_ulysses.py``'s seeded stream with these settings, the tiny DiT with 10 heads instead
    of 5: two per rank, so the overlapped exchange runs in two head groups."""
    tiny = DiTConfig.from_name("tiny", attention="sdpa")
    return run_stream(group, replace(tiny, num_heads=2 * tiny.num_heads, fused_qkv=fused_qkv,
                                     overlap_all_to_all=overlap))  # fmt: skip


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    try:
        got = {name: stream(dist.group.WORLD, *flags) for name, flags in SETTINGS.items()}
        torch.save(got, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # nobody tears gloo down while a peer is still inside a collective
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_each_setting_on_five_gloo_ranks_matches_the_unsharded_model_within_the_golden_bound(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=RANKS, join=True)
    reference = stream(None)
    bound = golden_bound(reference)
    for rank in range(RANKS):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name in SETTINGS:
            error = float((got[name] - reference).abs().max())
            print(f"rank {rank} {name}: max error {error:.2e} (bound {bound:.2e})")
            assert error <= bound, f"rank {rank}, {name}: max error {error:.3e} > {bound:.3e}"
