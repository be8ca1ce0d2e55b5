"""Attention kernel selection: torch SDPA by default, SageAttention on CUDA when it imports.

``attention = "auto" | "sdpa" | "sage"``: "sage" without a usable SageAttention is an error; "auto" uses it
when CUDA is present and it imports, otherwise falls back to SDPA and logs the fallback once. Per call, "auto"
also uses SDPA for tensors Sage's kernels do not take (float32, head dims other than 64/96/128), so tiny
presets and float32 conformance runs stay exact. Sage quantises q and k to INT8: it is fast, not bit-faithful;
use "sdpa" for conformance.

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
        if not sage_supports(q):
            if kind == "sage":
                raise RuntimeError(f"SageAttention needs CUDA fp16/bf16 tensors with head_dim in {SAGE_HEAD_DIMS}, "
                                   f"got {q.dtype} head_dim {q.shape[-1]} on {q.device}")
            return sdpa(q, k, v)  # auto: tiny presets, float32 runs
        # [H, N, hd] -> [1, H, N, hd] ("HND"); clone k: sage mutates it in place.
        out = sage(q[None], k[None].clone(), v[None], tensor_layout="HND", is_causal=False)
        return out[0]

    return sage_attention


SAGE_HEAD_DIMS = (64, 96, 128)


def sage_supports(q: torch.Tensor) -> bool:
    """Whether SageAttention's kernels take these tensors (else "auto" uses SDPA for the call)."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in SAGE_HEAD_DIMS
