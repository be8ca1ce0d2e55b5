"""Checkpoint directory layout and strict weight loading: the one place that knows file names.

A LingBot-World checkpoint directory (Wan2.x layout) looks like::

    <root>/
      <dit subfolder>/config.json, diffusion_pytorch_model*.safetensors[.index.json]
      Wan2.1_VAE.pth
      models_t5_umt5-xxl-enc-bf16.pth
      google/umt5-xxl/spiece.model          (tokenizer folder)

``resolve_checkpoint_dir`` turns a root plus ``CheckpointNames`` (from config) into checked absolute paths and
explains exactly what is missing. ``.pth`` files are opened with ``torch.load(weights_only=True, mmap=True)``
(no pickle code execution, no full read into RAM) and materialised in the dtype and on the device the module
needs. Loading is strict: any missing, unexpected or mis-shaped key raises ``CheckpointError`` naming them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from models.t5 import T5Config, T5Encoder
from models.vae import VAEConfig, WanVAE

SAFETENSORS_SUFFIX = ".safetensors"


class CheckpointError(RuntimeError):
    """A checkpoint directory or file does not match what the model expects."""


@dataclass(frozen=True)
class CheckpointNames:
    """Names inside a checkpoint directory (config section ``checkpoint``); defaults are the official ones."""

    dit_subdir: str | None = None  # None: the single subfolder (or the root) holding config.json + safetensors
    vae_file: str = "Wan2.1_VAE.pth"
    t5_file: str = "models_t5_umt5-xxl-enc-bf16.pth"
    tokenizer_subdir: str = "google/umt5-xxl"  # folder with the SentencePiece model (spiece.model)


@dataclass(frozen=True)
class CheckpointPaths:
    """Resolved, existing paths of every component."""

    root: Path
    dit_dir: Path  # holds config.json and the (sharded) safetensors
    vae_file: Path
    t5_file: Path
    tokenizer_dir: Path


def resolve_checkpoint_dir(root: str | Path, names: CheckpointNames | None = None) -> CheckpointPaths:
    """Locate every component under ``root``; raise ``CheckpointError`` listing what is missing and what exists."""
    names = names or CheckpointNames()
    root = Path(root).expanduser().resolve()
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    problems: list[str] = []
    vae, t5, tok = root / names.vae_file, root / names.t5_file, root / names.tokenizer_subdir
    if not vae.is_file():
        problems.append(f"VAE weights {names.vae_file!r} not found")
    if not t5.is_file():
        problems.append(f"T5 weights {names.t5_file!r} not found")
    if not tok.is_dir():
        problems.append(f"tokenizer folder {names.tokenizer_subdir!r} not found")
    dit = _find_dit_dir(root, names.dit_subdir, problems)
    if problems:
        listing = ", ".join(sorted(p.name + ("/" if p.is_dir() else "") for p in root.iterdir())) or "(empty)"
        raise CheckpointError(f"checkpoint directory {root}: " + "; ".join(problems) + f". Contents: {listing}")
    assert dit is not None
    return CheckpointPaths(root=root, dit_dir=dit, vae_file=vae, t5_file=t5, tokenizer_dir=tok)


def _is_dit_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*" + SAFETENSORS_SUFFIX))


def _find_dit_dir(root: Path, subdir: str | None, problems: list[str]) -> Path | None:
    if subdir is not None:
        path = root / subdir
        if not _is_dit_dir(path):
            problems.append(f"DiT folder {subdir!r} has no config.json plus *.safetensors")
            return None
        return path
    candidates = [p for p in [root, *sorted(d for d in root.iterdir() if d.is_dir())] if _is_dit_dir(p)]
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        problems.append("no DiT folder (config.json plus *.safetensors) in the root or a direct subfolder")
    else:
        found = [str(c.relative_to(root)) or "." for c in candidates]
        problems.append(f"several DiT folders {found}; set checkpoint.dit_subdir to choose one")
    return None


def load_state_dict_file(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of a ``.pth`` (weights only, memory-mapped) or ``.safetensors`` file, on the CPU, as stored."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"weights file {path} does not exist")
    if path.suffix == SAFETENSORS_SUFFIX:
        from safetensors.torch import load_file

        return load_file(str(path))
    obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{path} does not hold a flat name -> tensor state dict")
    return dict(obj)


def check_keys(module: nn.Module, state: Mapping[str, torch.Tensor], what: str) -> None:
    """Raise ``CheckpointError`` unless ``state`` has exactly the module's parameter names and shapes."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
              for k in sorted(set(expected) & set(state)) if state[k].shape != expected[k].shape]  # fmt: skip
    if missing or unexpected or shapes:
        parts = []
        for label, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes)):
            if items:
                shown = ", ".join(items[:8]) + (f", ... ({len(items)} in all)" if len(items) > 8 else "")
                parts.append(f"{label}: {shown}")
        raise CheckpointError(f"{what} checkpoint does not match the model ({'; '.join(parts)})")


def load_strict(
    module: nn.Module,
    state: Mapping[str, torch.Tensor],
    what: str,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Load ``state`` into ``module`` (which may live on the meta device) with strict key and shape checks.

    Floating tensors are materialised in ``dtype`` on ``device`` (each tensor converted on its own, so a
    memory-mapped file is never fully copied in its stored dtype). Returns the module in eval mode.
    """
    check_keys(module, state, what)
    target = torch.device(device) if device is not None else None
    converted = {}
    for name, tensor in state.items():
        want = dtype if (dtype is not None and tensor.is_floating_point()) else tensor.dtype
        converted[name] = tensor.to(device=target or tensor.device, dtype=want)
    module.load_state_dict(converted, strict=True, assign=True)
    return module.eval()


def load_module(
    module: nn.Module,
    path: str | Path,
    what: str,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> nn.Module:
    """``load_strict`` from a file; the error names the file."""
    try:
        return load_strict(module, load_state_dict_file(path), what, dtype=dtype, device=device)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None


def load_vae(path: str | Path, cfg: VAEConfig | None = None, *, device: torch.device | str = "cpu") -> WanVAE:
    """The Wan2.1 VAE from ``Wan2.1_VAE.pth`` (or a fixture's ``vae.safetensors``), always float32."""
    with torch.device("meta"):
        vae = WanVAE(cfg or VAEConfig.preset("wan2.1"))
    load_module(vae, path, "VAE", dtype=torch.float32, device=device)
    vae.reset_latent_stats()
    _assert_materialised(vae, "VAE")
    return vae


def load_t5(
    path: str | Path,
    cfg: T5Config | None = None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> T5Encoder:
    """The umT5 encoder; ``dtype`` defaults to bfloat16 on GPU and float32 on CPU."""
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device("meta"):
        t5 = T5Encoder(cfg or T5Config.preset("umt5-xxl"))
    load_module(t5, path, "T5", dtype=dtype, device=device)
    _assert_materialised(t5, "T5")
    return t5


def _assert_materialised(module: nn.Module, what: str) -> None:
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t.is_meta:
            raise CheckpointError(f"{what}: {name} was not materialised from the checkpoint")
