"""``[model] compile``: the DiT's blocks compiled once, and the steady passes replayed as CUDA graphs.

- ``off``: eager PyTorch, the reference.
- ``blocks``: regional compilation. ``Block.forward`` is compiled once with ``fullgraph=True`` and ``dynamic=False``
  and the same compiled code serves all the blocks (their weights are inputs of the graph, not constants), so one
  block's q/k RMS norm, RoPE, bf16 casts, ring write, modulation, gates and camera injection fuse into a few kernels.
  Everything a block sees has a shape fixed by the session's geometry: its tokens, the RoPE table, the ring written
  through a per-session slot index (``models.kv_cache``). The one shape that moves is the valid window while it
  fills (``filled``: one chunk more per chunk, then the whole window), so a geometry compiles once per fill level and
  never again: a v1 stream at one frame size is 6 graphs, a tiny one 3. Under Ulysses the all-to-alls stay eager:
  the block is compiled as its two halves around them (``attention_inputs``; ``attend_heads``; ``after_attention``),
  so every rank runs the same collectives in the same order whatever compiled where.
- ``graphs`` (CUDA only): ``blocks``, and each pass of a session's steady chunk (window full, ring wrapping) is
  captured once as a CUDA graph and replayed: per session (its ring, text and camera live at their own addresses)
  and per pass (the timestep's modulation is part of the capture). Chunks before the window is full run as
  ``blocks``. The inputs that change per call (latent, condition, RoPE table, the chunk's camera) are copied into
  the session's static buffers before each replay; the output is copied out after it. On CPU, or with a sharded DiT
  (its collectives would have to be captured on every rank alike), ``graphs`` runs as ``blocks`` and says so once.

Compilation happens at a block's first call with a new shape. If it cannot (no compiler, an unsupported platform, a
backend error), the DiT says so once and runs eagerly from then on: a session never fails for it. A graph break is
such an error (``fullgraph=True``); the tests assert that none happens, so one added to the block fails them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from models.dit import Block, ChunkCamera, SelfAttention, WanModelFast
from models.kv_cache import KVCache, TextCache

log = logging.getLogger(__name__)

MODES = ("off", "blocks", "graphs")
# Compiled variants kept per code object: a geometry needs one per fill level of the window (6 for v1), so the default
# of 8 would send a second frame size back to eager. 64 is about ten frame sizes.
RECOMPILE_LIMIT = 64


def compile_dit(model: WanModelFast, mode: str, device: torch.device | str = "cpu",
                backend: str | Callable[..., Any] = "inductor", strict: bool = False) -> str:  # fmt: skip
    """Apply ``mode`` to ``model`` (the DiT of one process, after ``apply_sequence_parallel``) and return the mode it
    really runs. What cannot run here is said once, at start, and the DiT runs the nearest mode that can.
    ``backend``: the ``torch.compile`` backend (a seam for tests). ``strict`` (conformance checks and tests): a block
    that fails to compile raises instead of running eagerly."""
    if mode not in MODES:
        raise ValueError(f"compile must be one of {MODES}, got {mode!r}")
    model.block_runner, model.graphs = None, None
    if mode == "off":
        return "off"
    device = torch.device(device)
    why = unsupported(device, backend)
    if why and strict:
        raise RuntimeError(f"compile = {mode!r} cannot run here: {why}")
    if why:
        log.warning("compile = %r cannot run here (%s): the DiT runs eagerly", mode, why)
        return "off"
    if mode == "graphs" and device.type != "cuda":
        log.warning("compile = 'graphs' needs CUDA (the DiT is on %s): running as 'blocks'", device)
        mode = "blocks"
    if mode == "graphs" and model.sp.size > 1:
        log.warning("compile = 'graphs' captures single-rank passes only (this DiT is sharded over %d ranks): running "
                    "as 'blocks'", model.sp.size)  # fmt: skip
        mode = "blocks"
    if model.sp.size > 1 and any(block.self_attn.overlap for block in model.blocks):
        log.warning("model.overlap_all_to_all applies to eager blocks only: compiled, each layer exchanges q/k/v and "
                    "its output once (compile = %r)", mode)
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
    model.block_runner = CompiledBlocks(sharded=model.sp.size > 1, backend=backend, strict=strict)
    if mode == "graphs":
        model.graphs = CudaGraphPasses()
    log.info("compile = %r: one compiled block for all %d%s", mode, len(model.blocks),
             ", steady passes replayed as CUDA graphs" if mode == "graphs" else "")  # fmt: skip
    return mode


def unsupported(device: torch.device, backend: str | Callable[..., Any]) -> str:
    """Why ``torch.compile`` cannot run on ``device`` (empty: it can, as far as can be told without compiling)."""
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile does not support this Python or platform"
    if backend != "inductor":
        return ""
    if device.type == "cpu" and not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        return "inductor's CPU backend needs a C++ compiler and none is on PATH"
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "inductor's CUDA backend needs triton, which is not installed"
        # triton builds its launcher stubs with a C compiler at the first compiled call; without one the failure
        # would come mid-chunk, so it is named here, before any compile is tried
        if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
            return "inductor's CUDA backend needs a C compiler (CC, cc, gcc or clang) for triton and none is on PATH"
    elif device.type != "cpu":
        return f"inductor is not set up for {device.type}"
    return ""


class CompiledBlocks:
    """``Block.forward`` compiled once for every block; on a compile failure, eager from then on (said once)."""

    def __init__(self, sharded: bool, backend: str | Callable[..., Any] = "inductor", strict: bool = False) -> None:
        def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
            return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)

        self.sharded, self.strict = sharded, strict
        self.whole = compiled(Block.forward)
        self.halves = (compiled(Block.attention_inputs), compiled(SelfAttention.attend_heads),
                       compiled(Block.after_attention))  # fmt: skip
        self.failure: BaseException | None = None  # the error that sent the blocks back to eager

    def __call__(self, block: Block, *args: Any) -> torch.Tensor:
        if self.failure is None:
            try:
                return self._compiled(block, *args)
            except torch.OutOfMemoryError:
                raise
            except Exception as error:  # any compile error: eager is always right
                if self.strict:
                    raise
                self.failure = error
                log.warning("the compiled DiT block failed (%s); the DiT runs eagerly from now on", _reason(error))
        return block(*args)  # eager; a compiled call that failed before finishing wrote the same slots as this one

    def _compiled(self, block: Block, *args: Any) -> torch.Tensor:
        if not self.sharded:
            return self.whole(block, *args)
        # The all-to-alls stay eager between the compiled halves (the same order on every rank).
        x, mod, rope, n_total, kv, text_kv, cam, mask = args
        before, attend, after = self.halves
        sp = block.self_attn.sp
        q, k, v = sp.qkv_to_heads(*before(block, x, mod), n_total)
        out = sp.heads_to_seq(attend(block.self_attn, q, k, v, rope, kv, mask))
        return after(block, x, out, mod, text_kv, cam)


def _reason(error: BaseException) -> str:
    """``Outer (Inner: message)`` of a compile error, naming its root cause in one line (dynamo wraps it)."""
    root = error
    while root.__cause__ is not None or getattr(root, "inner_exception", None) is not None:
        root = root.__cause__ or root.inner_exception  # type: ignore[attr-defined]
    message = (str(root).strip().splitlines() or [""])[0]
    inner = f"{type(root).__name__}: {message}"
    return inner if root is error else f"{type(error).__name__} ({inner})"


@dataclass
class _Captured:
    """One pass of one session as a CUDA graph, with the static tensors it reads and writes."""

    graph: Any  # torch.cuda.CUDAGraph
    x: torch.Tensor
    y: torch.Tensor
    rope: torch.Tensor
    out: torch.Tensor
    keep: tuple[torch.Tensor, ...]  # the memoised timestep tensors the graph reads: kept alive with it


@dataclass
class _SessionGraphs:
    """A session's captured passes and its static camera (shared by its passes, filled once per chunk)."""

    cam: ChunkCamera
    passes: dict[float, _Captured] = field(default_factory=dict)
    cam_source: weakref.ref[ChunkCamera] | None = None


class CudaGraphPasses:
    """CUDA-graph capture and replay of steady passes, per (session, timestep); all graphs share one memory pool
    (they never run at once, and each output is copied out before the next replay)."""

    def __init__(self) -> None:
        self.pool: Any = None
        self.side: Any = None  # torch.cuda.Stream of the warm-up passes, made at the first capture
        self.failure: BaseException | None = None

    def steady(self, cache: KVCache) -> bool:
        """The cache is steady (``KVCache.steady``) and no capture failed."""
        return self.failure is None and cache.steady

    def __call__(self, model: WanModelFast, x: torch.Tensor, y: torch.Tensor, t: float, e: torch.Tensor,
                 mods: torch.Tensor, rope: torch.Tensor, text: TextCache, cam: ChunkCamera,
                 cache: KVCache) -> torch.Tensor:  # fmt: skip
        graphs = cache.replay
        if not isinstance(graphs, _SessionGraphs):  # the session's own static camera (freed with its cache)
            graphs = cache.replay = _SessionGraphs(ChunkCamera([(s.clone(), h.clone()) for s, h in cam.per_block]))
        if graphs.cam_source is None or graphs.cam_source() is not cam:  # a new chunk: its camera, once
            for (ds, dh), (s, h) in zip(graphs.cam.per_block, cam.per_block):
                ds.copy_(s)
                dh.copy_(h)
            graphs.cam_source = weakref.ref(cam)
        captured = graphs.passes.get(t)
        if captured is None:
            try:
                captured = self._capture(model, x, y, e, mods, rope, text, graphs.cam, cache)
            except torch.OutOfMemoryError:
                raise
            except Exception as error:  # capture is an optimisation: never fail a session for it
                self.failure = error
                log.warning("CUDA-graph capture of a DiT pass failed (%s); passes run as compiled blocks from now on",
                            _reason(error))
                return model.run(x, y, e, mods, rope, text, cam, cache)
            graphs.passes[t] = captured
        captured.x.copy_(x)
        captured.y.copy_(y)
        captured.rope.copy_(rope)
        captured.graph.replay()
        return captured.out.clone()

    def _capture(self, model: WanModelFast, x: torch.Tensor, y: torch.Tensor, e: torch.Tensor, mods: torch.Tensor,
                 rope: torch.Tensor, text: TextCache, cam: ChunkCamera, cache: KVCache) -> _Captured:  # fmt: skip
        static_x, static_y, static_rope = x.clone(), y.clone(), rope.clone()

        def run() -> torch.Tensor:
            return model.run(static_x, static_y, e, mods, static_rope, text, cam, cache)

        graph, out = self._record(run)
        return _Captured(graph, static_x, static_y, static_rope, out, (e, mods))

    def _record(self, run: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """``run`` captured as a CUDA graph, and the output tensor its replays write."""
        # Warm-up on a side stream (compiles this fill level, initialises cuBLAS): a pass may run twice, since it
        # rewrites the same slots with the same keys and values.
        if self.side is None:  # one side stream for every capture: a new one each time would leave its own cache
            self.side = torch.cuda.Stream()
        side = self.side
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # Not ``with torch.cuda.graph(...)``: its __enter__ synchronizes the whole device and empties the cache, and
        # it captures on one side stream shared by every thread. A session's passes are captured mid-serving (its
        # ring lives at its own addresses), where a device-wide wait could sit behind an NCCL kernel of another role
        # thread spinning for its peer. So: capture on this thread's own (non-default) stream, without a device
        # sync, and in "thread_local" mode, so the other role threads' work meanwhile (a decode's .cpu(), their
        # allocations) neither invalidates the capture nor is refused by it; only this thread is restricted.
        graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        try:
            out = run()
        except BaseException:
            with contextlib.suppress(Exception):  # end the capture; the error that broke it is the one to see
                graph.capture_end()
            raise
        graph.capture_end()
        return graph, out
