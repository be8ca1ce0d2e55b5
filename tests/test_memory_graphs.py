"""The memory model's share of what the meta device cannot see: ``compile = "graphs"``'s per-session copies and its
capture pool, the cuDNN workspaces of the VAE stages on CUDA, and NCCL's buffers connected before the room is
measured; every figure named once, in ``models.memory.Margins``."""

from __future__ import annotations

import torch

import launch
from models import lingbot_config, memory
from models.dit_checkpoint import random_dit
from runtime import config as config_mod

torch.set_num_threads(1)
ONE_RANK = ("--layout.world_size=1", "--layout.decode=0", "--layout.dit=[0]")


def _config(*overrides: str) -> config_mod.Config:
    return config_mod.load("cpu-tiny-model", [*ONE_RANK, *overrides])


def test_graphs_adds_each_sessions_camera_copy_and_pass_statics_and_one_capture_pool_per_rank() -> None:
    off, graphs = _config("--model.compile=off"), _config("--model.compile=graphs")
    plain, counted = memory.session_items(off, 0, 64, 96, "cpu"), memory.session_items(graphs, 0, 64, 96, "cpu")
    assert set(counted) - set(plain) == {"graphs_camera", "graphs_statics"}
    # the copy CudaGraphPasses keeps per session is exactly the chunk's camera modulation, every block's pair
    cfg = lingbot_config.dit_config(graphs.model, graphs.stream)
    model = random_dit(cfg, torch.device("cpu"), torch.float32, seed=0)
    with torch.no_grad():
        cam = model.camera_modulation(torch.zeros(1, cfg.control_features // 4, cfg.chunk_size, 8, 12))
    assert counted["graphs_camera"] == memory.nbytes([list(pair) for pair in cam.per_block]) > 0
    assert counted["graphs_statics"] > 0 and len(cfg.timestep_indices) > 1
    assert counted["graphs_statics"] % len(cfg.timestep_indices) == 0  # one set of statics per captured timestep
    pool = memory.fixed_items(graphs, 0, 64, 96, "cpu")["graphs_pool"]
    assert pool > 0 and "graphs_pool" not in memory.fixed_items(off, 0, 64, 96, "cpu")
    # the pool is reserved (it appears at the first capture, after the room was measured), the copies are per session
    assert memory.working_bytes(graphs, 0, 64, 96, "cpu") == memory.working_bytes(off, 0, 64, 96, "cpu") + pool


def test_cuda_ranks_reserve_the_measured_vae_workspace_scaled_by_frame_area_and_cpu_ranks_none() -> None:
    cfg = _config()
    cuda = memory.fixed_items(cfg, 0, 240, 416, "cuda")
    quarter = memory.MARGINS.vae_conv_workspace_480x832 // 4  # 240x416 is a quarter of the measured frame
    assert cuda["decode_workspace"] == cuda["encode_workspace"] == quarter > 0
    assert not any(k.endswith("workspace") for k in memory.fixed_items(cfg, 0, 240, 416, "cpu"))
    reserved = sum(v for k, v in cuda.items() if k.endswith(("working", "workspace", "pool")))
    assert memory.working_bytes(cfg, 0, 240, 416, "cuda") == reserved
    assert reserved > sum(v for k, v in cuda.items() if k.endswith("working"))  # the workspaces are kept free too


def test_the_vae_workspace_margin_is_the_gap_measured_at_480x832() -> None:
    gap = memory.MARGINS.vae_conv_workspace(480, 832) / memory.GIB
    assert abs(gap - (17.98 - 13.46)) < 1e-6


def test_ranks_connect_nccl_when_each_communicator_is_created_before_the_room_is_measured() -> None:
    env: dict[str, str] = {}
    launch.rank_environment(env, say=False)
    assert env["NCCL_RUNTIME_CONNECT"] == "0" and memory.MARGINS.nccl_buffers == 0
