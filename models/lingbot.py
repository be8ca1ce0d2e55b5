"""LingBot-World-Fast behind the stage interface: presets, geometry and the stages of each role.

A model preset names the three networks together (DiT, VAE, umT5), so the text width of the encoder always
matches the DiT's. With ``checkpoint_dir`` empty the weights are seeded random (the same on every rank), which
is only meaningful for tests and CPU demos: the frames are noise. With a checkpoint directory the released
weights load strictly (DiT sharded safetensors with its config.json, ``Wan2.1_VAE.pth``,
``models_t5_umt5-xxl-enc-bf16.pth`` and the umT5 tokenizer, resolved by ``models.checkpoints``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from models.checkpoints import load_vae, resolve_checkpoint_dir
from models.dit import DiTConfig
from models.lingbot_denoise import LingbotDenoiseStage
from models.lingbot_vae_stages import (
    LingbotConditionStage,
    LingbotDecodeStage,
    random_stages,
    stages_from_checkpoint,
)
from models.stages import StreamGeometry
from models.t5 import T5Config
from models.vae import VAEConfig, WanVAE

log = logging.getLogger(__name__)

LATENT_CHANNELS = 16
CONDITION_CHANNELS = 20  # 4 first-frame mask channels + 16 latent channels of [image, black frames]
SPATIAL_STRIDE = 8


@dataclass(frozen=True)
class Preset:
    dit: str  # DiTConfig preset name
    vae: VAEConfig
    t5: T5Config


def _presets() -> dict[str, Preset]:
    return {
        "tiny": Preset("tiny", VAEConfig.preset("tiny"), T5Config.preset("tiny")),
        "small": Preset("small", VAEConfig.preset("small"),
                        T5Config(vocab=1024, dim=64, dim_attn=64, dim_ffn=160, num_heads=4, num_layers=2)),
        "v1": Preset("lingbot-world-fast-v1", VAEConfig.preset("wan2.1"), T5Config.preset("umt5-xxl")),
        "v2": Preset("lingbot-world-fast-v2", VAEConfig.preset("wan2.1"), T5Config.preset("umt5-xxl")),
    }


def preset(name: str) -> Preset:
    presets = _presets()
    if name not in presets:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {sorted(presets)}")
    return presets[name]


def dit_config(model: Any, stream: Any) -> DiTConfig:
    return DiTConfig.from_name(preset(model.preset).dit, chunk_size=stream.chunk_latent_frames,
                               attention=model.attention)


def lingbot_geometry(model: Any, stream: Any) -> StreamGeometry:
    cfg = dit_config(model, stream)
    cs, h, w = stream.chunk_latent_frames, stream.height // SPATIAL_STRIDE, stream.width // SPATIAL_STRIDE
    return StreamGeometry(
        height=stream.height,
        width=stream.width,
        chunk_latent_frames=cs,
        context_shape=(cfg.text_len, cfg.text_dim),
        condition_shape=(CONDITION_CHANNELS, cs, h, w),
        latent_shape=(LATENT_CHANNELS, cs, h, w),
        dtype=torch.float32,  # the sampler state stays float32 on the wire, whatever the compute dtype
    )


def compute_dtype(model: Any, device: torch.device) -> torch.dtype:
    if model.dtype == "float32":
        return torch.float32
    if model.dtype == "bfloat16":
        return torch.bfloat16
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def build_condition(model: Any, stream: Any, device: torch.device) -> LingbotConditionStage:
    """umT5 + VAE encoder (the condition rank)."""
    text_len = dit_config(model, stream).text_len
    if model.checkpoint_dir:
        return stages_from_checkpoint(model.checkpoint_dir, stream.chunk_latent_frames, text_len=text_len,
                                      device=device).condition
    chosen = preset(model.preset)
    log.warning("model preset %s with seeded RANDOM weights (no checkpoint_dir): the frames are noise", model.preset)
    return random_stages(chosen.vae, chosen.t5, stream.chunk_latent_frames, text_len=text_len,
                         seed=model.weights_seed, device=device).condition


def build_decode(model: Any, stream: Any, device: torch.device) -> LingbotDecodeStage:
    """The VAE alone (the decode rank needs no text encoder)."""
    if model.checkpoint_dir:
        vae = load_vae(resolve_checkpoint_dir(model.checkpoint_dir).vae_file, preset(model.preset).vae, device=device)
        return LingbotDecodeStage(vae)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(model.weights_seed)  # the same draw as the condition rank's VAE (built first there)
        vae = WanVAE(preset(model.preset).vae).to(device).eval()
    return LingbotDecodeStage(vae)


def build_denoise(model: Any, stream: Any, device: torch.device, group: Any | None) -> LingbotDenoiseStage:
    weights = resolve_checkpoint_dir(model.checkpoint_dir).dit_dir if model.checkpoint_dir else None
    return LingbotDenoiseStage(dit_config(model, stream), lingbot_geometry(model, stream), device=device,
                               dtype=compute_dtype(model, device), group=group, weights=weights,
                               init_seed=model.weights_seed)
