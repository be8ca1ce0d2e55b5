"""Loading the DiT: a checkpoint directory with a diffusers-style ``config.json`` and sharded safetensors.

Layout: ``config.json`` (the ``WanModelFast`` constructor arguments) and either one ``*.safetensors`` file
or shards with ``diffusion_pytorch_model.safetensors.index.json`` (``{"weight_map": {name: shard}}``). The model
is built on the ``meta`` device and materialised shard by shard in the target dtype (bf16 on GPU), so a
14B-parameter model never exists twice in memory. Loading is strict: missing or unexpected keys are an error
that names them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import fields, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.dit import DiTConfig, WanModelFast

log = logging.getLogger(__name__)

INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
# Constructor keys of the official model that are fixed in this implementation (checked, not stored).
_FIXED = {"model_type": "i2v", "control_type": "cam", "qk_norm": True, "cross_attn_norm": True}
_IGNORED = {"window_size", "dropout"}


def config_from_dict(raw: dict[str, object], base: DiTConfig | None = None) -> DiTConfig:
    """``DiTConfig`` from the official constructor arguments (or a diffusers-style config.json)."""
    known = {f.name for f in fields(DiTConfig)}
    values: dict[str, object] = {}
    for key, value in raw.items():
        if key.startswith("_") or key in _IGNORED:
            continue
        if key in _FIXED:
            if value != _FIXED[key]:
                raise ValueError(f"unsupported {key}={value!r}; this implementation is {key}={_FIXED[key]!r}")
            continue
        if key not in known:
            log.warning("ignoring unknown DiT config key %s=%r", key, value)
            continue
        values[key] = tuple(value) if isinstance(value, list) else value
    return replace(base or DiTConfig(), **values)  # type: ignore[arg-type]


def _shards(directory: Path) -> dict[str, list[str]]:
    """Shard file -> tensor names."""
    index = directory / INDEX_NAME
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        out: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            out.setdefault(shard, []).append(name)
        return out
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no {INDEX_NAME} and no *.safetensors in {directory}")
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
    model._time_memo.clear()
    return model


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
    dst.copy_(src.to(device=dst.device, dtype=dst.dtype))


def load_dit(
    directory: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    **overrides: object,
) -> WanModelFast:
    """Build the DiT from ``directory/config.json`` on meta and load its safetensors strictly.

    ``dtype`` defaults to bfloat16 on CUDA and float32 elsewhere; ``overrides`` replace config fields
    (streaming settings such as ``chunk_size`` or ``attention`` that a diffusers config may not carry).
    """
    directory = Path(directory)
    cfg = config_from_dict(json.loads((directory / "config.json").read_text()))
    cfg = replace(cfg, **overrides)  # type: ignore[arg-type]
    if dtype is None:
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    with torch.device("meta"):
        model = WanModelFast(cfg)
    return load_state_dict_strict(model, None, directory, device, dtype).eval()


def save_dit(model: WanModelFast, directory: str | Path, max_shard_bytes: int = 2**30) -> None:
    """Write ``config.json``, safetensors shards and the index (the layout ``load_dit`` reads)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    raw = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    raw = {k: list(v) if isinstance(v, tuple) else v for k, v in raw.items()}
    (directory / "config.json").write_text(json.dumps({"_class_name": "WanModelFast", **_FIXED, **raw}, indent=1))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, value in model.state_dict().items():
        nbytes = value.numel() * value.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value.detach().contiguous().cpu()
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / fname))
        weight_map.update(dict.fromkeys(shard, fname))
    (directory / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
