"""Warm start: before any thread of a rank starts (so before the rank reports in, and before the port opens), each
stage of the rank runs a throwaway session at every frame size the server serves (``runtime.sizes.served_sizes``).

Why: a shape's first use on a GPU costs, with device-wide syncs. cuDNN autotunes every new convolution shape of the
VAEs (first decodes at a new size measured at 4.9 s and 2.2 s against 0.29 s steady on an H200); mid-serving that
stalls every stream of the GPU, or waits behind an NCCL receive spinning on it. (Module loads are done before: the
launcher sets ``CUDA_MODULE_LOADING=EAGER``.)

The session: ``WARMUP_CHUNKS`` chunks through the real stage code (chunk 0 runs the first latent frame's path,
chunk 1 the path with the causal caches filled: the tiny VAE meets new convolution shapes in both and none after,
``tests/test_warm_start.py``), seed 0, an empty prompt, a mid-gray start image on the condition rank and zeros for
what other ranks would send (context, condition, latent), on the stream the stage's thread will use. Every DiT rank
runs the same sizes in the same order, so the group's collectives pair up; denoise goes first on every rank (a stage
co-located with it would otherwise keep the other DiT ranks waiting in a collective). The global RNG state is
restored afterwards and every cache released: no real session sees a trace of it (sessions seed their own
generators, and the golden and bit-identity tests run through warmed servers).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from ipc.protocol import ChunkControl, Stage, WarmUp
from ipc.streams import RoleStreams
from models.stages import SessionSpec, StreamGeometry
from ranks.backend import Backend
from runtime.sizes import Size

log = logging.getLogger(__name__)

WARMUP_CHUNKS = 2
GRAY = 128


def session_id(height: int, width: int) -> str:
    return f"warmup:{height}x{width}"  # never a real id (those are 12 hex digits)


def warm_up(backend: Backend, sizes: tuple[Size, ...], device: torch.device, streams: RoleStreams,
            chunks: int = WARMUP_CHUNKS) -> tuple[WarmUp, ...]:  # fmt: skip
    """Run every stage of ``backend`` at every size of ``sizes``; what ran, with its seconds."""
    stages: list[tuple[Stage, Callable[[StreamGeometry], None]]] = []
    if backend.denoise is not None:
        stages.append((Stage.DENOISE, lambda g: _denoise(backend, g, device, chunks)))
    if backend.condition is not None:
        stages.append((Stage.CONDITION, lambda g: _condition(backend, g, chunks)))
    if backend.decode is not None:
        stages.append((Stage.DECODE, lambda g: _decode(backend, g, device, chunks)))
    runs: list[WarmUp] = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for stage, run in stages:
            with streams.enter(stage.value):  # the stream this stage's thread will run on
                for height, width in sizes:
                    started = time.monotonic()
                    run(backend.geometry.with_size(height, width))
                    streams.synchronize()
                    seconds = time.monotonic() - started
                    runs.append(WarmUp(stage.value, height, width, chunks, seconds))
                    log.info("warm-up: %s at %dx%d, %d chunks in %.2f s", stage.value, height, width, chunks, seconds)
    return tuple(runs)


def _condition(backend: Backend, geometry: StreamGeometry, chunks: int) -> None:
    stage = backend.condition
    assert stage is not None
    sid = session_id(geometry.height, geometry.width)
    image = torch.full((geometry.height, geometry.width, 3), GRAY, dtype=torch.uint8)
    try:
        stage.open(SessionSpec(sid, 0, "", image, geometry.height, geometry.width))
        for index in range(chunks):
            stage.encode(sid, index)
    finally:
        stage.release(sid)


def _zeros(shape: tuple[int, ...], geometry: StreamGeometry, device: torch.device) -> torch.Tensor:
    """A tensor as it travels on the tensor plane (the geometry names its dtype)."""
    return torch.zeros(shape, dtype=getattr(torch, geometry.dtype), device=device)


def _denoise(backend: Backend, geometry: StreamGeometry, device: torch.device, chunks: int) -> None:
    stage = backend.denoise
    assert stage is not None
    sid = session_id(geometry.height, geometry.width)
    try:
        context = _zeros(geometry.context_shape, geometry, device)
        stage.open(SessionSpec(sid, 0, "", height=geometry.height, width=geometry.width), context)
        for index in range(chunks):
            condition = _zeros(geometry.condition_shape, geometry, device)
            stage.denoise(sid, index, condition, ChunkControl())
    finally:
        stage.release(sid)


def _decode(backend: Backend, geometry: StreamGeometry, device: torch.device, chunks: int) -> None:
    stage = backend.decode
    assert stage is not None
    sid = session_id(geometry.height, geometry.width)
    try:
        stage.open(SessionSpec(sid, 0, "", height=geometry.height, width=geometry.width))
        for index in range(chunks):
            stage.decode(sid, index, _zeros(geometry.latent_shape, geometry, device))
    finally:
        stage.release(sid)
