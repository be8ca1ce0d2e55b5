"""Strict loading of DiT checkpoints: sharded safetensors + index + config.json round-trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.dit import DiTConfig, WanModelFast
from models.dit_checkpoint import INDEX_NAME, config_from_dict, load_dit, save_dit


def _tiny(seed: int = 0) -> WanModelFast:
    torch.manual_seed(seed)
    return WanModelFast(DiTConfig.from_name("tiny", attention="sdpa")).eval()


def test_saved_sharded_checkpoint_loads_back_bit_identical(tmp_path: Path) -> None:
    model = _tiny()
    save_dit(model, tmp_path, max_shard_bytes=64 * 1024)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 1, "the test must exercise several shards"
    loaded = load_dit(tmp_path)
    assert loaded.cfg == model.cfg
    ref, got = model.state_dict(), loaded.state_dict()
    assert ref.keys() == got.keys()
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_loading_in_bfloat16_materialises_every_tensor_in_that_dtype(tmp_path: Path) -> None:
    save_dit(_tiny(), tmp_path)
    loaded = load_dit(tmp_path, dtype=torch.bfloat16)
    assert {t.dtype for t in loaded.state_dict().values()} == {torch.bfloat16}
    assert not any(t.is_meta for t in loaded.state_dict().values())


def _rewrite_single_shard(directory: Path, edit: dict[str, torch.Tensor | None]) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
        shard.unlink()
    (directory / INDEX_NAME).unlink()
    for name, value in edit.items():
        if value is None:
            tensors.pop(name)
        else:
            tensors[name] = value
    save_file(tensors, str(directory / "model.safetensors"))


def test_missing_key_is_an_error_that_names_it(tmp_path: Path) -> None:
    save_dit(_tiny(), tmp_path)
    _rewrite_single_shard(tmp_path, {"blocks.1.cam_shift_layer.bias": None})
    with pytest.raises(KeyError, match=r"1 missing \['blocks.1.cam_shift_layer.bias'\]"):
        load_dit(tmp_path)


def test_unexpected_key_is_an_error_that_names_it(tmp_path: Path) -> None:
    save_dit(_tiny(), tmp_path)
    _rewrite_single_shard(tmp_path, {"blocks.0.extra.weight": torch.zeros(3)})
    with pytest.raises(KeyError, match=r"1 unexpected \['blocks.0.extra.weight'\]"):
        load_dit(tmp_path)


def test_wrong_shape_is_an_error(tmp_path: Path) -> None:
    save_dit(_tiny(), tmp_path)
    _rewrite_single_shard(tmp_path, {"head.head.bias": torch.zeros(7)})
    with pytest.raises(ValueError, match=r"head\.head\.bias"):
        load_dit(tmp_path)


def test_official_constructor_arguments_map_to_the_config() -> None:
    cfg = config_from_dict(
        {"model_type": "i2v", "control_type": "cam", "dim": 60, "num_heads": 5, "patch_size": [1, 2, 2], "_x": 1},
        base=DiTConfig.from_name("tiny"),
    )
    assert (cfg.dim, cfg.num_heads, cfg.patch_size) == (60, 5, (1, 2, 2))
    with pytest.raises(ValueError, match="model_type"):
        config_from_dict({"model_type": "t2v"})
