"""The real-model backend's wiring: presets agree across the three networks, both VAEs are the same model."""

from __future__ import annotations

import pytest
import torch

from models import lingbot, lingbot_config
from runtime import config as config_mod


def test_condition_and_decode_ranks_build_the_same_random_vae() -> None:
    cfg = config_mod.load("cpu-tiny-model")
    condition = lingbot.build_condition(cfg.model, cfg.stream, torch.device("cpu"))
    decode = lingbot.build_decode(cfg.model, cfg.stream, torch.device("cpu"))
    a, b = condition.vae.state_dict(), decode.vae.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", ["tiny", "small", "v1", "v2"])
def test_every_preset_pairs_a_text_encoder_as_wide_as_the_dit_context(name: str) -> None:
    from models.dit_config import DiTConfig

    chosen = lingbot_config.preset(name)
    assert DiTConfig.from_name(chosen.dit).text_dim == chosen.t5.dim
    assert config_mod.PRESET_HEADS[name] == DiTConfig.from_name(chosen.dit).num_heads


def test_geometry_gives_the_shapes_of_every_transfer() -> None:
    cfg = config_mod.load("cpu-tiny-model")
    g = lingbot_config.lingbot_geometry(cfg.model, cfg.stream)
    assert (g.condition_shape, g.latent_shape, g.context_shape) == ((20, 3, 8, 12), (16, 3, 8, 12), (16, 32))
    assert [g.frames_in_chunk(i) for i in range(3)] == [9, 12, 12]


def test_unknown_preset_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        lingbot_config.preset("huge")
