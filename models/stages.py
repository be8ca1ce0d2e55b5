"""The stage interface every backend implements (synthetic and LingBot-World-Fast alike).

A backend is three stages, each owned by one role and holding per-session caches:

- ``ConditionStage`` (condition role): per session it encodes the prompt once and then, chunk by chunk, the
  condition tensor (for LingBot: 4 mask channels + the VAE latent of [image, black frames...]).
- ``DenoiseStage`` (every rank of the DiT group, in lockstep): per session it keeps the KV cache, the noise
  source and the camera integration state; ``denoise`` turns (condition, control) into the chunk's latent.
- ``DecodeStage`` (decode role): per session a causal decoder cache; ``decode`` turns a latent into uint8
  RGB frames ``[n, H, W, 3]`` ready for the wire.

Every tensor that crosses ranks has a shape known in advance from ``StreamGeometry``, so the tensor plane
can post the matching receive before the data moves. Stages never see sockets or ranks; the DiT stage is
handed its sequence-parallel process group at construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from models.controls import ChunkControl


@dataclass(frozen=True)
class StreamGeometry:
    """Shapes and dtypes of everything that travels on the tensor plane for one session."""

    height: int  # video frame height in pixels
    width: int  # video frame width in pixels
    chunk_latent_frames: int  # latent frames per chunk (cs)
    context_shape: tuple[int, ...]  # prompt context handed to the DiT once per session (padded)
    condition_shape: tuple[int, ...]  # one condition chunk
    latent_shape: tuple[int, ...]  # one denoised latent chunk
    dtype: torch.dtype = torch.float32  # dtype of context, condition and latent on the wire
    temporal_stride: int = 4  # video frames per latent frame (the first latent frame gives 1)
    max_chunks: int | None = None  # the model's cap on a session's length (a "full" KV cache); None: unbounded

    def frames_in_chunk(self, index: int) -> int:
        """Video frames decoded from chunk ``index``: the first latent frame of a stream gives 1 frame."""
        cs, stride = self.chunk_latent_frames, self.temporal_stride
        return 1 + stride * (cs - 1) if index == 0 else stride * cs

    def frames_shape(self, index: int) -> tuple[int, int, int, int]:
        return (self.frames_in_chunk(index), self.height, self.width, 3)


@dataclass(frozen=True)
class SessionSpec:
    """What a session is opened with. ``image`` is only present on the condition role."""

    session: str
    seed: int
    prompt: str
    image: torch.Tensor | None = None  # uint8 [H, W, 3], already resized to the stream geometry


class ConditionStage(Protocol):
    def open(self, spec: SessionSpec) -> torch.Tensor:
        """Initialise the session's encoder cache and return the prompt context (``context_shape``)."""

    def encode(self, session: str, index: int) -> torch.Tensor:
        """Condition tensor of chunk ``index`` (``condition_shape``); called with index 0, 1, 2, ... in order."""

    def release(self, session: str) -> None:
        """Free the session's caches; idempotent."""


class DenoiseStage(Protocol):
    def open(self, spec: SessionSpec, context: torch.Tensor) -> None:
        """Initialise KV cache, noise source (seeded by ``spec.seed``) and camera state."""

    def denoise(self, session: str, index: int, condition: torch.Tensor, control: ChunkControl) -> torch.Tensor:
        """Latent of chunk ``index`` (``latent_shape``); chunks arrive in order."""

    def skip(self, session: str, index: int, control: ChunkControl, latent: torch.Tensor | None = None,
             condition: torch.Tensor | None = None) -> None:
        """World-cache hit: advance the noise cursor and camera state exactly as ``denoise`` would; given the
        cached ``latent`` and its ``condition``, also leave the chunk's keys in the cache as ``denoise`` does."""

    def release(self, session: str) -> None:
        """Free the session's caches; idempotent."""


class DecodeStage(Protocol):
    def open(self, session: str) -> None:
        """Initialise the session's decoder cache."""

    def decode(self, session: str, index: int, latent: torch.Tensor) -> torch.Tensor:
        """uint8 frames ``geometry.frames_shape(index)`` of chunk ``index``; chunks arrive in order."""

    def release(self, session: str) -> None:
        """Free the session's caches; idempotent."""


def run_in_process(condition: ConditionStage, denoise: DenoiseStage, decode: DecodeStage, spec: SessionSpec,
                   controls: Sequence[ChunkControl]) -> list[torch.Tensor]:
    """One session through the three stages in one process, chunk after chunk: the reference that a multi-rank
    run of the same stages must reproduce. Returns each chunk's uint8 frames; the caches are released."""
    session = spec.session
    context = condition.open(spec)
    denoise.open(replace(spec, image=None), context)
    decode.open(session)
    try:
        return [decode.decode(session, i, denoise.denoise(session, i, condition.encode(session, i), control))
                for i, control in enumerate(controls)]
    finally:
        decode.release(session)
        denoise.release(session)
        condition.release(session)
