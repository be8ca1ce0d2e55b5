"""The real-model DenoiseStage: golden loop through the stage, seeded noise, the full cache's cap, ordering errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models.camera import intrinsics_at
from models.controls import OFFICIAL_INTRINSICS, ChunkControl
from models.dit_config import DiTConfig
from models.lingbot_denoise import LingbotDenoiseStage
from models.stages import SessionSpec, StreamGeometry
from scripts.check_golden import compare
from scripts.golden_dit import FixtureNoise, load_model
from tests.golden_fixtures import fixture_params, require

torch.set_num_threads(1)
GEOMETRY = StreamGeometry(
    height=32, width=48, chunk_latent_frames=3, context_shape=(16, 32), condition_shape=(20, 3, 4, 6),
    latent_shape=(16, 3, 4, 6),
)  # fmt: skip
MOVE = ChunkControl(keys=frozenset("wl"))


def _stage(**kw: object) -> LingbotDenoiseStage:
    return LingbotDenoiseStage(DiTConfig.from_name("tiny", attention="sdpa"), GEOMETRY, init_seed=5, **kw)


def _conditions(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randn(20, 3, 4, 6, generator=g) for _ in range(n)]


@pytest.mark.parametrize("fixture", fixture_params())
def test_stage_reproduces_the_golden_stream_with_the_fixture_noise_and_controls(fixture: Path | None) -> None:
    FIXTURE = require(fixture)
    config = json.loads((FIXTURE / "config.json").read_text())
    stream = config["stream"]
    inputs, expected = load_file(str(FIXTURE / "inputs.safetensors")), load_file(str(FIXTURE / "expected.safetensors"))
    cs, h, w = stream["chunk_size"], stream["lat_h"], stream["lat_w"]
    geometry = StreamGeometry(
        height=stream["image_height"], width=stream["image_width"], chunk_latent_frames=cs,
        context_shape=(stream["text_len"], config["dit"]["constructor"]["text_dim"]),
        condition_shape=(20, cs, h, w), latent_shape=(16, cs, h, w),
    )  # fmt: skip
    cfg = load_model(FIXTURE).cfg
    stage = LingbotDenoiseStage(cfg, geometry, weights=load_file(str(FIXTURE / "dit.safetensors")))
    context = torch.zeros(geometry.context_shape)
    context[: inputs["dit_context"].shape[0]] = inputs["dit_context"]  # the runtime hands the padded context
    stage.open(SessionSpec(session="g", seed=0, prompt=""), context)
    session = stage.sessions["g"]
    session.noise = FixtureNoise(inputs, cs)  # type: ignore[assignment]
    controls = iter(inputs[f"control_c{k}"] for k in range(stream["num_chunks"]))
    session.camera.control = lambda poses, first: next(controls)  # type: ignore[method-assign]
    for k in range(stream["num_chunks"]):
        latent = stage.denoise("g", k, inputs["dit_y"][:, k * cs : (k + 1) * cs], ChunkControl())
        ok, error, _, bound = compare(f"x0_c{k}", latent, expected[f"x0_c{k}"])
        assert ok, (k, error, bound)


def test_same_seed_gives_the_same_stream_and_another_seed_does_not() -> None:
    stage = _stage()
    conds = _conditions(2)
    context = torch.randn(16, 32)
    runs = {}
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        stage.open(SessionSpec(session=name, seed=seed, prompt=""), context)
        runs[name] = torch.stack([stage.denoise(name, k, conds[k], MOVE) for k in range(2)])
        stage.release(name)
    assert torch.equal(runs["a"], runs["b"])
    assert not torch.allclose(runs["a"], runs["c"], atol=1e-3)


def test_out_of_order_chunks_and_unknown_sessions_are_errors_and_release_is_idempotent() -> None:
    stage = _stage()
    stage.open(SessionSpec(session="s", seed=0, prompt=""), torch.zeros(16, 32))
    with pytest.raises(ValueError, match="expects chunk 0"):
        stage.denoise("s", 1, _conditions(1)[0], MOVE)
    with pytest.raises(KeyError, match="unknown session"):
        stage.denoise("nope", 0, _conditions(1)[0], MOVE)
    stage.release("s")
    stage.release("s")
    assert "s" not in stage.sessions


def test_a_full_cache_runs_the_chunks_it_holds_and_refuses_the_next_one_clearly() -> None:
    cfg = DiTConfig.from_name("tiny", attention="sdpa", kv_window=6, kv_sink=0, kv_policy="full")
    assert cfg.max_chunks == 2
    stage = LingbotDenoiseStage(cfg, GEOMETRY, init_seed=5)
    stage.open(SessionSpec(session="s", seed=0, prompt=""), torch.zeros(16, 32))
    conds = _conditions(3)
    for k in range(2):
        stage.denoise("s", k, conds[k], MOVE)
    assert stage.sessions["s"].cache.evicted == 0 and stage.sessions["s"].cache.local_end == 2 * 3 * 6
    with pytest.raises(ValueError, match="past what the full KV cache holds"):
        stage.denoise("s", 2, conds[2], MOVE)


def test_a_sessions_intrinsics_reach_the_dit_camera_rays_and_the_default_is_the_official_camera() -> None:
    """Three sessions with one seed and the same controls: no intrinsics (the stage's default), the official fast
    examples' camera given explicitly, and the narrower 520-pixel camera. The first two stream the same latents;
    the third's rays and latents differ, so a session's camera reaches the DiT."""
    stage = _stage()
    conds, context = _conditions(2), torch.randn(16, 32)
    narrow = (520.0, 520.0, 416.0, 240.0)
    runs, rays = {}, {}
    for name, camera in (("default", None), ("official", OFFICIAL_INTRINSICS), ("narrow", narrow)):
        stage.open(SessionSpec(session=name, seed=3, prompt="", intrinsics=camera), context)
        rays[name] = stage.sessions[name].camera.directions.clone()  # every pixel's ray direction, K^-1 (u, v, 1)
        assert tuple(stage.sessions[name].camera.k.tolist()) == intrinsics_at(camera or OFFICIAL_INTRINSICS, 32, 48)
        runs[name] = torch.stack([stage.denoise(name, k, conds[k], MOVE) for k in range(2)])
        stage.release(name)
    assert torch.equal(rays["default"], rays["official"]) and torch.equal(runs["default"], runs["official"])
    assert not torch.allclose(rays["default"], rays["narrow"], atol=1e-3)
    assert not torch.allclose(runs["default"], runs["narrow"], atol=1e-4)
