"""Loading the DiT: a folder of (sharded) safetensors with an optional diffusers-style ``config.json``.

Layouts as released: v1 ``model-000NN-of-00016.safetensors`` (in ``lingbot_world_fast/`` of the base-cam download),
v2 ``transformers/model-0000N-of-00008.safetensors``; shards may come with a ``*.safetensors.index.json``
(``{"weight_map": {name: shard}}``) or without one (each shard's keys are read from its header).

``config.json`` decides the architecture only (``ARCH_FIELDS``: widths, heads, layers, patch, eps). Its run-time
fields (``local_attn_size = -1``, ``sink_size = 0`` in the official class defaults) and keys the official class
ignores are logged and left out: the streaming settings (chunk size, timestep schedule, window, sink, attention
kernel) come from the preset and the config file, so a v2 checkpoint always samples on v2's schedule. Without a
``config.json`` the preset's architecture is used and the strict load checks it against every tensor's shape.

The model is built on the ``meta`` device and materialised shard by shard in the target dtype (bf16 on GPU), so a
14B-parameter model never exists twice in memory. Loading is strict: missing, unexpected or mis-shaped keys are
an error that names them.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import fields, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.dit import WanModelFast
from models.dit_config import ARCH_FIELDS, DiTConfig
from models.random_init import random_module

log = logging.getLogger(__name__)

INDEX_SUFFIX = ".safetensors.index.json"
SAVED_INDEX = "diffusion_pytorch_model.safetensors.index.json"
# Constructor keys of the official model that describe what this implementation is (checked, not stored).
_REQUIRED = {"control_type": "cam", "qk_norm": True, "cross_attn_norm": True}


def config_from_dict(raw: dict[str, object], base: DiTConfig) -> DiTConfig:
    """``base`` (the preset's streaming settings) with the architecture of a checkpoint's ``config.json``.

    Only ``ARCH_FIELDS`` are taken; every other key is logged as ignored (run-time fields, keys the official class
    ignores, diffusers bookkeeping) unless it contradicts what this implementation is (``_REQUIRED``).
    """
    values: dict[str, object] = {}
    ignored: dict[str, object] = {}
    for key, value in raw.items():
        if key in _REQUIRED:
            if value != _REQUIRED[key]:
                raise ValueError(f"checkpoint config {key}={value!r} is not supported: this runtime implements the "
                                 f"camera-controlled model ({key}={_REQUIRED[key]!r})")
        elif key in ARCH_FIELDS:
            values[key] = tuple(value) if isinstance(value, list) else value  # type: ignore[arg-type]
        elif not key.startswith("_"):
            ignored[key] = value
    if ignored:
        log.info("DiT config.json: architecture taken (%s); ignored (streaming settings come from the preset and "
                 "the config file): %s", ", ".join(sorted(values)), ", ".join(f"{k}={v!r}" for k, v in
                                                                             sorted(ignored.items())))  # fmt: skip
    try:
        return replace(base, **values)  # type: ignore[arg-type]
    except (AssertionError, TypeError) as error:
        raise ValueError(f"checkpoint architecture {values} does not fit the streaming settings: {error}") from None


def _index_file(directory: Path) -> Path | None:
    found = sorted(directory.glob("*" + INDEX_SUFFIX))
    if len(found) > 1:
        raise FileNotFoundError(f"several shard indexes in {directory}: {[p.name for p in found]}")
    return found[0] if found else None


def _shards(directory: Path) -> dict[str, list[str]]:
    """Shard file -> tensor names."""
    index = _index_file(directory)
    if index is not None:
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        out: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            out.setdefault(shard, []).append(name)
        missing = sorted(s for s in out if not (directory / s).is_file())
        if missing:
            raise FileNotFoundError(f"{index} names shards that are not in {directory}: {missing[:5]}")
        return out
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *{INDEX_SUFFIX} and no *.safetensors in {directory}")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            out[f.name] = list(sf.keys())
    return out


def load_state_dict_strict(
    model: WanModelFast,
    tensors: dict[str, torch.Tensor] | None,
    directory: Path | None,
    device: torch.device | str,
    dtype: torch.dtype,
) -> WanModelFast:
    """Materialise ``model`` (possibly on meta) from a state dict or a checkpoint directory, strictly."""
    expected = set(model.state_dict())
    if directory is not None:
        shards = _shards(directory)
        present = {name for names in shards.values() for name in names}
    else:
        assert tensors is not None
        present = set(tensors)
    missing, unexpected = sorted(expected - present), sorted(present - expected)
    if missing or unexpected:
        raise KeyError(
            f"DiT checkpoint does not match the model: {len(missing)} missing {missing[:10]}, "
            f"{len(unexpected)} unexpected {unexpected[:10]}"
        )
    model.to(dtype)  # cast while still on meta (free), so the target dtype is the only allocation
    model.to_empty(device=device)
    params = dict(model.state_dict(keep_vars=True))
    with torch.no_grad():
        if directory is not None:
            for shard, names in shards.items():
                with safe_open(str(directory / shard), framework="pt", device=str(device)) as sf:
                    for name in names:
                        _copy(params[name], sf.get_tensor(name), name)
        else:
            assert tensors is not None
            for name, value in tensors.items():
                _copy(params[name], value, name)
    model._forget_derived()
    return model


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
    dst.copy_(src.to(device=dst.device, dtype=dst.dtype))


def default_dtype(device: torch.device | str) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def load_dit(directory: str | Path, base: DiTConfig, device: torch.device | str = "cpu",
             dtype: torch.dtype | None = None) -> WanModelFast:  # fmt: skip
    """The DiT of ``directory``: architecture from its ``config.json`` (else ``base``'s), streaming settings from
    ``base``; built on meta and loaded strictly. ``dtype`` defaults to bf16 on CUDA and float32 elsewhere."""
    directory = Path(directory)
    config_file = directory / "config.json"
    if config_file.is_file():
        cfg = config_from_dict(json.loads(config_file.read_text()), base)
    else:
        log.info("%s has no config.json: using the preset's architecture (dim %d, %d layers)", directory, base.dim,
                 base.num_layers)  # fmt: skip
        cfg = base
    with torch.device("meta"):
        model = WanModelFast(cfg)
    return load_state_dict_strict(model, None, directory, device, dtype or default_dtype(device)).eval()


def random_dit(cfg: DiTConfig, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
               seed: int = 0) -> WanModelFast:  # fmt: skip
    """Seeded random weights drawn on ``device`` (``models.random_init``); modulation tables ``N(0, 1/dim)``."""
    def std_of(name: str, p: torch.Tensor) -> float | None:
        return 1.0 / math.sqrt(cfg.dim) if name.endswith("modulation") else None

    model = random_module(lambda: WanModelFast(cfg), device, dtype or default_dtype(device), seed, std_of)
    assert isinstance(model, WanModelFast)
    model._forget_derived()
    return model


def save_dit(model: WanModelFast, directory: str | Path, num_shards: int = 1,
             shard_name: str = "diffusion_pytorch_model-{i:05d}-of-{n:05d}.safetensors",
             index_name: str = SAVED_INDEX, extra_config: dict[str, object] | None = None) -> None:  # fmt: skip
    """Write ``config.json``, ``num_shards`` safetensors shards (consecutive tensors) and the index (a layout
    ``load_dit`` reads); ``extra_config`` adds keys the way a released config.json carries them; an empty
    ``index_name`` writes no index."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    raw = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name in ARCH_FIELDS}
    raw = {k: list(v) if isinstance(v, tuple) else v for k, v in raw.items()}
    config = {"_class_name": "WanModelFast", "model_type": "i2v", **_REQUIRED, **raw, **(extra_config or {})}
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    items = [(name, value.detach().contiguous().cpu()) for name, value in model.state_dict().items()]
    assert 1 <= num_shards <= len(items), f"{num_shards} shards for {len(items)} tensors"
    weight_map = {}
    for i in range(num_shards):
        shard = dict(items[i * len(items) // num_shards : (i + 1) * len(items) // num_shards])
        fname = shard_name.format(i=i + 1, n=num_shards)
        save_file(shard, str(directory / fname))
        weight_map.update(dict.fromkeys(shard, fname))
    if index_name:
        (directory / index_name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
