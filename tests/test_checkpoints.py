"""Checkpoint directory resolution and strict, memory-mapped .pth loading."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from models.checkpoints import (
    CheckpointError,
    CheckpointNames,
    load_state_dict_file,
    load_t5,
    load_vae,
    resolve_checkpoint_dir,
)
from models.t5 import T5Config, T5Encoder
from models.vae import VAEConfig, WanVAE

torch.set_num_threads(1)

VAE_CFG = dataclasses.replace(VAEConfig.preset("tiny"), num_res_blocks=1)


def _layout(root: Path, dit_dirs: tuple[str, ...] = ("lingbot_fast",)) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for d in dit_dirs:
        (root / d).mkdir(parents=True)
        (root / d / "config.json").write_text("{}")
        (root / d / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    (root / "Wan2.1_VAE.pth").write_bytes(b"")
    (root / "models_t5_umt5-xxl-enc-bf16.pth").write_bytes(b"")
    (root / "google" / "umt5-xxl").mkdir(parents=True)
    return root


def test_resolver_finds_every_component_of_the_official_layout(tmp_path: Path) -> None:
    paths = resolve_checkpoint_dir(_layout(tmp_path))
    assert paths.dit_dir == tmp_path.resolve() / "lingbot_fast"
    assert paths.vae_file.name == "Wan2.1_VAE.pth" and paths.t5_file.name == "models_t5_umt5-xxl-enc-bf16.pth"
    assert paths.tokenizer_dir == tmp_path.resolve() / "google" / "umt5-xxl"


def test_resolver_reports_every_missing_component_where_it_looked_and_the_contents(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("")
    with pytest.raises(CheckpointError) as err:
        resolve_checkpoint_dir(tmp_path)
    msg = str(err.value)
    for name in ("Wan2.1_VAE.pth", "models_t5_umt5-xxl-enc-bf16.pth", "google/umt5-xxl"):
        assert str(tmp_path.resolve() / name) in msg
    assert "model.components_dir" in msg and "no DiT folder" in msg and "README.md" in msg


def test_resolver_asks_to_choose_between_several_dit_folders_none_of_them_released(tmp_path: Path) -> None:
    root = _layout(tmp_path, ("high_noise_model", "low_noise_model"))
    with pytest.raises(CheckpointError, match=r"model\.dit_subdir"):
        resolve_checkpoint_dir(root)
    paths = resolve_checkpoint_dir(root, CheckpointNames(dit_subdir="low_noise_model"))
    assert paths.dit_dir.name == "low_noise_model"


def test_resolver_prefers_the_released_dit_folders(tmp_path: Path) -> None:
    v1 = _layout(tmp_path / "base-cam", ("high_noise_model", "low_noise_model", "lingbot_world_fast"))
    assert resolve_checkpoint_dir(v1).dit_dir.name == "lingbot_world_fast"
    v2 = _layout(tmp_path / "v2", ("transformers",))
    (v2 / "model-00001-of-00008.safetensors").write_bytes(b"")  # a stray shard in the root does not win
    assert resolve_checkpoint_dir(v2).dit_dir.name == "transformers"


def test_vae_and_umt5_are_found_in_the_components_dir_when_the_dit_download_lacks_them(tmp_path: Path) -> None:
    fast = tmp_path / "lingbot-world-fast"
    fast.mkdir()
    (fast / "model-00001-of-00016.safetensors").write_bytes(b"")
    wan = _layout(tmp_path / "Wan2.2-I2V-A14B", ())
    with pytest.raises(CheckpointError, match="components_dir"):
        resolve_checkpoint_dir(fast)
    paths = resolve_checkpoint_dir(fast, CheckpointNames(components_dir=str(wan)))
    assert paths.dit_dir == fast.resolve() and paths.vae_file == wan.resolve() / "Wan2.1_VAE.pth"
    assert paths.tokenizer_dir == wan.resolve() / "google" / "umt5-xxl"


def test_vae_and_umt5_sizes_are_read_from_their_files(tmp_path: Path) -> None:
    torch.manual_seed(0)
    torch.save(WanVAE(VAE_CFG).state_dict(), tmp_path / "vae.pth")
    t5_cfg = T5Config.preset("tiny")
    torch.save(T5Encoder(t5_cfg).state_dict(), tmp_path / "t5.pth")
    assert load_vae(tmp_path / "vae.pth").cfg == VAE_CFG
    assert load_t5(tmp_path / "t5.pth").cfg == t5_cfg


def test_vae_pth_loads_strictly_in_float32(tmp_path: Path) -> None:
    torch.manual_seed(0)
    src = WanVAE(VAE_CFG)
    torch.save({k: v.to(torch.bfloat16) for k, v in src.state_dict().items()}, tmp_path / "vae.pth")
    vae = load_vae(tmp_path / "vae.pth", VAE_CFG)
    assert all(p.dtype == torch.float32 and not p.is_meta for p in vae.parameters())
    torch.testing.assert_close(vae.latent_inv_std, 1.0 / torch.tensor(VAE_CFG.latent_std))
    torch.testing.assert_close(vae.conv2.weight, src.conv2.weight.to(torch.bfloat16).float())


def test_t5_loads_in_the_requested_dtype(tmp_path: Path) -> None:
    cfg = T5Config.preset("tiny")
    torch.save(T5Encoder(cfg).state_dict(), tmp_path / "t5.pth")
    t5 = load_t5(tmp_path / "t5.pth", cfg, dtype=torch.bfloat16)
    assert {p.dtype for p in t5.parameters()} == {torch.bfloat16}
    assert load_t5(tmp_path / "t5.pth", cfg).token_embedding.weight.dtype == torch.float32  # CPU default


@pytest.mark.parametrize("edit, message", [
    (lambda sd: sd.pop("conv1.weight"), "missing: conv1.weight"),
    (lambda sd: sd.__setitem__("extra.weight", torch.zeros(1)), "unexpected: extra.weight"),
    (lambda sd: sd.__setitem__("conv2.bias", torch.zeros(3)), r"shape mismatch: conv2.bias: checkpoint \(3,\)"),
])  # fmt: skip
def test_key_mismatches_are_named_in_the_error(tmp_path: Path, edit, message: str) -> None:  # type: ignore[no-untyped-def]
    sd = WanVAE(VAE_CFG).state_dict()
    edit(sd)
    torch.save(sd, tmp_path / "bad.pth")
    with pytest.raises(CheckpointError, match=message) as err:
        load_vae(tmp_path / "bad.pth", VAE_CFG)
    assert "bad.pth" in str(err.value)


def test_a_file_that_is_not_a_state_dict_is_refused(tmp_path: Path) -> None:
    torch.save({"step": 3}, tmp_path / "x.pth")
    with pytest.raises(CheckpointError, match="state dict"):
        load_state_dict_file(tmp_path / "x.pth")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_state_dict_file(tmp_path / "missing.pth")
