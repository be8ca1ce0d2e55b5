"""LingBot-World-Fast behind the stage interface: the stages of each role, built from the preset and geometry that
``models.lingbot_config`` states.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from models.checkpoints import load_vae, resolve_checkpoint_dir
from models.controls import motion_speeds
from models.lingbot_config import checkpoint_names, compute_dtype, dit_config, lingbot_geometry, preset, vae_dtype
from models.lingbot_denoise import LingbotDenoiseStage
from models.lingbot_vae_stages import (
    LingbotConditionStage,
    LingbotDecodeStage,
    random_stages,
    random_vae,
    stages_from_checkpoint,
)

log = logging.getLogger(__name__)


def build_condition(model: Any, stream: Any, device: torch.device) -> LingbotConditionStage:
    """umT5 + VAE encoder (the condition rank)."""
    text_len = dit_config(model, stream).text_len
    if model.checkpoint_dir:
        return stages_from_checkpoint(model.checkpoint_dir, stream.chunk_latent_frames, text_len=text_len,
                                      names=checkpoint_names(model), device=device,
                                      vae_dtype=vae_dtype(model, device)).condition  # fmt: skip
    chosen = preset(model.preset)
    log.warning("model preset %s with seeded RANDOM weights (no checkpoint_dir): the frames are noise", model.preset)
    return random_stages(chosen.vae, chosen.t5, stream.chunk_latent_frames, text_len=text_len,
                         seed=model.weights_seed, device=device).condition


def build_decode(model: Any, stream: Any, device: torch.device) -> LingbotDecodeStage:
    """The VAE alone (the decode rank needs no text encoder)."""
    if model.checkpoint_dir:
        path = resolve_checkpoint_dir(model.checkpoint_dir, checkpoint_names(model)).vae_file
        return LingbotDecodeStage(load_vae(path, device=device, dtype=vae_dtype(model, device)))
    return LingbotDecodeStage(random_vae(preset(model.preset).vae, device, model.weights_seed))  # = the condition's


def build_denoise(model: Any, stream: Any, controls: Any, device: torch.device,
                  group: Any | None) -> LingbotDenoiseStage:  # fmt: skip
    weights = (resolve_checkpoint_dir(model.checkpoint_dir, checkpoint_names(model)).dit_dir
               if model.checkpoint_dir else None)  # fmt: skip
    return LingbotDenoiseStage(dit_config(model, stream), lingbot_geometry(model, stream), device=device,
                               dtype=compute_dtype(model, device), group=group, weights=weights,
                               speeds=motion_speeds(controls), init_seed=model.weights_seed,
                               translation_scale=controls.translation_scale,
                               intrinsics=tuple(controls.intrinsics))  # fmt: skip
