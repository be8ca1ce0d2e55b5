"""Ulysses sequence parallelism on 5 gloo ranks computes what one process computes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from models.controls import ChunkControl
from models.dit_config import DiTConfig
from models.lingbot_denoise import LingbotDenoiseStage
from models.stages import SessionSpec, StreamGeometry
from models.ulysses import Ulysses
from scripts.ports import free_port

RANKS = 5
CHUNKS = 4  # window 8 frames, sink 2, chunk 3: chunks 2 and 3 evict
GEOMETRY = StreamGeometry(
    height=32,
    width=48,
    chunk_latent_frames=3,
    context_shape=(16, 32),
    condition_shape=(20, 3, 4, 6),
    latent_shape=(16, 3, 4, 6),
)  # fmt: skip  (4x6 latent: 18 tokens per chunk, not a multiple of 5 ranks, so the shards are padded)
CONTROLS = [ChunkControl(keys=frozenset("w")), ChunkControl(keys=frozenset("wl")), ChunkControl(), ChunkControl()]


def _inputs() -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    context = torch.randn(16, 32, generator=g)
    return context, [torch.randn(20, 3, 4, 6, generator=g) for _ in range(CHUNKS)]


def run_stream(group: dist.ProcessGroup | None, cfg: DiTConfig | None = None) -> torch.Tensor:
    """Latents ``[CHUNKS, 16, 3, 4, 6]`` of a seeded stream through the real DenoiseStage (``cfg``: the tiny DiT)."""
    torch.set_num_threads(1)
    cfg = cfg or DiTConfig.from_name("tiny", attention="sdpa")
    stage = LingbotDenoiseStage(cfg, GEOMETRY, group=group, init_seed=3)
    context, conditions = _inputs()
    stage.open(SessionSpec(session="s", seed=11, prompt="p"), context)
    out = [stage.denoise("s", k, conditions[k], CONTROLS[k]) for k in range(CHUNKS)]
    stage.release("s")
    return torch.stack(out)


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    try:
        sp = Ulysses(dist.group.WORLD)
        x = torch.arange(7 * 5 * 2, dtype=torch.float32).view(7, 5, 2)  # 7 tokens: padded to 10
        local = sp.shard(x)
        gathered = sp.seq_to_heads(local.view(2, 5, 2), 7)
        back = sp.heads_to_seq(gathered)
        torch.save(
            {"latents": run_stream(dist.group.WORLD), "heads": gathered, "roundtrip": sp.gather(back, 7)},
            Path(out_dir) / f"rank{rank}.pt",
        )
        dist.barrier()  # nobody tears gloo down while a peer is still inside a collective
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_five_gloo_ranks_produce_the_one_process_stream_including_padded_shards(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=RANKS, join=True)
    reference = run_stream(None)
    x = torch.arange(7 * 5 * 2, dtype=torch.float32).view(7, 5, 2)
    for rank in range(RANKS):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(got["heads"], x[:, rank : rank + 1], rtol=0, atol=0)  # one head per rank
        torch.testing.assert_close(got["roundtrip"], x, rtol=0, atol=0)
        torch.testing.assert_close(got["latents"], reference, rtol=0, atol=1e-5)
