"""Seeded random weights drawn where the model lives (tests, demos, GPU benchmarks of full-size models).

A module is built on the ``meta`` device, materialised on its device in its dtype, and every parameter is drawn
from one generator on that device: weights ``N(0, 1/fan_in)``, norm gains 1, biases and embeddings small. A
14B-parameter model is therefore never built on the host, and every rank of one device kind that draws with the
same seed gets the same numbers (the condition and decode ranks share one VAE this way).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn


def is_norm_gain(name: str, p: torch.Tensor) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return leaf == "gamma" or (leaf == "weight" and p.dim() == 1 and "norm" in name)


def random_module(build: Callable[[], nn.Module], device: torch.device | str, dtype: torch.dtype, seed: int,
                  std_of: Callable[[str, torch.Tensor], float | None] | None = None) -> nn.Module:  # fmt: skip
    """``build()`` on meta, materialised on ``device`` in ``dtype`` with seeded draws; ``std_of`` may override the
    standard deviation of a parameter (``None``: the default rule)."""
    with torch.device("meta"):
        module = build()
    module.to(dtype).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if is_norm_gain(name, p):
                p.fill_(1.0)
                continue
            std = std_of(name, p) if std_of is not None else None
            if std is None:
                std = 1.0 / math.sqrt(math.prod(p.shape[1:])) if p.dim() >= 2 else 0.02
            p.copy_(torch.randn(p.shape, generator=generator, device=p.device, dtype=torch.float32) * std)
    return module.eval()
