"""Builds the stages of the configured backend for the roles of one rank (the only place that picks one).

``model.kind`` is ``synthetic``, ``lingbot-fast``, or ``package.module:function`` naming a backend of your own,
called like ``build`` below (the tests' failure injection, ``tests/faulty_backend.py``, is one).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ipc.protocol import Stage
from models.controls import motion_speeds
from models.stages import ConditionStage, DecodeStage, DenoiseStage, StreamGeometry
from models.synthetic import SyntheticCondition, SyntheticDecode, SyntheticDenoise, synthetic_geometry
from runtime.config import ControlsConfig, ModelConfig, StreamConfig, SyntheticConfig

log = logging.getLogger(__name__)


class Backend(dict[Stage, Any]):
    """The stages one rank runs, keyed by ``Stage`` (what is stage-shaped iterates it: warm-up, memory), and the
    geometry they share; ``condition``, ``denoise`` and ``decode`` read one with its type (None: not on this rank)."""

    def __init__(self, geometry: StreamGeometry, stages: Mapping[Stage, Any] | None = None) -> None:
        super().__init__(stages or {})
        self.geometry = geometry  # at stream.height x stream.width; a session's is ``geometry.with_size(h, w)``

    @property
    def condition(self) -> ConditionStage | None:
        return self.get(Stage.CONDITION)

    @property
    def denoise(self) -> DenoiseStage | None:
        return self.get(Stage.DENOISE)

    @property
    def decode(self) -> DecodeStage | None:
        return self.get(Stage.DECODE)


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
    backend = Backend(geometry)
    if "condition" in roles:
        backend[Stage.CONDITION] = SyntheticCondition(geometry, costs.encode_s, costs.cold_s)
    if "denoise" in roles:
        backend[Stage.DENOISE] = SyntheticDenoise(geometry, costs.denoise_s, dit_group, motion_speeds(controls),
                                                  costs.cold_s)
    if "decode" in roles:
        backend[Stage.DECODE] = SyntheticDecode(geometry, costs.decode_s, costs.cold_s)
    return backend


def build_lingbot(model: ModelConfig, stream: StreamConfig, controls: ControlsConfig,
                  roles: list[str], device: torch.device, dit_group: Any | None) -> Backend:
    from models import lingbot, lingbot_config

    backend = Backend(lingbot_config.lingbot_geometry(model, stream))
    # The DiT first: its build ends in a collective of the DiT group (the attention choice, on CUDA), which every
    # DiT rank then reaches after loading the same DiT, not a co-located rank after also loading umT5-XXL and a VAE
    # (over a minute on fast4's rank 0, past timeouts.collective_s). The launcher's start-up barrier covers the rest.
    if "denoise" in roles:
        backend[Stage.DENOISE] = lingbot.build_denoise(model, stream, controls, device, dit_group)
    if "condition" in roles:
        backend[Stage.CONDITION] = lingbot.build_condition(model, stream, device)
    if "decode" in roles:
        backend[Stage.DECODE] = lingbot.build_decode(model, stream, device)
    return backend
