"""Checkpoint layout and strict weight loading: the one place that knows file names.

The released downloads, and where this runtime looks (``resolve_checkpoint_dir``):

- **v1** (LingBot-World-Fast): the fast DiT is the folder ``lingbot_world_fast/`` of the base-cam download, next
  to ``high_noise_model/`` and ``low_noise_model/`` (the base model's experts); the VAE, umT5 and tokenizer come
  from the base-cam (or Wan2.2-I2V-A14B) download: ``Wan2.1_VAE.pth``, ``models_t5_umt5-xxl-enc-bf16.pth``,
  ``google/umt5-xxl/`` (``tokenizer.json``, ``spiece.model``).
- **v2**: the DiT is ``transformers/`` (8 shards) of the v2 download; VAE, umT5 and tokenizer as for v1.

``model.checkpoint_dir`` is the download root. The DiT folder is ``model.dit_subdir`` if set, else the one folder
(the root or a direct subfolder) holding ``*.safetensors``, preferring ``lingbot_world_fast/`` then
``transformers/`` when there are several. The VAE, umT5 and tokenizer are looked up in ``checkpoint_dir`` first,
then in ``model.components_dir`` (for a DiT download that does not carry them); absolute names are taken as given.
Errors name every file looked for and every place looked in.

``.pth`` files are opened with ``torch.load(weights_only=True, mmap=True)`` (no pickle code execution, no full
read into RAM) and materialised in the dtype and on the device the module needs; their sizes are read from the
tensors (``VAEConfig.from_state_dict``, ``T5Config.from_state_dict``). Loading is strict: any missing, unexpected
or mis-shaped key raises ``CheckpointError`` naming them.
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
PREFERRED_DIT_FOLDERS = ("lingbot_world_fast", "transformers")  # v1 inside base-cam, v2


class CheckpointError(RuntimeError):
    """A checkpoint directory or file does not match what the model expects."""


@dataclass(frozen=True)
class CheckpointNames:
    """Where the components are (config section ``model``); defaults are the official names."""

    dit_subdir: str | None = None  # None: found automatically (see the module docstring)
    vae_file: str = "Wan2.1_VAE.pth"
    t5_file: str = "models_t5_umt5-xxl-enc-bf16.pth"
    tokenizer_dir: str = "google/umt5-xxl"  # tokenizer.json (preferred) or spiece.model
    components_dir: str | None = None  # second place for VAE, umT5 and tokenizer


@dataclass(frozen=True)
class CheckpointPaths:
    """Resolved, existing paths of every component."""

    root: Path
    dit_dir: Path  # holds the (sharded) safetensors and, usually, config.json
    vae_file: Path
    t5_file: Path
    tokenizer_dir: Path


def resolve_checkpoint_dir(root: str | Path, names: CheckpointNames | None = None) -> CheckpointPaths:
    """Locate every component; raise ``CheckpointError`` listing what is missing, where it looked, what exists."""
    names = names or CheckpointNames()
    root = Path(root).expanduser().resolve()
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    places = [root] + ([Path(names.components_dir).expanduser().resolve()] if names.components_dir else [])
    problems: list[str] = []
    vae = _find(names.vae_file, places, Path.is_file, "VAE weights", problems)
    t5 = _find(names.t5_file, places, Path.is_file, "umT5 weights", problems)
    tok = _find(names.tokenizer_dir, places, Path.is_dir, "tokenizer folder", problems)
    dit = _find_dit_dir(root, names.dit_subdir, problems)
    if problems:
        listing = ", ".join(sorted(p.name + ("/" if p.is_dir() else "") for p in root.iterdir())) or "(empty)"
        raise CheckpointError(f"checkpoint directory {root}: " + "; ".join(problems) + f". Contents: {listing}")
    assert dit is not None and vae is not None and t5 is not None and tok is not None
    return CheckpointPaths(root=root, dit_dir=dit, vae_file=vae, t5_file=t5, tokenizer_dir=tok)


def _find(name: str, places: list[Path], exists: object, what: str, problems: list[str]) -> Path | None:
    candidates = [Path(name).expanduser()] if Path(name).expanduser().is_absolute() else [p / name for p in places]
    for path in candidates:
        if exists(path):  # type: ignore[operator]
            return path
    where = " or ".join(str(p) for p in candidates)
    hint = "" if len(places) > 1 else " (set model.components_dir to the folder that holds it)"
    problems.append(f"{what} not found at {where}{hint}")
    return None


def _is_dit_dir(path: Path) -> bool:
    return any(path.glob("*" + SAFETENSORS_SUFFIX))


def _find_dit_dir(root: Path, subdir: str | None, problems: list[str]) -> Path | None:
    if subdir:
        path = root / subdir
        if not _is_dit_dir(path):
            problems.append(f"DiT folder {path} (model.dit_subdir) has no *.safetensors")
            return None
        return path
    candidates = [p for p in [root, *sorted(d for d in root.iterdir() if d.is_dir())] if _is_dit_dir(p)]
    preferred = [root / name for name in PREFERRED_DIT_FOLDERS if root / name in candidates]
    if preferred:
        return preferred[0]
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        problems.append("no DiT folder (*.safetensors) in the root or a direct subfolder")
    else:
        found = [str(c.relative_to(root)) or "." for c in candidates]
        problems.append(f"several DiT folders {found} and none of {list(PREFERRED_DIT_FOLDERS)}; set "
                        "model.dit_subdir to choose one")
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


def _state_or_error(path: str | Path) -> dict[str, torch.Tensor]:
    try:
        return load_state_dict_file(path)
    except CheckpointError:
        raise
    except Exception as e:  # a corrupt or foreign file: say which
        raise CheckpointError(f"{path}: cannot be read as a state dict ({type(e).__name__}: {e})") from None


def _config_or_error(infer: object, state: dict[str, torch.Tensor], path: str | Path) -> object:
    try:
        return infer(state)  # type: ignore[operator]
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


def _load_named(module: nn.Module, state: Mapping[str, torch.Tensor], path: str | Path, what: str, *,
                dtype: torch.dtype | None, device: torch.device | str | None) -> nn.Module:  # fmt: skip
    """``load_strict`` whose error names the file."""
    try:
        return load_strict(module, state, what, dtype=dtype, device=device)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None


def load_vae(path: str | Path, cfg: VAEConfig | None = None, *, device: torch.device | str = "cpu",
             dtype: torch.dtype = torch.float32) -> WanVAE:  # fmt: skip
    """The Wan2.1 VAE from ``Wan2.1_VAE.pth`` (or a fixture's ``vae.safetensors``); sizes from the file unless
    ``cfg`` is given. float32 unless the precision policy asks for bf16."""
    state = _state_or_error(path)
    if cfg is None:
        cfg = _config_or_error(VAEConfig.from_state_dict, state, path)
    with torch.device("meta"):
        vae = WanVAE(cfg)
    _load_named(vae, state, path, "VAE", dtype=dtype, device=device)
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
    """The umT5 encoder (sizes from the file unless ``cfg`` is given); ``dtype`` defaults to bfloat16 on GPU and
    float32 on CPU."""
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    state = _state_or_error(path)
    if cfg is None:
        cfg = _config_or_error(T5Config.from_state_dict, state, path)
    with torch.device("meta"):
        t5 = T5Encoder(cfg)
    _load_named(t5, state, path, "T5", dtype=dtype, device=device)
    _assert_materialised(t5, "T5")
    return t5


def _assert_materialised(module: nn.Module, what: str) -> None:
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t.is_meta:
            raise CheckpointError(f"{what}: {name} was not materialised from the checkpoint")
