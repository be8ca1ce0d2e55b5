"""The stage interface every backend implements (synthetic and LingBot-World-Fast alike).

A backend is three stages, each owned by one role and holding per-session caches:

- ``ConditionStage`` (condition role): per session it encodes the prompt once and then, chunk by chunk, the
  condition tensor (for LingBot: 4 mask channels + the VAE latent of [image, black frames...]).
- ``DenoiseStage`` (every rank of the DiT group, in lockstep): per session it keeps the KV cache, the noise
  source and the camera integration state; ``denoise`` turns (condition, control) into the chunk's latent.
- ``DecodeStage`` (decode role): per session a causal decoder cache; ``decode`` turns a latent into uint8
  RGB frames ``[n, H, W, 3]`` ready for the wire.

Every tensor that crosses ranks has a shape known in advance from the session's ``StreamGeometry`` (the
backend's geometry at the session's frame size), so the coordinator announces it and the tensor plane posts the
matching receive before the data moves. Stages never see sockets or ranks; the DiT stage is handed its
sequence-parallel process group at construction.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final, Protocol

import torch

from ipc.protocol import Stage
from models.controls import ChunkControl
from models.geometry import StreamGeometry, frame_size  # noqa: F401  # torch-free (rank 0 plans with them), re-exported


@dataclass(frozen=True)
class SessionSpec:
    """What a session is opened with. ``image`` is only present on the condition role."""

    session: str
    seed: int
    prompt: str
    image: torch.Tensor | None = None  # uint8 [H0, W0, 3] at the start image's own size; the stage resizes it
    height: int = 0  # the session's frame size (0: the stage's configured geometry)
    width: int = 0
    intrinsics: tuple[float, float, float, float] | None = None  # camera at 480x832 (None: the stage's default)


class SessionInputError(RuntimeError):
    """A session's own inputs for one chunk could not be prepared on some rank of the DiT group (a control the
    camera math cannot take, say), found before the group entered any collective: every rank raises it alike, so
    the group stays in step and only that session fails (a failure inside a collective still ends the job)."""


def agree_prepared(group: Any, device: torch.device | str, error: BaseException | None) -> None:
    """Each rank of ``group`` prepared a chunk's per-session inputs (``error``: what went wrong on this rank, or
    None). One small collective tells every rank whether all succeeded; when one did not, every rank raises the same
    ``SessionInputError`` naming the first rank that failed and its error. ``group`` None: this rank alone, which
    raises ``error`` itself (nothing to agree on; a lone rank fails only the session whatever it raises)."""
    if group is None:
        if error is not None:
            raise error
        return
    import torch.distributed as dist

    size, me = dist.get_world_size(group), dist.get_rank(group)
    first = torch.tensor([size if error is None else me], dtype=torch.int64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)  # the lowest failing rank, or size when none failed
    failed = int(first.item())
    if failed == size:
        return
    why = [None if error is None else f"{type(error).__name__}: {error}"]
    src = dist.get_global_rank(group, failed)
    dist.broadcast_object_list(why, src=src, group=group, device=torch.device(device))
    raise SessionInputError(f"rank {src} could not prepare the chunk: {why[0]}") from error


class ConditionStage(Protocol):
    def open(self, spec: SessionSpec) -> torch.Tensor:
        """Initialise the session's encoder cache and return the prompt context (``context_shape``)."""

    def context(self, prompt: str) -> torch.Tensor:
        """The prompt context (``context_shape``) of a new prompt mid-session (``set_prompt``)."""

    def encode(self, session: str, index: int) -> torch.Tensor:
        """Condition tensor of chunk ``index`` (``condition_shape``); called with index 0, 1, 2, ... in order."""

    def state_dict(self, session: str) -> dict[str, torch.Tensor]:
        """A snapshot of the session (``runtime.snapshots``): every tensor its next ``encode`` and its prompt context
        depend on, as it is after the last ``encode`` (the caller copies it before the stage runs on)."""

    def load_state(self, spec: SessionSpec, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Open ``spec.session`` (no image) from ``state_dict``'s output; returns the prompt context."""

    def release(self, session: str) -> None:
        """Free the session's caches; idempotent."""


class DenoiseStage(Protocol):
    def open(self, spec: SessionSpec, context: torch.Tensor) -> None:
        """Initialise KV cache, noise source (seeded by ``spec.seed``) and camera state."""

    def set_context(self, session: str, context: torch.Tensor) -> None:
        """The session's chunks from the next one on attend to ``context`` (a new prompt); the KV cache, noise and
        camera go on unchanged. Called between chunks, alike on every rank of the group."""

    def denoise(self, session: str, index: int, condition: torch.Tensor, control: ChunkControl,
                steps: int | None = None) -> torch.Tensor:  # fmt: skip
        """Latent of chunk ``index`` (``latent_shape``); chunks arrive in order. ``steps``: the denoising steps the
        chunk runs (4, 2 or 1, ``models.schedule.QUALITY_STEPS``; None: the preset's all)."""

    def state_dict(self, session: str) -> dict[str, torch.Tensor]:
        """This rank's part of the session after its last ``denoise``: KV ring (positions, sink, write index), noise
        generator, camera state; tensors only."""

    def load_state(self, spec: SessionSpec, context: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Open ``spec.session`` from this rank's ``state_dict`` output; its next chunk is the saved one."""

    def release(self, session: str) -> None:
        """Free the session's caches; idempotent."""


class DecodeStage(Protocol):
    def open(self, spec: SessionSpec) -> None:
        """Initialise the session's decoder cache (``spec.image`` is None)."""

    def decode(self, session: str, index: int, latent: torch.Tensor) -> torch.Tensor:
        """uint8 frames ``frames_shape(index)`` of the session's geometry; chunks arrive in order."""

    def state_dict(self, session: str) -> dict[str, torch.Tensor]:
        """The decoder cache as it is after the last ``decode``."""

    def load_state(self, spec: SessionSpec, state: dict[str, torch.Tensor]) -> None:
        """Open ``spec.session`` from ``state_dict``'s output."""

    def release(self, session: str) -> None:
        """Free the session's caches; idempotent."""


def run_in_process(condition: ConditionStage, denoise: DenoiseStage, decode: DecodeStage, spec: SessionSpec,
                   controls: Sequence[ChunkControl]) -> list[torch.Tensor]:
    """One session through the three stages in one process, chunk after chunk: the reference that a multi-rank
    run of the same stages must reproduce. Returns each chunk's uint8 frames; the caches are released."""
    session = spec.session
    context = condition.open(spec)
    denoise.open(replace(spec, image=None), context)
    decode.open(replace(spec, image=None))
    try:
        return [decode.decode(session, i, denoise.denoise(session, i, condition.encode(session, i), control))
                for i, control in enumerate(controls)]
    finally:
        decode.release(session)
        denoise.release(session)
        condition.release(session)


# ---------------------------------------------------------------------------------------------------------------
# warm-up: a throwaway session through each stage (``ranks.warmup``), the stage's own calls with zeros for what
# other ranks would send

GRAY = 128


def warm_up_session(height: int, width: int) -> str:
    return f"warmup:{height}x{width}"  # never a real id (those are 12 hex digits)


def _zeros(shape: tuple[int, ...], geometry: StreamGeometry, device: torch.device) -> torch.Tensor:
    """A tensor as it travels on the tensor plane (the geometry names its dtype)."""
    return torch.zeros(shape, dtype=getattr(torch, geometry.dtype), device=device)


def _warm_condition(stage: ConditionStage, geometry: StreamGeometry, _device: torch.device, chunks: int,
                    _dit_group: Any | None) -> None:  # fmt: skip
    image = torch.full((geometry.height, geometry.width, 3), GRAY, dtype=torch.uint8)
    spec = SessionSpec(warm_up_session(geometry.height, geometry.width), 0, "", image, geometry.height, geometry.width)
    _throwaway(stage, spec, chunks, stage.encode)


def _throwaway(stage: ConditionStage | DecodeStage, spec: SessionSpec, chunks: int,
               run: Callable[[str, int], object]) -> None:  # fmt: skip
    """Open ``spec`` on ``stage``, run ``chunks`` of it, release it (also when a chunk failed)."""
    try:
        stage.open(spec)
        for index in range(chunks):
            run(spec.session, index)
    finally:
        stage.release(spec.session)


def _warm_denoise(stage: DenoiseStage, geometry: StreamGeometry, device: torch.device, chunks: int,
                  dit_group: Any | None) -> None:  # fmt: skip
    sid = warm_up_session(geometry.height, geometry.width)
    try:
        error: torch.OutOfMemoryError | None = None
        try:
            context = _zeros(geometry.context_shape, geometry, device)
            stage.open(SessionSpec(sid, 0, "", height=geometry.height, width=geometry.width), context)
        except torch.OutOfMemoryError as e:  # the KV ring, a session's largest allocation
            error = e
        agree_prepared(dit_group, device, error)  # every DiT rank opened it, or all fail this size alike
        for index in range(chunks):
            condition = _zeros(geometry.condition_shape, geometry, device)
            stage.denoise(sid, index, condition, ChunkControl())
    finally:
        stage.release(sid)


def _warm_decode(stage: DecodeStage, geometry: StreamGeometry, device: torch.device, chunks: int,
                 _dit_group: Any | None) -> None:  # fmt: skip
    spec = SessionSpec(warm_up_session(geometry.height, geometry.width), 0, "", height=geometry.height,
                       width=geometry.width)
    _throwaway(stage, spec, chunks, lambda sid, index: stage.decode(sid, index, _zeros(geometry.latent_shape,
                                                                                         geometry, device)))


# each stage's warm-up run: ``(the stage, geometry, device, chunks, the DiT group)``
WarmUpRun = Callable[[Any, StreamGeometry, torch.device, int, Any], None]
WARM_UPS: Final[Mapping[Stage, WarmUpRun]] = {Stage.CONDITION: _warm_condition, Stage.DENOISE: _warm_denoise,
                                              Stage.DECODE: _warm_decode}
assert set(WARM_UPS) == set(Stage), "every stage warms up"
