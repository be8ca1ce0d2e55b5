"""Strict loading of DiT checkpoints: sharded safetensors (with or without an index) and a config.json that decides
the architecture only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.dit import WanModelFast
from models.dit_checkpoint import SAVED_INDEX as INDEX_NAME
from models.dit_checkpoint import config_from_dict, load_dit, save_dit
from models.dit_config import DiTConfig

TINY = DiTConfig.from_name("tiny", attention="sdpa")


def _tiny(seed: int = 0) -> WanModelFast:
    torch.manual_seed(seed)
    return WanModelFast(TINY).eval()


def test_saved_sharded_checkpoint_loads_back_bit_identical(tmp_path: Path) -> None:
    model = _tiny()
    save_dit(model, tmp_path, num_shards=3)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 1, "the test must exercise several shards"
    loaded = load_dit(tmp_path, TINY)
    assert loaded.cfg == model.cfg
    ref, got = model.state_dict(), loaded.state_dict()
    assert ref.keys() == got.keys()
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_loading_in_bfloat16_materialises_every_tensor_in_that_dtype(tmp_path: Path) -> None:
    save_dit(_tiny(), tmp_path)
    loaded = load_dit(tmp_path, TINY, dtype=torch.bfloat16)
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
        load_dit(tmp_path, TINY)


def test_unexpected_key_is_an_error_that_names_it(tmp_path: Path) -> None:
    save_dit(_tiny(), tmp_path)
    _rewrite_single_shard(tmp_path, {"blocks.0.extra.weight": torch.zeros(3)})
    with pytest.raises(KeyError, match=r"1 unexpected \['blocks.0.extra.weight'\]"):
        load_dit(tmp_path, TINY)


def test_wrong_shape_is_an_error(tmp_path: Path) -> None:
    save_dit(_tiny(), tmp_path)
    _rewrite_single_shard(tmp_path, {"head.head.bias": torch.zeros(7)})
    with pytest.raises(ValueError, match=r"head\.head\.bias"):
        load_dit(tmp_path, TINY)


# The key set of a released config.json: the official class's constructor arguments with its run-time defaults
# (local_attn_size -1, sink_size 0: "no window"), keys it ignores, and diffusers bookkeeping.
RELEASED_KEYS = {"_class_name": "WanModelFast", "_diffusers_version": "0.35.0", "model_type": "i2v",
                 "patch_size": [1, 2, 2], "text_len": 16, "in_dim": 36, "dim": 60, "ffn_dim": 120, "freq_dim": 256,
                 "text_dim": 32, "out_dim": 16, "num_heads": 5, "num_layers": 2, "window_size": [-1, -1],
                 "qk_norm": True, "cross_attn_norm": True, "eps": 1e-06, "local_attn_size": -1, "sink_size": 0,
                 "control_type": "cam"}  # fmt: skip


def test_a_released_config_gives_the_architecture_and_leaves_the_streaming_settings_to_the_preset() -> None:
    v2 = DiTConfig.from_name("lingbot-world-fast-v2")
    cfg = config_from_dict({**RELEASED_KEYS, "model_type": "t2v", "unknown_future_key": 3}, base=v2)
    assert (cfg.dim, cfg.num_heads, cfg.num_layers, cfg.patch_size) == (60, 5, 2, (1, 2, 2))
    # -1/0 run-time fields do not stop the load and do not leak in: the window, sink and schedule are v2's
    assert (cfg.kv_window, cfg.kv_sink, cfg.chunk_size) == (18, 6, 4)
    assert cfg.timestep_indices == (0, 250, 500, 750)


def test_a_config_for_another_control_kind_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="control_type='act' is not supported"):
        config_from_dict({**RELEASED_KEYS, "control_type": "act"}, base=TINY)


def test_released_shard_names_load_with_and_without_an_index_and_without_config_json(tmp_path: Path) -> None:
    model = _tiny(3)
    v1 = tmp_path / "v1"  # model-000NN-of-000MM.safetensors + model.safetensors.index.json
    save_dit(model, v1, num_shards=4, shard_name="model-{i:05d}-of-{n:05d}.safetensors",
             index_name="model.safetensors.index.json", extra_config=RELEASED_KEYS)  # fmt: skip
    bare = tmp_path / "bare"  # shards only: keys read from every shard's header, architecture from the preset
    save_dit(model, bare, num_shards=3, index_name="")
    (bare / "config.json").unlink()
    for folder in (v1, bare):
        assert len(list(folder.glob("*.safetensors"))) > 1
        loaded = load_dit(folder, TINY)
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
