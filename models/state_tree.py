"""A session state that is a small tree (dicts, lists, VAE ``TemporalCache``s, ints, bools, None, tensors) as flat
named tensors, and back: what a safetensors file can hold, with no pickle.

Each tensor keeps its name (``prefix.key.0``...); every other node leaves a marker tensor named ``<path>@<kind>``
(``dict``, ``list`` and ``cache`` carry their length, ``int`` and ``bool`` their value, ``none`` nothing).
"""

from __future__ import annotations

from typing import Any

import torch

from models.vae import TemporalCache

_EMPTY = torch.zeros(0, dtype=torch.int64)


def flatten(tree: Any, prefix: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, torch.Tensor):
            out[path] = node
        elif node is None:
            out[f"{path}@none"] = _EMPTY
        elif isinstance(node, bool):
            out[f"{path}@bool"] = torch.tensor([int(node)], dtype=torch.int64)
        elif isinstance(node, int):
            out[f"{path}@int"] = torch.tensor([node], dtype=torch.int64)
        elif isinstance(node, TemporalCache | list | tuple):
            items = node.slots if isinstance(node, TemporalCache) else node
            kind = "cache" if isinstance(node, TemporalCache) else "list"
            out[f"{path}@{kind}"] = torch.tensor([len(items)], dtype=torch.int64)
            for i, item in enumerate(items):
                walk(item, f"{path}.{i}")
        elif isinstance(node, dict):
            out[f"{path}@dict"] = _EMPTY
            for key, item in node.items():
                if not isinstance(key, str) or not key or "." in key or "@" in key:
                    raise TypeError(f"state key {key!r} at {path} cannot be a tensor name")
                walk(item, f"{path}.{key}")
        else:
            raise TypeError(f"state at {path} is a {type(node).__name__}, which a snapshot does not hold")

    walk(tree, prefix)
    return out


def unflatten(tensors: dict[str, torch.Tensor], prefix: str) -> Any:
    """The tree ``flatten(tree, prefix)`` made; ``ValueError`` names the first missing part."""

    def build(path: str) -> Any:
        if path in tensors:
            return tensors[path]
        if f"{path}@none" in tensors:
            return None
        for kind in ("bool", "int", "list", "cache"):
            marker = tensors.get(f"{path}@{kind}")
            if marker is None:
                continue
            value = int(marker.reshape(-1)[0])
            if kind == "bool":
                return bool(value)
            if kind == "int":
                return value
            items = [build(f"{path}.{i}") for i in range(value)]
            return TemporalCache(slots=items) if kind == "cache" else items
        if f"{path}@dict" in tensors:
            head = f"{path}."
            keys = dict.fromkeys(name[len(head):].split(".")[0].split("@")[0] for name in tensors
                                 if name.startswith(head))  # fmt: skip
            return {key: build(f"{head}{key}") for key in keys}
        raise ValueError(f"the snapshot's state has no {path}")

    return build(prefix)


def to_device(tree: Any, device: torch.device | str) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, TemporalCache):
        return TemporalCache(slots=[to_device(s, device) for s in tree.slots])
    if isinstance(tree, list):
        return [to_device(s, device) for s in tree]
    if isinstance(tree, dict):
        return {k: to_device(v, device) for k, v in tree.items()}
    return tree
