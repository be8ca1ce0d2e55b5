"""LingBot-World-Fast's presets and geometry: the DiT a config runs, the stream geometry, the dtypes. Torch is imported
for the dtypes and the network configs only; nothing here builds a network.

A model preset names the three networks together (DiT, VAE, umT5) and the streaming recipe of the DiT (chunk size,
timestep schedule, KV window and sink). ``v1`` and ``v2`` are the released models: with a checkpoint the sizes of
all three networks come from the files (the DiT's ``config.json``, the VAE's and umT5's tensor shapes) and the
recipe from the preset and ``[model]``. ``tiny`` and ``small`` are random-weight sizes for tests and CPU demos
(the frames are noise). ``models.checkpoints`` resolves where the files are.

The stages (``models.lingbot``) and the memory model (``models.memory``) both read these, so they stand below both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from models.checkpoints import CheckpointNames, resolve_checkpoint_dir
from models.dit_checkpoint import config_from_dict
from models.dit_config import MODEL_PRESETS, DiTConfig
from models.stages import StreamGeometry
from models.t5 import T5Config
from models.vae import VAEConfig

LATENT_CHANNELS = 16
CONDITION_CHANNELS = 20  # 4 first-frame mask channels + 16 latent channels of [image, black frames]
SPATIAL_STRIDE = 8


@dataclass(frozen=True)
class Preset:
    dit: str  # DiTConfig preset name
    vae: VAEConfig  # the random-weight size (a checkpoint's own sizes win)
    t5: T5Config


def _presets() -> dict[str, Preset]:
    return {
        "tiny": Preset(MODEL_PRESETS["tiny"], VAEConfig.preset("tiny"), T5Config.preset("tiny")),
        "small": Preset(MODEL_PRESETS["small"], VAEConfig.preset("small"),
                        T5Config(vocab=1024, dim=64, dim_attn=64, dim_ffn=160, num_heads=4, num_layers=2)),
        "v1": Preset(MODEL_PRESETS["v1"], VAEConfig.preset("wan2.1"), T5Config.preset("umt5-xxl")),
        "v2": Preset(MODEL_PRESETS["v2"], VAEConfig.preset("wan2.1"), T5Config.preset("umt5-xxl")),
    }


def preset(name: str) -> Preset:
    presets = _presets()
    if name not in presets:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {sorted(presets)}")
    return presets[name]


def dit_config(model: Any, stream: Any) -> DiTConfig:
    """The DiT a config runs: the architecture of the checkpoint's ``config.json`` (else the preset's) with the
    streaming settings of the preset, ``[model]`` and ``[stream]`` (one validation at the end)."""
    recipe = _recipe(model, stream)
    if not model.checkpoint_dir:
        return recipe
    config_file = resolve_checkpoint_dir(model.checkpoint_dir, checkpoint_names(model)).dit_dir / "config.json"
    return config_from_dict(json.loads(config_file.read_text()), recipe) if config_file.is_file() else recipe


def _recipe(model: Any, stream: Any) -> DiTConfig:
    return DiTConfig.from_name(preset(model.preset).dit).with_kv_window(
        model.kv_window, model.kv_sink, model.kv_full_frames, chunk_size=stream.chunk_latent_frames,
        attention=model.attention, compile=model.compile, fused_qkv=model.fused_qkv,
        overlap_all_to_all=model.overlap_all_to_all)  # fmt: skip


def checkpoint_names(model: Any) -> CheckpointNames:
    return CheckpointNames(dit_subdir=model.dit_subdir or None, vae_file=model.vae_file, t5_file=model.t5_file,
                           tokenizer_dir=model.tokenizer_dir, components_dir=model.components_dir or None)  # fmt: skip


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
        dtype="float32",  # the sampler state stays float32 on the wire, whatever the compute dtype
        max_chunks=cfg.max_chunks,
    )


def compute_dtype(model: Any, device: torch.device) -> torch.dtype:
    if model.dtype == "float32":
        return torch.float32
    if model.dtype == "bfloat16":
        return torch.bfloat16
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def vae_dtype(model: Any, device: torch.device) -> torch.dtype:
    """bf16 only when asked for and on CUDA; "tf32" and "float32" keep fp32 weights (TF32 is a backend flag that
    ``ranks`` sets once per rank, see ``models.precision``)."""
    return torch.bfloat16 if model.vae_dtype == "bfloat16" and device.type == "cuda" else torch.float32
