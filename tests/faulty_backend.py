"""A backend for the failure tests: the synthetic stages, failing where a session's prompt says.

A prompt holding ``FAIL:<stage>:<chunk>`` (stage: ``condition``, ``denoise`` or ``decode``) makes that stage fail
on that chunk of that session. The decode rank never sees a prompt, so a decode failure travels down the pipeline:
the DiT hands it a latent of NaNs, which the synthetic decoder refuses. ``FAIL:prepare:<chunk>`` makes the second
rank of the DiT group alone fail while it prepares that chunk's inputs (before the group's collective), as a
control the camera math cannot take would; ``OOM:prepare:<chunk>`` makes that rank raise a real
``torch.OutOfMemoryError`` there, as the DiT's headroom check does on a GPU short of memory, and ``OOM:open`` makes
it raise one while it opens the session's caches (its KV ring, the largest allocation of a session).
``HANG:denoise:<chunk>`` makes every DiT rank sleep through that chunk's
denoise (their heartbeats go on), as a stuck kernel would. Selected by the tests with
``--model.kind=tests.faulty_backend:build``; ``build_never_ready`` is a backend whose decode rank never finishes
loading; ``build_slow`` one whose last DiT rank takes ``FAULTY_SLOW_BUILD_S`` (environment) more to build;
``build_small_card`` one whose decode stage (or second DiT rank, ``FAULTY_OOM_STAGE=denoise``) runs out of memory (a
real ``torch.OutOfMemoryError``) whenever it opens a session at the frame size ``FAULTY_OOM_SIZE`` (``HxW``), its
warm-up's included. No production config can reach
any of them.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from ipc.protocol import Stage
from models.stages import SessionSpec
from models.synthetic import SyntheticCondition, SyntheticDecode, SyntheticDenoise
from ranks.backend import Backend, build_synthetic
from runtime.config import ControlsConfig, ModelConfig, StreamConfig, SyntheticConfig

MARKER = "FAIL"
HANG_S = 3600.0  # "forever": the job's deadlines end it long before


class InjectedFailure(RuntimeError):
    """A failure asked for by the session's prompt."""


def failure_chunk(prompt: str, stage: str, marker: str = MARKER) -> int | None:
    """The chunk at which ``stage`` must fail (or hang, with marker ``HANG``) for this prompt, or None."""
    tag = f"{marker}:{stage}:"
    at = prompt.find(tag)
    if at < 0:
        return None
    rest = prompt[at + len(tag):].split()
    return int(rest[0]) if rest and rest[0].isdigit() else None


class FaultyCondition(SyntheticCondition):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._fail_at: dict[str, int | None] = {}

    def open(self, spec: SessionSpec) -> torch.Tensor:
        self._fail_at[spec.session] = failure_chunk(spec.prompt, "condition")
        return super().open(spec)

    def encode(self, session: str, index: int) -> torch.Tensor:
        if self._fail_at.get(session) == index:
            raise InjectedFailure(f"injected condition failure at chunk {index}")
        return super().encode(session, index)


class FaultyDenoise(SyntheticDenoise):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._fail_at: dict[str, tuple[int | None, int | None]] = {}  # session -> (denoise, decode) chunks
        self._prepare_fails: dict[str, int | None] = {}
        self._oom_at: dict[str, int | None] = {}
        self._hang_at: dict[str, int | None] = {}
        self._group_rank = 0 if self.group is None else dist.get_rank(self.group)

    def open(self, spec: SessionSpec, context: torch.Tensor) -> None:
        self._fail_at[spec.session] = (failure_chunk(spec.prompt, "denoise"), failure_chunk(spec.prompt, "decode"))
        self._prepare_fails[spec.session] = failure_chunk(spec.prompt, "prepare")
        self._oom_at[spec.session] = failure_chunk(spec.prompt, "prepare", "OOM")
        self._hang_at[spec.session] = failure_chunk(spec.prompt, "denoise", "HANG")
        if "OOM:open" in spec.prompt and self._group_rank == 1:
            raise torch.OutOfMemoryError("injected: CUDA out of memory allocating the KV ring on one DiT rank")
        super().open(spec, context)

    def _render(self, session: str, index: int, condition: torch.Tensor, control: Any) -> torch.Tensor:
        if self._prepare_fails.get(session) == index and self._group_rank == 1:
            raise InjectedFailure(f"injected failure preparing chunk {index} on one DiT rank")
        if self._oom_at.get(session) == index and self._group_rank == 1:
            raise torch.OutOfMemoryError(f"injected: CUDA out of memory preparing chunk {index} on one DiT rank")
        return super()._render(session, index, condition, control)

    def denoise(self, session: str, index: int, condition: torch.Tensor, control: Any,
                steps: int | None = None) -> torch.Tensor:  # fmt: skip
        denoise_at, decode_at = self._fail_at.get(session, (None, None))
        if denoise_at == index:  # every DiT rank knows the prompt: they all fail here, before the group's collective
            raise InjectedFailure(f"injected denoise failure at chunk {index}")
        if self._hang_at.get(session) == index:
            time.sleep(HANG_S)
        latent = super().denoise(session, index, condition, control, steps)
        return latent.fill_(float("nan")) if decode_at == index else latent


def build(model: ModelConfig, stream: StreamConfig, costs: SyntheticConfig, controls: ControlsConfig, roles: list[str],
          device: torch.device, dit_group: Any | None) -> Backend:
    backend = build_synthetic(model, stream, costs, controls, roles, device, dit_group)
    if backend.condition is not None:
        backend[Stage.CONDITION] = FaultyCondition(backend.geometry, costs.encode_s)
    if backend.denoise is not None:
        backend[Stage.DENOISE] = FaultyDenoise(backend.geometry, costs.denoise_s, dit_group)
    return backend


def build_never_ready(model: ModelConfig, stream: StreamConfig, costs: SyntheticConfig, controls: ControlsConfig,
                      roles: list[str], device: torch.device, dit_group: Any | None) -> Backend:
    """The decode rank never finishes building (a stuck weight load); every other rank builds as usual."""
    if "decode" in roles:
        time.sleep(HANG_S)
    return build(model, stream, costs, controls, roles, device, dit_group)


def build_slow(model: ModelConfig, stream: StreamConfig, costs: SyntheticConfig, controls: ControlsConfig,
               roles: list[str], device: torch.device, dit_group: Any | None) -> Backend:
    """The last DiT rank builds ``FAULTY_SLOW_BUILD_S`` seconds late (a weight load slower than the others')."""
    if dit_group is not None and dist.get_rank(dit_group) == dist.get_world_size(dit_group) - 1:
        time.sleep(float(os.environ["FAULTY_SLOW_BUILD_S"]))
    return build(model, stream, costs, controls, roles, device, dit_group)


def too_big() -> tuple[int, int]:
    height, width = os.environ["FAULTY_OOM_SIZE"].split("x")
    return int(height), int(width)


class SmallCardDecode(SyntheticDecode):
    """Out of memory opening a session at one frame size, as a card too small for that size would be."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.too_big = too_big()

    def open(self, spec: SessionSpec) -> None:
        if (spec.height, spec.width) == self.too_big:
            raise torch.OutOfMemoryError(f"injected: CUDA out of memory opening the decode caches at "
                                         f"{spec.height}x{spec.width}")
        super().open(spec)


class SmallCardDenoise(FaultyDenoise):
    """The second DiT rank alone runs out of memory opening a session (its KV ring) at one frame size."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.too_big = too_big()

    def open(self, spec: SessionSpec, context: torch.Tensor) -> None:
        if (spec.height, spec.width) == self.too_big and self._group_rank == 1:
            raise torch.OutOfMemoryError(f"injected: CUDA out of memory allocating the KV ring at "
                                         f"{spec.height}x{spec.width}")
        super().open(spec, context)


def build_small_card(model: ModelConfig, stream: StreamConfig, costs: SyntheticConfig, controls: ControlsConfig,
                     roles: list[str], device: torch.device, dit_group: Any | None) -> Backend:
    """``FAULTY_OOM_STAGE`` (``decode`` or ``denoise``) runs out of memory at ``FAULTY_OOM_SIZE``."""
    backend = build(model, stream, costs, controls, roles, device, dit_group)
    stage = os.environ.get("FAULTY_OOM_STAGE", "decode")
    if backend.decode is not None and stage == "decode":
        backend[Stage.DECODE] = SmallCardDecode(backend.geometry, costs.decode_s, costs.cold_s)
    if backend.denoise is not None and stage == "denoise":
        backend[Stage.DENOISE] = SmallCardDenoise(backend.geometry, costs.denoise_s, dit_group)
    return backend
