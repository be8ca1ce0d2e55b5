"""The warm start, in one process: the warm-up runs the real stages (tiny model, CPU) through every shape a session at
a served size meets, leaves nothing behind, and rank 0 calls a job warm only when every rank of every stage warmed
every size. The served path (real ranks) is in ``tests/test_sizes.py``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

import launch
from ipc.metrics_types import WarmUpStage
from ipc.protocol import ChunkControl, Stage, WarmUp
from ipc.streams import RoleStreams
from models import lingbot, lingbot_config
from models.stages import SessionSpec, run_in_process
from ranks.backend import Backend
from ranks.warmup import session_id, warm_up
from runtime.config import ControlsConfig, LayoutConfig, ModelConfig, StreamConfig
from runtime.placement import placement_of
from runtime.warm_start import WarmStart

CPU = torch.device("cpu")
SIZE = (32, 48)  # the smallest frame of the tiny VAE's 8x stride and the DiT's 2x2 patch, in both orientations
CONTROLS = [ChunkControl(keys=frozenset(k)) for k in ("w", "wl", "d", "a")]


@pytest.fixture(scope="module")
def backend() -> Backend:
    model = ModelConfig(kind="lingbot-fast", preset="tiny", attention="sdpa", dtype="float32")
    stream = StreamConfig(height=SIZE[0], width=SIZE[1])
    return Backend(lingbot_config.lingbot_geometry(model, stream), {
        Stage.CONDITION: lingbot.build_condition(model, stream, CPU),
        Stage.DENOISE: lingbot.build_denoise(model, stream, ControlsConfig(), CPU, None),
        Stage.DECODE: lingbot.build_decode(model, stream, CPU)})


def session(backend: Backend, height: int, width: int, chunks: int) -> list[torch.Tensor]:
    assert backend.condition and backend.denoise and backend.decode
    image = torch.arange(50 * 70 * 3).remainder(251).to(torch.uint8).view(50, 70, 3)
    spec = SessionSpec("real", 7, "a red house", image, height, width)
    return run_in_process(backend.condition, backend.denoise, backend.decode, spec, CONTROLS[:chunks])


@contextmanager
def conv_shapes(backend: Backend) -> Iterator[set[tuple[str, tuple[int, ...], tuple[int, ...]]]]:
    """Every (layer, weight shape, input shape) the VAEs convolve: what cuDNN autotunes once each on a GPU."""
    seen: set[tuple[str, tuple[int, ...], tuple[int, ...]]] = set()
    handles = []
    for stage in (backend.condition, backend.decode):
        for name, module in stage.vae.named_modules():  # type: ignore[union-attr]
            if isinstance(module, torch.nn.Conv3d | torch.nn.Conv2d):
                handles.append(module.register_forward_pre_hook(
                    lambda m, args, name=name: seen.add((name, tuple(m.weight.shape), tuple(args[0].shape)))))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def test_the_warm_up_meets_every_convolution_shape_a_session_at_a_served_size_meets(backend: Backend) -> None:
    with conv_shapes(backend) as warmed:
        warm_up(backend, (SIZE,), CPU, RoleStreams(CPU))
    with conv_shapes(backend) as served:
        session(backend, *SIZE, chunks=4)  # chunks 2 and 3 meet nothing new: the steady state
    assert warmed and served <= warmed, sorted(served - warmed)


def test_the_warm_up_leaves_no_session_nor_random_state_behind(backend: Backend) -> None:
    before = session(backend, *SIZE, chunks=2)
    rng = torch.get_rng_state()
    runs = warm_up(backend, (SIZE, SIZE[::-1]), CPU, RoleStreams(CPU))
    assert torch.equal(torch.get_rng_state(), rng)
    assert [(r.stage, r.height, r.width, r.chunks) for r in runs] == [
        (stage, h, w, 2) for stage in ("denoise", "condition", "decode") for h, w in (SIZE, SIZE[::-1])]
    for h, w in (SIZE, SIZE[::-1]):
        sid = session_id(h, w)
        assert sid not in backend.condition and sid not in backend.decode  # type: ignore[operator]
        assert sid not in backend.denoise.sessions  # type: ignore[union-attr]
    after = session(backend, *SIZE, chunks=2)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_job_is_warm_only_once_every_rank_of_every_stage_warmed_every_size() -> None:
    sizes = ((160, 240), (240, 160))
    warm = WarmStart(placement_of(LayoutConfig()), sizes)  # condition 0, decode 1, DiT 2-6
    everything = {0: "condition", 1: "decode", **dict.fromkeys(range(2, 7), "denoise")}
    for rank, stage in everything.items():
        warm.add(rank, [WarmUp(stage, *size, 2, 0.5 if rank != 4 else 1.5) for size in sizes[: 1 if rank == 6 else 2]])
    assert not warm.warm  # rank 6 warmed one size of two
    warm.add(6, [WarmUp("denoise", *sizes[1], 2, 0.5)])
    assert warm.warm
    summary = warm.stages()
    assert summary[Stage.DENOISE.value].seconds == 3.0  # the slowest rank (4): the job's start waited for it
    assert summary[Stage.CONDITION.value] == WarmUpStage(seconds=1.0, chunks_per_size=2,
                                                         ranks={"0": ["160x240", "240x160"]}, threads={"0": [""]},
                                                         failed={})


def test_the_launcher_loads_cuda_modules_eagerly_and_expands_segments_unless_the_user_chose_otherwise(
        caplog: pytest.LogCaptureFixture) -> None:
    env: dict[str, str] = {}
    launch.rank_environment(env)
    # NCCL connects each communicator when it is created, so each rank's room is measured with its buffers
    assert env == {"CUDA_MODULE_LOADING": "EAGER", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                   "NCCL_RUNTIME_CONNECT": "0"}
    chosen = {"CUDA_MODULE_LOADING": "LAZY", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512",
              "NCCL_RUNTIME_CONNECT": "0"}
    with caplog.at_level("WARNING", logger="worldstream"):
        launch.rank_environment(chosen)
    assert chosen == {"CUDA_MODULE_LOADING": "LAZY", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512",
                      "NCCL_RUNTIME_CONNECT": "0"}
    said = caplog.text  # kept, but never silently: the hazard the default avoids is back
    assert "CUDA_MODULE_LOADING=LAZY" in said and "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512" in said
