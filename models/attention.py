"""Attention kernels: torch SDPA on the fused kernel measured fastest here, SageAttention when it is faster still.

Every call takes and returns ``[heads, N, hd]`` and hands the kernel 4-D ``[1, heads, N, hd]`` tensors: the
fused SDPA kernels (flash, memory-efficient, cuDNN on CUDA; flash on CPU) accept 4-D inputs only, and a 3-D
call silently runs the float32 math path (on an H200 that made a v1 chunk 23 s instead of 2.7 s).
``tests/test_dit_model.py`` runs the DiT with only the fused CPU kernel allowed, so a return to 3-D fails.

``attention = "auto" | "sdpa" | "sage" | "flash" | "cudnn" | "efficient"``:
- ``sdpa``: ``F.scaled_dot_product_attention`` with PyTorch's own kernel order (the conformance path: exact up to
  float order). In torch 2.13 that order is flash, efficient, *math*, cuDNN: cuDNN never runs unless asked for;
- ``flash`` / ``cudnn`` / ``efficient``: SDPA with that kernel first in the process-wide priority order (the other
  fused kernels, then math, stay behind it for a call it cannot take); refused at start if it cannot run here;
- ``sage``: SageAttention (INT8 q/k: fast, not bit-faithful); without CUDA and the package it is an error;
- ``auto``: on CUDA, ``time_attention`` times every fused SDPA kernel (and Sage if it imports) at the DiT's real
  shapes once at start-up, ``choose_attention`` keeps the fastest, and ``pin_sdpa_backend`` puts it first for the
  whole process; on CPU nothing is timed (PyTorch's order). Per call, tensors Sage does not take (float32, head
  dims other than 64/96/128) use SDPA.

The pin is process-wide state (``sdpa_kernel(..., set_priority=True)`` entered once and held), not a context entered
per attention call: a ``torch.compile``d block sees no context manager, and every role thread of a rank (the VAE and
umT5 too) gets the same order. Compile after the pin: the compiled graph keeps the kernel chosen when it was traced.

SageAttention 1.0.6 subtracts the key mean *in place*, and our keys are views of the KV cache or the text
cache, so the sage path hands it a private copy of the keys.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

log = logging.getLogger(__name__)

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
SAGE_HEAD_DIMS = (64, 96, 128)
SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION}  # the fused kernels, by their config names
ATTENTION_KINDS = ("auto", "sdpa", "sage", *SDPA_BACKENDS)


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
    """The attention function for ``kind`` before any measurement: SDPA for every kind but ``sage`` (which SDPA
    kernel runs is the process-wide pin, ``pin_sdpa_backend``)."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {kind!r}")
    if kind != "sage":
        return sdpa
    sage = _load_sage()
    if sage is None:
        raise RuntimeError("attention='sage' needs CUDA and the sageattention package (pip install sageattention)")
    return _sage_attention(sage, strict=True)


# ---------------------------------------------------------------------------------------------- the process pin

_pin = contextlib.ExitStack()  # holds the one sdpa_kernel(..., set_priority=True) of the process while pinned
_pinned = "sdpa"  # "sdpa": PyTorch's own order


def pinned_backend() -> str:
    """The SDPA kernel this process put first (``"sdpa"``: none, PyTorch's own order)."""
    return _pinned


def priority_order(first: SDPBackend) -> list[SDPBackend]:
    """``first``, then the other fused kernels, then math, then anything else torch knows (every one stays enabled:
    a call the first cannot take, e.g. with a mask or an odd head dim, still runs on a fused kernel if one can)."""
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    known = (*fused, SDPBackend.MATH, SDPBackend.ERROR)
    rest = [b for b in SDPBackend.__members__.values() if b not in known]
    return [first, *(b for b in fused if b != first), SDPBackend.MATH, *rest]


def pin_sdpa_backend(name: str) -> None:
    """Put SDPA kernel ``name`` first for the whole process (``"sdpa"``: back to PyTorch's order). Called once at
    start-up, never per attention call; pinning again replaces the pin (a benchmark building several stages)."""
    global _pinned
    if name != "sdpa" and name not in SDPA_BACKENDS:
        raise ValueError(f"an SDPA kernel is 'sdpa' or one of {tuple(SDPA_BACKENDS)}, got {name!r}")
    if name == _pinned:
        return
    _pin.close()  # restores the order in force before the previous pin
    if name != "sdpa":
        _pin.enter_context(sdpa_kernel(priority_order(SDPA_BACKENDS[name]), set_priority=True))
    _pinned = name
    log.info("SDPA kernel order pinned for this process: %s", name if name != "sdpa" else "PyTorch's own")


# ---------------------------------------------------------------------------------------------- measurement


@dataclass(frozen=True)
class AttentionShapes:
    """The attention calls of one steady chunk on one DiT rank."""

    heads: int  # self-attention: this rank's heads (after the Ulysses all-to-all) ...
    tokens: int  # ... over the chunk's tokens (queries) ...
    window: int  # ... against the KV window's tokens
    head_dim: int
    cross_heads: int  # cross-attention: every head over this rank's share of the tokens, against the text rows
    local_tokens: int
    text_len: int

    def flops(self) -> tuple[float, float]:
        """Floating-point operations of one self-attention and one cross-attention call (two matmuls each)."""
        return (4.0 * self.heads * self.tokens * self.window * self.head_dim,
                4.0 * self.cross_heads * self.local_tokens * self.text_len * self.head_dim)


Timing = tuple[float | None, float | None]  # milliseconds per (self-attention, cross-attention) call; None: failed


def _fastest(ms: Mapping[str, float | None]) -> str | None:
    usable = {name: t for name, t in ms.items() if t is not None and math.isfinite(t)}
    return min(usable, key=usable.__getitem__) if usable else None


def choose_attention(table: Mapping[str, Timing]) -> tuple[str, str]:
    """``(self-attention kernel "sdpa" | "sage", SDPA kernel to pin)`` from a timing table (a pure function). The
    pinned SDPA kernel is the fastest over both calls of a block; a kernel that failed either call is skipped, and
    with none left PyTorch's order stays (``"sdpa"``). Sage takes self-attention only: it replaces SDPA there when
    it is faster than the pinned kernel."""
    totals = {name: None if s is None or c is None else s + c
              for name, (s, c) in table.items() if name in SDPA_BACKENDS}
    backend = _fastest(totals) or "sdpa"
    sage_ms = table.get("sage", (None, None))[0]
    sdpa_ms = table[backend][0] if backend in table else None
    faster = sage_ms is not None and math.isfinite(sage_ms) and (sdpa_ms is None or sage_ms < sdpa_ms)
    return ("sage" if faster else "sdpa"), backend


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(call: Callable[[], object], device: torch.device, repeat: int) -> float | None:
    """Milliseconds per call after one warm-up (kernel selection, lazy loading); None if the kernel refused."""
    try:
        call()
        _sync(device)
        began = time.perf_counter()
        for _ in range(repeat):
            call()
        _sync(device)
    except Exception as error:  # "No available kernel", a kernel's own refusal or failure: this one is skipped
        log.info("attention kernel skipped: %s", str(error).splitlines()[0][:200])
        return None
    return (time.perf_counter() - began) / repeat * 1e3


def _inputs(heads: int, q_len: int, kv_len: int, head_dim: int, device: torch.device,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Random q ``[heads, q_len, hd]`` laid out as the DiT's (a transposed ``[q_len, heads, hd]``), k/v as its
    caches lay them out."""
    q = torch.randn(q_len, heads, head_dim, device=device, dtype=dtype).transpose(0, 1)
    k, v = (torch.randn(heads, kv_len, head_dim, device=device, dtype=dtype) for _ in range(2))
    return q, k, v


def time_attention(shapes: AttentionShapes, device: torch.device, dtype: torch.dtype,
                   repeat: int = 5) -> dict[str, Timing]:  # fmt: skip
    """Time every fused SDPA kernel alone (and Sage, if it imports and takes these tensors, on self-attention) at
    ``shapes`` on ``device``: the table ``choose_attention`` reads (None: the kernel refused)."""
    s = shapes
    table = _time_kernels(_inputs(s.heads, s.tokens, s.window, s.head_dim, device, dtype),
                          _inputs(s.cross_heads, s.local_tokens, s.text_len, s.head_dim, device, dtype), device, repeat)
    if device.type == "cuda":  # the probe tensors (about 0.7 GB at single-GPU v1 shapes) go back to the device, so
        torch.cuda.empty_cache()  # free-memory readings taken after start-up do not count them
    return table


def _time_kernels(self_qkv: tuple[torch.Tensor, ...], cross_qkv: tuple[torch.Tensor, ...], device: torch.device,
                  repeat: int) -> dict[str, Timing]:  # fmt: skip
    table: dict[str, Timing] = {}
    for name, backend in SDPA_BACKENDS.items():
        with sdpa_kernel([backend]):
            table[name] = (_timed(lambda: sdpa(*self_qkv), device, repeat),
                           _timed(lambda: sdpa(*cross_qkv), device, repeat))
    sage = _load_sage()
    if sage is not None and sage_supports(self_qkv[0]):
        fn = _sage_attention(sage, strict=True)
        table["sage"] = (_timed(lambda: fn(*self_qkv), device, repeat), None)
    return table


def format_table(table: Mapping[str, Timing], shapes: AttentionShapes) -> str:
    """``kernel: ms (TFLOP/s)`` of each call, for the log."""
    flops = shapes.flops()

    def cell(ms: float | None, f: float) -> str:
        return "refused" if ms is None else f"{ms:.3f} ms ({f / ms / 1e9:.0f} TFLOP/s)"

    return "; ".join(f"{name}: self {cell(s, flops[0])}" + ("" if name == "sage" else f", cross {cell(c, flops[1])}")
                     for name, (s, c) in table.items())


def check_backend(name: str, shapes: AttentionShapes, device: torch.device, dtype: torch.dtype) -> None:
    """An explicitly configured SDPA kernel must take this DiT's tensors (dtype, head dim, device): a short call of
    each shape kind with only that kernel allowed, so a kernel the device lacks fails at start, not mid-stream."""
    with sdpa_kernel([SDPA_BACKENDS[name]]):
        try:
            for heads in (shapes.heads, shapes.cross_heads):
                sdpa(*_inputs(heads, 16, 16, shapes.head_dim, device, dtype))
        except RuntimeError as error:
            raise RuntimeError(f"attention = {name!r} cannot run here ({dtype}, head dim {shapes.head_dim} on "
                               f"{device.type}): {str(error).splitlines()[0][:200]}") from None


def kernel_error(name: str, head_dim: int, device: torch.device, dtype: torch.dtype,
                 run: AttentionFn | None = None) -> float:  # fmt: skip
    """Relative error (max abs difference over max abs) of SDPA kernel ``name`` alone against the float32 math path,
    on a small random input of this DiT's head dim, dtype and layout. ``run``: the kernel's call (a seam)."""
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(4, n, head_dim, device=device, generator=generator).to(dtype) for n in (64, 96, 96))
    q = q.transpose(0, 1).contiguous().transpose(0, 1)  # the DiT's query layout: a transposed [tokens, heads, hd]
    if run is None:
        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            with sdpa_kernel([SDPA_BACKENDS[name]]):
                return sdpa(q, k, v)
    got = run(q, k, v).float()
    with sdpa_kernel([SDPBackend.MATH]):
        want = sdpa(q.float(), k.float(), v.float())
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


def checked_pin(name: str, head_dim: int, device: torch.device, dtype: torch.dtype,
                run: AttentionFn | None = None) -> str:  # fmt: skip
    """``name`` if that SDPA kernel agrees with the math path here (``kernel_error`` within ``PIN_BOUND``), else
    ``"sdpa"`` (PyTorch's order) with a warning: a kernel is pinned on its timing, and a fast kernel that computes
    something else (a driver or build bug) must not serve every session."""
    if name not in SDPA_BACKENDS:
        return name
    bound = PIN_BOUND[dtype] if dtype in PIN_BOUND else PIN_BOUND[torch.float32]
    try:
        error = kernel_error(name, head_dim, device, dtype, run)
    except RuntimeError as failure:
        error, why = math.inf, str(failure).splitlines()[0][:200]
    else:
        why = f"relative error {error:.2e} > {bound:.0e}"
    if error <= bound:
        return name
    log.warning("attention: SDPA kernel %s disagrees with the math path (%s); keeping PyTorch's kernel order", name,
                why)
    return "sdpa"


PIN_BOUND = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}  # a kernel's rounding, far below a bug


def resolve_attention(kind: str, shapes: AttentionShapes, device: torch.device, dtype: torch.dtype,
                      repeat: int = 5) -> tuple[str, str, dict[str, Timing]]:  # fmt: skip
    """``(self-attention kernel, SDPA kernel to pin, timing table)`` for ``kind`` on this device: ``auto`` is timed
    on CUDA only (on CPU: SDPA in PyTorch's order, nothing timed); an explicit SDPA kernel is checked to run."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {kind!r}")
    if kind in SDPA_BACKENDS:
        check_backend(kind, shapes, device, dtype)
        return "sdpa", kind, {}
    if kind != "auto" or device.type != "cuda":
        return kind if kind == "sage" else "sdpa", "sdpa", {}
    table = time_attention(shapes, device, dtype, repeat)
    attend, backend = choose_attention(table)
    backend = checked_pin(backend, shapes.head_dim, device, dtype)  # chosen on timing alone: is it right?
    log.info("attention=auto at [%d heads, %d x %d, hd %d] + cross [%d heads, %d x %d], %s: %s -> %s on SDPA %s",
             shapes.heads, shapes.tokens, shapes.window, shapes.head_dim, shapes.cross_heads, shapes.local_tokens,
             shapes.text_len, dtype, format_table(table, shapes), attend, backend)  # fmt: skip
    return attend, backend, table
