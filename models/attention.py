"""Attention kernel selection: torch SDPA by default, SageAttention on CUDA when it imports.

``attention = "auto" | "sdpa" | "sage"``: "sage" without a usable SageAttention is an error; "auto" uses it
when CUDA is present and it imports, otherwise falls back to SDPA and logs the fallback once.

SageAttention 1.0.6 subtracts the key mean *in place*. The keys we attend over are views of the KV cache
(or the text cache), so the sage path always hands it a private copy of the keys.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
_fallback_logged = False


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Unmasked softmax attention, scale ``1/sqrt(hd)``: q ``[H, Nq, hd]``, k/v ``[H, Nk, hd]`` -> ``[H, Nq, hd]``."""
    return F.scaled_dot_product_attention(q, k, v)


def _load_sage() -> Callable[..., torch.Tensor] | None:
    if not torch.cuda.is_available():
        return None
    try:
        from sageattention import sageattn  # type: ignore[import-not-found]
    except Exception:  # any import failure means "not usable"
        return None
    return sageattn


def select_attention(kind: str) -> AttentionFn:
    """The attention function for ``kind``; see the module docstring for the rules."""
    global _fallback_logged
    if kind not in ("auto", "sdpa", "sage"):
        raise ValueError(f"attention must be 'auto', 'sdpa' or 'sage', got {kind!r}")
    if kind == "sdpa":
        return sdpa
    sage = _load_sage()
    if sage is None:
        if kind == "sage":
            raise RuntimeError("attention='sage' needs CUDA and the sageattention package (pip install sageattention)")
        if not _fallback_logged:
            log.info("attention=auto: SageAttention unavailable (no CUDA or not installed), using torch SDPA")
            _fallback_logged = True
        return sdpa

    def sage_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # [H, N, hd] -> [1, H, N, hd] ("HND"); clone k: sage mutates it in place.
        out = sage(q[None], k[None].clone(), v[None], tensor_layout="HND", is_causal=False)
        return out[0]

    return sage_attention
