"""Golden conformance of umT5, the VAE condition and the streaming decode on every fixture directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models.lingbot_vae_stages import LingbotDecodeStage
from models.stages import SessionSpec
from models.vae_stream import frames_to_uint8
from scripts.check_golden import compare
from scripts.golden_vae_t5 import checks
from tests.golden_fixtures import fixture_params, require

torch.set_num_threads(1)

REQUIRED = {"t5_encoder_out_full", "t5_context", "vae_cond_latent", "y"}


@pytest.mark.parametrize("fixture", fixture_params())
def test_fixture_tensors_are_reproduced_within_the_bound(fixture: Path | None) -> None:
    fixture = require(fixture)
    num_chunks = json.loads((fixture / "config.json").read_text())["stream"]["num_chunks"]
    seen, failures = set(), []
    for name, actual, expected in checks(fixture):
        seen.add(name)
        ok, error, _, bound = compare(name, actual, expected)
        if not ok:  # NaN or a shape mismatch fails too
            failures.append(f"{name}: max error {error:.3e} > {bound:.3e}")
    assert not failures, failures
    assert REQUIRED | {f"frames_c{k}" for k in range(num_chunks)} <= seen


@pytest.mark.parametrize("fixture", fixture_params())
def test_uint8_frames_match_the_quantised_expected_frames(fixture: Path | None) -> None:
    fixture = require(fixture)
    from models.checkpoints import load_vae
    from models.vae import VAEConfig

    cfg = json.loads((fixture / "config.json").read_text())
    cs, num_chunks = cfg["stream"]["chunk_size"], cfg["stream"]["num_chunks"]
    expected = load_file(str(fixture / "expected.safetensors"))
    stage = LingbotDecodeStage(load_vae(fixture / "vae.safetensors", VAEConfig.from_fixture(cfg["vae"])))
    stage.open(SessionSpec("s", 0, ""))
    for k in range(num_chunks):
        got = stage.decode("s", k, expected["latents_all"][:, k * cs : (k + 1) * cs])
        want = frames_to_uint8(expected[f"frames_c{k}"])
        height, width = cfg["stream"]["image_height"], cfg["stream"]["image_width"]
        assert got.shape == want.shape == (want.shape[0], height, width, 3)
        diff = (got.int() - want.int()).abs()
        assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 1e-3  # only .5-boundary rounding flips
