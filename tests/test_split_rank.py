"""One split7 DiT rank's compute on one device: ``StandInUlysses`` gives every collective the shapes a rank of a
5-rank group sees, without communicating, so ``scripts/bench_gpu.py``'s ``split_rank`` section times exactly one
rank's work (its heads, its token shard, its KV share)."""

from __future__ import annotations

import torch

from models.ulysses import StandInUlysses
from scripts import bench_gpu, bench_split_rank

torch.set_num_threads(1)


def test_the_stand_in_collectives_return_the_shapes_of_rank_0_of_five() -> None:
    sp, n, heads, hd = StandInUlysses(5), 23, 10, 4
    local = sp.padded(n) // 5  # 5 tokens per rank after padding 23 to 25
    q = torch.randn(local, heads, hd)
    qh, kh, vh = sp.qkv_to_heads(q, q, q, n)
    assert qh.shape == kh.shape == vh.shape == (n, heads // 5, hd)  # the whole sequence, this rank's 2 heads
    assert sp.heads_to_seq(qh).shape == (local, heads, hd)  # back to this rank's tokens, every head
    assert sp.gather(torch.randn(local, 7), n).shape == (n, 7)
    assert sp.shard(torch.randn(n, 3)).shape == (local, 3)


def test_the_tiny_preset_runs_one_rank_of_sp5_and_reports_its_steady_time() -> None:
    sizes = bench_gpu.Sizes(tiny=True)
    result = bench_split_rank.split_rank(sizes, torch.device("cpu"))
    rank = result["sp5"]
    n = bench_gpu.DiTConfig.from_name("tiny").chunk_size * (sizes.height // 16) * (sizes.width // 16)  # tokens
    assert rank["sp_size"] == 5 and rank["local_heads"] == 1 and rank["local_tokens"] == -(-n // 5)
    assert rank["compute_s"] > 0 and rank["compute_s"] == min(rank["chunk_s"][-2:])
    cfg = bench_gpu.DiTConfig.from_name("tiny")
    all_heads = bench_gpu.kv_cache_bytes(cfg.num_layers, cfg.kv_window, n // cfg.chunk_size, cfg.num_heads,
                                         cfg.head_dim, torch.float32)  # fmt: skip
    assert round(rank["kv_cache_gib"] * 2**30) * 5 == all_heads  # its share of the heads' ring
    assert rank["alltoall_gb_per_chunk"] > 0
    # the memory model's peak for this rank, beside the allocator's (CPU keeps no peak; CUDA does): weights, its
    # KV share and text cache, and a chunk's working set
    assert rank["model_peak_gib"] > rank["kv_cache_gib"] > 0  # more than the ring alone
    assert "skipped" in result["sp8"]  # 5 heads do not split over 8 ranks
