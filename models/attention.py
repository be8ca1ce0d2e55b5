"""Attention kernels: torch SDPA on its fused kernels, SageAttention when it is measured faster.

Every call takes and returns ``[heads, N, hd]`` and hands the kernel 4-D ``[1, heads, N, hd]`` tensors: the
fused SDPA kernels (flash, memory-efficient, cuDNN on CUDA; flash on CPU) accept 4-D inputs only, and a 3-D
call silently runs the float32 math path (on an H200 that made a v1 chunk 23 s instead of 2.7 s).
``tests/test_dit_model.py`` runs the DiT with only the fused CPU kernel allowed, so a return to 3-D fails.

``attention = "auto" | "sdpa" | "sage"``:
- ``sdpa``: ``F.scaled_dot_product_attention`` (the conformance path: exact up to float order);
- ``sage``: SageAttention (INT8 q/k: fast, not bit-faithful); without CUDA and the package it is an error;
- ``auto``: SDPA, unless ``measure_attention`` timed both at the model's real shapes on this device and Sage was
  faster (measured on an H200 at v1 shapes, SDPA was: 2.65 vs 3.15 s per chunk with sageattention 1.0.6).
  Per call, tensors Sage does not take (float32, head dims other than 64/96/128) use SDPA.

SageAttention 1.0.6 subtracts the key mean *in place*, and our keys are views of the KV cache or the text
cache, so the sage path hands it a private copy of the keys.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
SAGE_HEAD_DIMS = (64, 96, 128)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Unmasked softmax attention, scale ``1/sqrt(hd)``: q ``[H, Nq, hd]``, k/v ``[H, Nk, hd]`` -> ``[H, Nq, hd]``."""
    return F.scaled_dot_product_attention(q[None], k[None], v[None])[0]


def _load_sage() -> Callable[..., torch.Tensor] | None:
    if not torch.cuda.is_available():
        return None
    try:
        from sageattention import sageattn  # type: ignore[import-not-found]
    except Exception:  # any import failure means "not usable"
        return None
    return sageattn


def sage_supports(q: torch.Tensor) -> bool:
    """Whether SageAttention's kernels take these tensors (else the call uses SDPA)."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in SAGE_HEAD_DIMS


def _sage_attention(sage: Callable[..., torch.Tensor], strict: bool) -> AttentionFn:
    def sage_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not sage_supports(q):
            if strict:
                raise RuntimeError(f"SageAttention needs CUDA fp16/bf16 tensors with head_dim in {SAGE_HEAD_DIMS}, "
                                   f"got {q.dtype} head_dim {q.shape[-1]} on {q.device}")
            return sdpa(q, k, v)
        # [H, N, hd] -> [1, H, N, hd] ("HND"); clone k: sage mutates it in place.
        return sage(q[None], k[None].clone(), v[None], tensor_layout="HND", is_causal=False)[0]

    return sage_attention


def select_attention(kind: str) -> AttentionFn:
    """The attention function for ``kind`` before any measurement: ``auto`` is SDPA until measured otherwise."""
    if kind not in ("auto", "sdpa", "sage"):
        raise ValueError(f"attention must be 'auto', 'sdpa' or 'sage', got {kind!r}")
    if kind != "sage":
        return sdpa
    sage = _load_sage()
    if sage is None:
        raise RuntimeError("attention='sage' needs CUDA and the sageattention package (pip install sageattention)")
    return _sage_attention(sage, strict=True)


def measure_attention(kind: str, heads: int, q_len: int, kv_len: int, head_dim: int, device: torch.device,
                      dtype: torch.dtype, repeat: int = 5) -> tuple[AttentionFn, dict[str, float]]:  # fmt: skip
    """Resolve ``kind`` for these shapes: for ``auto`` on CUDA with Sage importable, time SDPA and Sage on random
    ``[heads, q_len | kv_len, head_dim]`` tensors (the self-attention of a steady chunk) and keep the faster.
    Returns the function and the milliseconds measured (empty when nothing was timed)."""
    if kind != "auto":
        return select_attention(kind), {}
    sage = _load_sage()
    probe = torch.empty(0, head_dim, device=device, dtype=dtype)
    if sage is None or not sage_supports(probe):
        return sdpa, {}
    candidates = {"sdpa": sdpa, "sage": _sage_attention(sage, strict=False)}
    q = torch.randn(heads, q_len, head_dim, device=device, dtype=dtype)
    k, v = (torch.randn(heads, kv_len, head_dim, device=device, dtype=dtype) for _ in range(2))
    ms: dict[str, float] = {}
    for name, fn in candidates.items():
        fn(q, k, v)  # warm-up: kernel selection, lazy module loading
        torch.cuda.synchronize(device)
        began = time.perf_counter()
        for _ in range(repeat):
            fn(q, k, v)
        torch.cuda.synchronize(device)
        ms[name] = (time.perf_counter() - began) / repeat * 1e3
    chosen = min(ms, key=ms.__getitem__)
    log.info("attention=auto: %s at [%d heads, %d x %d, hd %d] (sdpa %.2f ms, sage %.2f ms)", chosen, heads, q_len,
             kv_len, head_dim, ms["sdpa"], ms["sage"])  # fmt: skip
    return candidates[chosen], ms
