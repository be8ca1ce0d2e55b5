"""GPU precision policy: the backend flags a rank sets once at start, never inside model code.

- DiT and umT5 run in bf16 (``model.dtype = auto``); their float32 parts (residual stream, modulation, timestep
  embedding, the output head) stay strict float32: matmul TF32 is left off.
- The VAE (``model.vae_dtype``) is conv-bound: ``tf32`` (default) keeps fp32 weights and lets cuDNN run its convs
  in TF32; ``float32`` is strict; ``bfloat16`` casts the VAE. Measured on an H200 per chunk of 3 latent frames:
  decode 1.44 s strict, 0.29 s TF32 + ``cudnn.benchmark`` (rel. L2 0.002 vs strict), 0.20 s bf16 (rel. L2 0.03).
- ``cudnn.benchmark`` on every CUDA rank: the shapes of a stream repeat chunk after chunk, so the autotuned
  algorithm is chosen once per shape, at start-up: every served frame size is warmed up before the port opens
  (``ranks.warmup``), because autotuning syncs the whole device.

The flags are process-wide, so they are set from the roles a rank holds (``ranks`` calls ``apply`` after picking
the device) and a rank holding both a VAE and the DiT gets TF32 for convolutions only.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

VAE_POLICIES = ("tf32", "float32", "bfloat16")


def _set_conv_tf32(enabled: bool) -> None:
    """cuDNN's float32 precision (its convolutions are the VAE; cuDNN RNNs are unused). The legacy flag sets conv and
    RNN alike; the newer per-operator API is avoided because mixing the two makes later ``allow_tf32`` reads raise."""
    torch.backends.cudnn.allow_tf32 = enabled


def conv_tf32_enabled() -> bool:
    return bool(torch.backends.cudnn.allow_tf32)


def apply(device: torch.device, vae_policy: str, holds_vae: bool) -> dict[str, object]:
    """Set this rank's backend flags; returns what was set (for the log and the benchmark's record)."""
    if vae_policy not in VAE_POLICIES:
        raise ValueError(f"vae precision must be one of {VAE_POLICIES}, got {vae_policy!r}")
    if device.type != "cuda":
        return {"device": device.type}
    torch.backends.cudnn.benchmark = True
    tf32 = holds_vae and vae_policy == "tf32"
    _set_conv_tf32(tf32)
    flags = {"device": "cuda", "cudnn_benchmark": True, "conv_tf32": tf32, "vae": vae_policy if holds_vae else None}
    log.info("precision flags: %s", flags)
    return flags
