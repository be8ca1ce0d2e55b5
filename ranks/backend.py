"""Builds the stages of the configured backend for the roles of one rank (the only place that picks one).

``model.kind`` is ``synthetic``, ``lingbot-fast``, or ``package.module:function`` naming a backend of your own,
called like ``build`` below (the tests' failure injection, ``tests/faulty_backend.py``, is one).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from models.controls import motion_speeds
from models.stages import ConditionStage, DecodeStage, DenoiseStage, StreamGeometry
from models.synthetic import SyntheticCondition, SyntheticDecode, SyntheticDenoise, synthetic_geometry
from runtime.config import ControlsConfig, ModelConfig, StreamConfig, SyntheticConfig

log = logging.getLogger(__name__)


@dataclass
class Backend:
    geometry: StreamGeometry  # at stream.height x stream.width; a session's is ``geometry.with_size(h, w)``
    condition: ConditionStage | None = None
    denoise: DenoiseStage | None = None
    decode: DecodeStage | None = None


Builder = Callable[[ModelConfig, StreamConfig, SyntheticConfig, ControlsConfig, list[str], torch.device, Any], Backend]


def build(model: ModelConfig, stream: StreamConfig, synthetic: SyntheticConfig, controls: ControlsConfig,
          roles: list[str], device: torch.device, dit_group: Any | None) -> Backend:
    """The backend's geometry and the stages of ``roles`` (``condition``, ``denoise``, ``decode``) on this rank."""
    if model.kind == "synthetic":
        return build_synthetic(model, stream, synthetic, controls, roles, device, dit_group)
    if model.kind == "lingbot-fast":
        return build_lingbot(model, stream, controls, roles, device, dit_group)
    module, function = model.kind.split(":")
    builder: Builder = getattr(importlib.import_module(module), function)
    return builder(model, stream, synthetic, controls, roles, device, dit_group)


def build_synthetic(model: ModelConfig, stream: StreamConfig, costs: SyntheticConfig, controls: ControlsConfig,
                    roles: list[str], device: torch.device, dit_group: Any | None) -> Backend:
    geometry = synthetic_geometry(stream.height, stream.width, stream.chunk_latent_frames)
    backend = Backend(geometry=geometry)
    if "condition" in roles:
        backend.condition = SyntheticCondition(geometry, costs.encode_s, costs.cold_s)
    if "denoise" in roles:
        backend.denoise = SyntheticDenoise(geometry, costs.denoise_s, dit_group, motion_speeds(controls),
                                           costs.cold_s)
    if "decode" in roles:
        backend.decode = SyntheticDecode(geometry, costs.decode_s, costs.cold_s)
    return backend


def build_lingbot(model: ModelConfig, stream: StreamConfig, controls: ControlsConfig,
                  roles: list[str], device: torch.device, dit_group: Any | None) -> Backend:
    from models import lingbot, lingbot_config

    backend = Backend(geometry=lingbot_config.lingbot_geometry(model, stream))
    # The DiT first: its build ends in a collective of the DiT group (the attention choice, on CUDA), which every
    # DiT rank then reaches after loading the same DiT, not a co-located rank after also loading umT5-XXL and a VAE
    # (over a minute on fast4's rank 0, past timeouts.collective_s). The launcher's start-up barrier covers the rest.
    if "denoise" in roles:
        backend.denoise = lingbot.build_denoise(model, stream, controls, device, dit_group)
    if "condition" in roles:
        backend.condition = lingbot.build_condition(model, stream, device)
    if "decode" in roles:
        backend.decode = lingbot.build_decode(model, stream, device)
    return backend
