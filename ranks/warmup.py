"""Warm start: before a rank reports in (so before the port opens), each stage thread of the rank runs a throwaway
session at every frame size the server serves (``runtime.sizes.served_sizes``), in the thread and on the stream that
will serve the stage.

Why: a shape's first use on a GPU costs, with device-wide syncs. cuDNN autotunes every new convolution shape of the
VAEs (first decodes at a new size measured at 4.9 s and 2.2 s against 0.29 s steady on an H200); mid-serving that
stalls every stream of the GPU, or waits behind an NCCL receive spinning on it. PyTorch keeps cuDNN's autotune
results (and its cuDNN attention plans) per thread, so a warm-up in any other thread than the serving one leaves the
serving one cold: each stage thread warms itself (``warm_stage``, called by ``ranks.worker.serve``). A compiled DiT
(``model.compile``) compiles once per fill level of its KV window: its warm-up runs every level and one steady chunk
more (``stage_chunks``), so no compile lands on a session. (Module loads are done before: the launcher sets
``CUDA_MODULE_LOADING=EAGER``.)

The session (``models.stages.WARM_UPS``, one run per stage): ``WARMUP_CHUNKS`` chunks through the real stage code
(chunk 0 runs the first latent frame's path, chunk 1 the path with the causal caches filled: the tiny VAE meets new
convolution shapes in both and none after, ``tests/test_warm_start.py``), seed 0, an empty prompt, a mid-gray start
image on the condition rank and zeros for what other ranks would send (context, condition, latent). Every DiT rank's
denoise thread runs the same sizes in the same order, so the group's collectives pair up (the argument for
co-located stages is in ``StartGate``). Every cache is released afterwards and the launcher restores the RNG state
around the whole warm-up: no real session sees a trace of it (sessions seed their own generators, and the golden and
bit-identity tests run through warmed servers).

A size that runs out of memory (a card too small for it) is reported as not warm, with why, and the rank goes on:
rank 0 refuses sessions at that size naming the rank, and the sizes that fit are served. On a DiT group the ranks
agree on the opening of each warm-up session (``agree_prepared``), as they do for every chunk, so one rank short of
memory fails that size on every rank alike instead of leaving the others inside a collective.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch

from ipc.protocol import Stage, WarmUp
from ipc.streams import RoleStreams
from models.stages import WARM_UPS, SessionInputError
from models.stages import warm_up_session as session_id  # noqa: F401  # the throwaway session's id, re-exported
from ranks.backend import Backend
from runtime.sizes import Size

log = logging.getLogger(__name__)

WARMUP_CHUNKS = 2


def stage_chunks(backend: Backend, stage: Stage) -> int:
    """Chunks of the throwaway session of ``stage``: ``WARMUP_CHUNKS``, or for a compiled DiT every fill level of its
    KV window plus one steady chunk (the last compile, and a ``graphs`` DiT's first capture), within its cap."""
    denoise = backend.denoise
    if stage is not Stage.DENOISE or getattr(denoise, "compile", "off") == "off":
        return WARMUP_CHUNKS
    cfg = denoise.cfg  # type: ignore[union-attr]
    chunks = -(-cfg.kv_window // cfg.chunk_size) + 1
    if cfg.max_chunks is not None:  # a full (non-evicting) window holds no more
        chunks = min(chunks, cfg.max_chunks)
    return max(chunks, WARMUP_CHUNKS)


def stages_of(backend: Backend) -> list[Stage]:
    """The stages this backend runs, denoise first, then in pipeline order."""
    order = list(Stage)
    return sorted(backend, key=lambda stage: (stage is not Stage.DENOISE, order.index(stage)))


def warm_up(backend: Backend, sizes: tuple[Size, ...], device: torch.device, streams: RoleStreams,
            dit_group: Any | None = None) -> tuple[WarmUp, ...]:  # fmt: skip
    """Every stage of ``backend`` at every size of ``sizes``, one after the other in the calling thread (each on its
    role's stream), with the RNG state restored after: for a process that serves every stage itself (tests,
    benchmarks). A server warms each stage in its own serving thread instead (``warm_stage``)."""
    runs: list[WarmUp] = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for stage in stages_of(backend):
            with streams.enter(stage.value):
                runs.extend(warm_stage(backend, stage, sizes, device, dit_group))
    return tuple(runs)


def warm_stage(backend: Backend, stage: Stage, sizes: tuple[Size, ...], device: torch.device,
               dit_group: Any | None = None) -> tuple[WarmUp, ...]:  # fmt: skip
    """Run ``stage`` at every size of ``sizes`` in the calling thread, on its current stream; what ran, with its
    seconds, its thread, and why a size failed (out of memory: this rank then does not serve that size)."""
    chunks = stage_chunks(backend, stage)
    runner = WARM_UPS[stage]
    thread = threading.current_thread().name
    runs: list[WarmUp] = []
    for height, width in sizes:
        started = time.monotonic()
        failed = ""
        try:
            runner(backend[stage], backend.geometry.with_size(height, width), device, chunks, dit_group)
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
        except (torch.OutOfMemoryError, SessionInputError) as error:  # the latter: the DiT group agreed on an OOM
            failed = f"{type(error).__name__}: {error}"
            del error  # its traceback's frames hold the failed session's tensors
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            log.warning("warm-up: %s at %dx%d could not run on this rank (%s): it will not serve that size",
                        stage.value, height, width, failed)
        seconds = time.monotonic() - started
        runs.append(WarmUp(stage.value, height, width, chunks, seconds, thread=thread, failed=failed))
        if not failed:
            log.info("warm-up: %s at %dx%d, %d chunks in %.2f s (thread %s)", stage.value, height, width, chunks,
                     seconds, thread)
    return tuple(runs)


class StartGate:
    """A rank's start: its stage threads warm up, then the main thread measures the rank's room, then every role
    thread sends its hello (which carries that room).

    Why the concurrent warm-ups cannot deadlock a co-located rank (fast4, aggregated8: condition, decode and denoise
    threads on one GPU):
    - the only collectives of the warm-up are the DiT group's, all in the denoise threads, each running the same
      sizes and chunks in the same order: they pair up. Every other group's communicator was made before any role
      thread started (``launch.handshake``) and carries nothing until the port opens, after every hello;
    - a denoise thread depends on nothing another thread of its rank does (no mailbox, no lock: its inputs are
      zeros). A condition or decode thread may wait on the host for its device (cuDNN autotuning syncs it, an
      allocation may free cached blocks) behind a DiT kernel spinning for a peer; that peer's denoise thread does not
      depend on its own rank's other threads either, so it arrives and the kernel ends. Waits run from a rank's
      other stages to the DiT group and never back: no cycle;
    - the main thread measures room only after every stage thread finished (``wait_warm``): no warm-up block is
      counted as free, and none is allocated after the measurement.
    """

    def __init__(self, stages: Iterable[Stage]) -> None:
        self.pending = set(stages)
        self.runs: dict[Stage, tuple[WarmUp, ...]] = {}
        self.ready = threading.Event()  # set once the room is measured: the hellos may go
        self._cond = threading.Condition()

    def warmed(self, stage: Stage, runs: tuple[WarmUp, ...]) -> None:
        with self._cond:
            self.runs[stage] = runs
            self.pending.discard(stage)
            self._cond.notify_all()

    def wait_warm(self, stop: threading.Event) -> tuple[WarmUp, ...] | None:
        """Every stage's warm-up, once all are done (None when ``stop`` was set first)."""
        with self._cond:
            while self.pending:
                if stop.is_set():
                    return None
                self._cond.wait(0.5)
            return tuple(run for runs in self.runs.values() for run in runs)

    def wait_ready(self, stop: threading.Event) -> bool:
        """Wait until the rank's room is known; False when ``stop`` was set first."""
        while not self.ready.wait(0.5):
            if stop.is_set():
                return False
        return True
