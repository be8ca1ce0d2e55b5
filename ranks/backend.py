"""Builds the stages of the configured backend for the roles of one rank (the only place that picks one)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from models.stages import ConditionStage, DecodeStage, DenoiseStage, StreamGeometry
from models.synthetic import SyntheticCondition, SyntheticDecode, SyntheticDenoise, synthetic_geometry
from runtime.config import Config

log = logging.getLogger(__name__)


@dataclass
class Backend:
    geometry: StreamGeometry
    condition: ConditionStage | None = None
    denoise: DenoiseStage | None = None
    decode: DecodeStage | None = None


def geometry_of(config: Config) -> StreamGeometry:
    st = config.stream
    if config.model.kind == "synthetic":
        return synthetic_geometry(st.height, st.width, st.chunk_latent_frames)
    from models.lingbot import lingbot_geometry

    return lingbot_geometry(config.model, st)


def build(config: Config, roles: list[str], device: torch.device, dit_group: Any | None) -> Backend:
    geometry = geometry_of(config)
    backend = Backend(geometry=geometry)
    if config.model.kind == "synthetic":
        costs = config.synthetic
        if "condition" in roles:
            backend.condition = SyntheticCondition(geometry, costs.encode_s, costs.fail_marker)
        if "dit" in roles:
            backend.denoise = SyntheticDenoise(geometry, costs.denoise_s, dit_group, costs.fail_marker)
        if "decode" in roles:
            backend.decode = SyntheticDecode(geometry, costs.decode_s)
        return backend
    from models import lingbot

    if "condition" in roles:
        backend.condition = lingbot.build_condition(config.model, config.stream, device)
    if "dit" in roles:
        backend.denoise = lingbot.build_denoise(config.model, config.stream, config.controls, device, dit_group)
    if "decode" in roles:
        backend.decode = lingbot.build_decode(config.model, config.stream, device)
    return backend
