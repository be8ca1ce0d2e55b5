"""What a session costs in memory, per rank: the model behind memory-aware admission and the GPU memory table.

Every number is measured on the meta device from the objects the stages really allocate (``new_kv_cache``, the
DiT's ``text_cache``, a ``FrameDecoder`` and a ``ConditionEncoder`` run for two chunks, the DiT's chunk passes,
the weights of each network), so the model follows the code instead of constants that could drift. Nothing is
computed on a device and no weights are read: a 480x832 v1 table takes seconds on a CPU.

Per rank, by the roles it holds:

- **per session** (``session_items``): ``kv_cache`` and ``text_cache`` on each DiT rank (its Ulysses share of the
  heads), ``dit_inputs`` (the prompt context and the prefetched conditions in its mailbox); ``decode_cache`` and the
  waiting ``latents`` on the decode rank; ``encode_cache`` plus its fixed-point ``encode_snapshot`` (held until the
  condition encoder freezes), the ``context`` and the prefetched ``conditions`` on the condition rank;
- **fixed** (``fixed_items``): the weights of each network the rank holds (a rank with both VAE roles loads two
  copies) and the ``working`` peak of one chunk of each stage it runs (the transient on top of the caches; role
  threads run at once, so a co-located rank pays the sum).

The per-session figures are exact for the tensors they name (``tests/test_memory.py`` checks them against a real
tiny session on CPU); the working peaks are the live bytes of the meta run (``PeakTracker``), which the caching
allocator can round up: the margin of ``[memory]`` covers that. Host memory of rank 0 (frames on their way to the
client) is not GPU memory and not counted. Only ``model.kind = "lingbot-fast"`` holds session tensors worth
counting; other backends cost nothing here. The networks are the preset's sizes (the released checkpoints'
``config.json`` and tensor shapes match them); the dtypes are those the ranks run on ``device_type``.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from models.ulysses import InFlight, Ulysses

log = logging.getLogger(__name__)

GIB = 1 << 30
PREFETCH = 2  # conditions a session may have encoded ahead (the scheduler's internal prefetch depth)
STEADY_CHUNKS = 2  # VAE caches reach their steady size after two chunks (chunk 0 covers fewer frames)


@dataclass(frozen=True)
class Margins:
    """Memory that a meta-device run cannot see, named in one place. Each figure is a fact measured on a GPU, or 0
    with the reason where nothing is measured yet; ``scripts/gpu_run.sh`` puts the measured peaks beside the model's
    figures, and the first run on a GPU corrects them here (and nowhere else)."""

    # cuDNN's convolution workspaces and layout transforms in a VAE chunk: a TF32 decode of chunk 0 at 480x832 on an
    # H200 peaked at 17.98 GiB against 13.46 GiB modelled (weights, cache and working set; 2026-11-30). Part of that
    # gap may be autotuning's trial workspaces (released before the room is measured), so counting all of it errs on
    # the safe side. Scaled by frame area; the encoder is given the same (its convolutions mirror the decoder's): its
    # peak has not been measured against the model yet.
    vae_conv_workspace_480x832: int = int((17.98 - 13.46) * GIB)
    # cuDNN SDPA's workspace in the DiT: not measured apart (the DiT's peak on an H200 has not been set beside the
    # model yet), so 0 until the first run's dit peak says otherwise
    dit_attention_workspace: int = 0
    # NCCL's channel and protocol buffers: none here, because launch.RANK_ENV sets NCCL_RUNTIME_CONNECT=0, so every
    # communicator connects when it is created, before each rank measures its room (which then holds them)
    nccl_buffers: int = 0
    # the CUDA context under CUDA_MODULE_LOADING=EAGER: measured by each rank at start (its room), only assumed by
    # scripts/memory_table.py for the printed table
    eager_context_assumed: int = 1 * GIB

    def vae_conv_workspace(self, height: int, width: int) -> int:
        return self.vae_conv_workspace_480x832 * height * width // (480 * 832)


MARGINS = Margins()
# items of ``fixed_items`` that must stay free for a chunk to run (transient, or reserved by a pool that appears only
# later): what ``working_bytes`` sums and the room subtracts
RESERVED_SUFFIXES = ("working", "workspace", "pool")


def nbytes(tensors: Any) -> int:
    """Bytes of the distinct storages among the tensors in ``tensors`` (nested lists, tuples, dicts)."""
    seen: dict[int, int] = {}
    for t in tree_flatten(tensors)[0]:
        if isinstance(t, torch.Tensor):
            seen[id(t.untyped_storage())] = t.untyped_storage().nbytes()
    return sum(seen.values())


class PeakTracker(TorchDispatchMode):
    """Live bytes of the storages created inside the mode (meta tensors included) and their peak: the working
    set of a computation without running it. Storages that existed before (weights, caches written in place) are
    not counted; a storage leaves the count when Python frees it."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {id(a.untyped_storage()) for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in inputs or key in self._seen:  # a view or an in-place result: no new bytes
                continue
            size = storage.nbytes()
            self._seen.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, size)
        return out

    def _freed(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size


class VirtualUlysses(Ulysses):
    """Rank 0 of a ``size``-rank Ulysses group without a process group: every all-to-all and gather returns
    tensors of the right shape (on the meta device, their content does not exist), so a meta run allocates what
    one rank of the real group allocates."""

    def __init__(self, size: int) -> None:
        super().__init__(None)
        self.size = size

    def gather(self, x: torch.Tensor, n: int) -> torch.Tensor:
        if self.size == 1:
            return x[:n]
        return x.new_empty(x.shape[0] * self.size, *x.shape[1:])[:n]

    def _start(self, send: torch.Tensor) -> InFlight:
        return InFlight(torch.empty_like(send), send)  # the real path's buffers: both live until it is waited for


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """What a fused attention kernel (flash, cuDNN, efficient: the DiT's kernels on a GPU) allocates: its output and
    a float32 log-sum-exp per query row, never the score matrix that SDPA's math path on the meta device would."""
    _lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
    return torch.empty_like(q)


@dataclass(frozen=True)
class Setting:
    """What the memory of a rank depends on besides its roles (hashable: results are memoised on it)."""

    preset: str
    kv_window: int | str
    kv_sink: int
    kv_full_frames: int
    chunk_latent_frames: int
    dit_dtype: torch.dtype
    vae_dtype: torch.dtype
    t5_dtype: torch.dtype
    dit_ranks: int
    latent_capacity: int
    compile: str = "off"  # graphs keeps per-session static copies and a capture pool (``_graphs_bytes``)
    cuda: bool = False  # cuDNN workspaces exist on CUDA only (``Margins``)
    fused_qkv: bool = False  # the DiT's q/k/v as one GEMM (its output [n, 3d] instead of three [n, d])
    overlap_all_to_all: bool = False  # the Ulysses exchanges in head groups (their buffers live together)


def setting(config: Any, device_type: str) -> Setting:
    """The ``Setting`` of a ``runtime.config.Config`` on ranks of ``device_type`` ("cuda" or "cpu")."""
    from models import lingbot_config

    device = torch.device(device_type)
    model = config.model
    return Setting(preset=model.preset, kv_window=model.kv_window, kv_sink=model.kv_sink,
                   kv_full_frames=model.kv_full_frames, chunk_latent_frames=config.stream.chunk_latent_frames,
                   dit_dtype=lingbot_config.compute_dtype(model, device),
                   vae_dtype=lingbot_config.vae_dtype(model, device),
                   t5_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                   dit_ranks=len(config.layout.dit), latent_capacity=config.scheduler.latent_capacity,
                   compile=model.compile, cuda=device.type == "cuda", fused_qkv=model.fused_qkv,
                   overlap_all_to_all=model.overlap_all_to_all)


class _Model:
    """``runtime.config`` sections rebuilt from a ``Setting`` (what ``models.lingbot_config`` reads)."""

    def __init__(self, s: Setting) -> None:
        self.preset, self.kv_window, self.kv_sink, self.kv_full_frames = (s.preset, s.kv_window, s.kv_sink,
                                                                           s.kv_full_frames)
        # the meta DiT runs eagerly; what graphs adds is counted apart (``_graphs_bytes``)
        self.attention, self.checkpoint_dir, self.compile = "sdpa", "", "off"
        self.chunk_latent_frames = s.chunk_latent_frames
        self.fused_qkv, self.overlap_all_to_all = s.fused_qkv, s.overlap_all_to_all


@contextmanager
def _meta() -> Iterator[None]:
    with torch.device("meta"), torch.no_grad():
        yield


def _dit(s: Setting) -> Any:
    from models import lingbot_config

    m = _Model(s)
    return _dit_model(lingbot_config.dit_config(m, m), s.dit_dtype, s.dit_ranks)


@functools.lru_cache(maxsize=8)
def _dit_model(cfg: Any, dtype: torch.dtype, ranks: int) -> Any:
    """The DiT of ``cfg`` on the meta device as one rank of a ``ranks``-rank Ulysses group sees it."""
    from models.dit import WanModelFast

    with _meta():
        model = WanModelFast(cfg).to(dtype)
    model.set_attention(fused_attention)
    for block in model.blocks:
        block.cross_attn.attend = fused_attention
    sp = VirtualUlysses(ranks)
    model.sp = sp
    for block in model.blocks:
        block.self_attn.sp = sp
    return model


@functools.lru_cache(maxsize=8)
def _vae(s: Setting) -> Any:
    from models import lingbot_config
    from models.vae import WanVAE

    with _meta():
        return WanVAE(lingbot_config.preset(s.preset).vae).to(s.vae_dtype)


@functools.lru_cache(maxsize=4)
def _t5_bytes(s: Setting) -> int:
    from models import lingbot_config
    from models.t5 import T5Encoder

    with _meta():
        return nbytes(list(T5Encoder(lingbot_config.preset(s.preset).t5).to(s.t5_dtype).parameters()))


def _geometry(s: Setting, height: int, width: int) -> Any:
    from models import lingbot_config

    m = _Model(s)
    stream = type("Stream", (), {"height": height, "width": width, "chunk_latent_frames": s.chunk_latent_frames})
    return lingbot_config.lingbot_geometry(m, stream)


def _wire(shape: tuple[int, ...]) -> int:
    return 4 * int(torch.Size(shape).numel())  # context, condition and latent travel as float32


@functools.lru_cache(maxsize=64)
def _dit_session(s: Setting, height: int, width: int) -> dict[str, int]:
    from models.kv_cache import new_kv_cache

    model, g = _dit(s), _geometry(s, height, width)
    cfg = model.cfg
    _, _, h, w = g.latent_shape
    with _meta():
        cache = new_kv_cache(cfg, (h // 2) * (w // 2), model.sp.local_heads(cfg.num_heads), "meta", s.dit_dtype)
        text = model.text_cache(torch.empty(g.context_shape))
    return {"kv_cache": cache.nbytes(), "text_cache": nbytes([text.k, text.v]),
            "dit_inputs": _wire(g.context_shape) + PREFETCH * _wire(g.condition_shape)}


def _dit_working(s: Setting, height: int, width: int) -> int:
    from models import lingbot_config

    m = _Model(s)
    return dit_working_bytes(lingbot_config.dit_config(m, m), s.dit_dtype, s.dit_ranks, height, width)


def _graphs(s: Setting, height: int, width: int) -> dict[str, int]:
    from models import lingbot_config

    m = _Model(s)
    return graphs_bytes(lingbot_config.dit_config(m, m), s.dit_dtype, s.dit_ranks, height, width)


def _full_window(model: Any, cfg: Any, dtype: torch.dtype, h: int, w: int) -> tuple[Any, Any, int]:
    """On the meta device: one rank's KV ring with the window full, the text cache, and the chunk that finds the
    window full (a steady chunk: every later one has its shapes)."""
    from models.kv_cache import new_kv_cache

    cs, fs = cfg.chunk_size, (h // 2) * (w // 2)
    cache = new_kv_cache(cfg, fs, model.sp.local_heads(cfg.num_heads), "meta", dtype)
    text = model.text_cache(torch.empty(cfg.text_len, cfg.text_dim))
    chunk = max(0, cfg.kv_window // cs - 1)  # the window is full once this chunk is placed
    for k in range(chunk):
        cache.begin(k * cs * fs, cs * fs)
    return cache, text, chunk


@functools.lru_cache(maxsize=64)
def dit_working_bytes(cfg: Any, dtype: torch.dtype, ranks: int, height: int, width: int) -> int:
    """Peak live bytes of one steady chunk on one rank of a ``ranks``-rank DiT group: the camera modulation (held
    through the chunk) and one denoising pass against a full window (every pass of a chunk has the same shapes)."""
    model = _dit_model(cfg, dtype, ranks)
    cs, h, w = cfg.chunk_size, height // 8, width // 8
    with _meta():
        cache, text, chunk = _full_window(model, cfg, dtype, h, w)
        control = torch.empty(1, cfg.control_features // 4, cs, h, w)
        x, y = torch.empty(16, cs, h, w), torch.empty(20, cs, h, w)
        model._time_memo.clear()
        with PeakTracker() as tracker:
            cam = model.camera_modulation(control)
            model(x, y, 500.0, chunk * cs, text, cam, cache)
            del cam
    return tracker.peak


@functools.lru_cache(maxsize=64)
def graphs_bytes(cfg: Any, dtype: torch.dtype, ranks: int, height: int, width: int) -> dict[str, int]:
    """What ``compile = "graphs"`` adds on one DiT rank (``models.compiled.CudaGraphPasses``): per session, its own
    copy of the camera modulation (``graphs_camera``) and each captured pass's static input and output tensors
    (``graphs_statics``, one pass per timestep); per rank, the capture pool all graphs share (``graphs_pool``: the
    live bytes of one steady pass, held for the process's life beside the ordinary pool)."""
    model = _dit_model(cfg, dtype, ranks)
    cs, h, w = cfg.chunk_size, height // 8, width // 8
    with _meta():
        cache, text, chunk = _full_window(model, cfg, dtype, h, w)
        cam = model.camera_modulation(torch.empty(1, cfg.control_features // 4, cs, h, w))
        x, y = torch.empty(16, cs, h, w), torch.empty(20, cs, h, w)
        rope = torch.view_as_real(model._rope(cs, h // 2, w // 2, chunk * cs, torch.device("meta")))
        model._time_memo.clear()
        with PeakTracker() as one_pass:
            out = model(x, y, 500.0, chunk * cs, text, cam, cache)
    statics = nbytes([x, y, rope, out])
    return {"graphs_camera": nbytes([list(p) for p in cam.per_block]),
            "graphs_statics": len(cfg.timestep_indices) * statics, "graphs_pool": one_pass.peak}


def ensure_headroom(device: torch.device, need: int, what: str) -> None:
    """Raise ``torch.OutOfMemoryError`` now, before any collective, when the CUDA memory not in use (free on the
    device plus what the caching allocator holds unused) is below ``need`` bytes; nothing on other devices."""
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    error = headroom_error(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device), need,
                           what, device)
    if error is not None:
        raise error


def headroom_error(unused: int, need: int, what: str, device: torch.device) -> torch.OutOfMemoryError | None:
    if unused >= need:
        return None
    return torch.OutOfMemoryError(f"{what} needs {need / GIB:.2f} GiB of working memory and {unused / GIB:.2f} GiB "
                                  f"are free on {device}")


@functools.lru_cache(maxsize=64)
def _vae_runs(s: Setting, height: int, width: int) -> dict[str, int]:
    from models import lingbot_config

    g = _geometry(s, height, width)
    return vae_run_bytes(lingbot_config.preset(s.preset).vae, s.vae_dtype, tuple(g.latent_shape), height, width,
                         s.chunk_latent_frames)  # fmt: skip


@functools.lru_cache(maxsize=64)
def vae_run_bytes(vae_cfg: Any, dtype: torch.dtype, latent_shape: tuple[int, ...], height: int, width: int,
                  chunk_latent_frames: int) -> dict[str, int]:  # fmt: skip
    """Decoder and encoder caches after ``STEADY_CHUNKS`` chunks and the peak of one chunk beyond them, for the VAE
    of ``vae_cfg`` in ``dtype`` (the decoder fed latents of ``latent_shape``, the encoder a ``height x width``
    image)."""
    from models.vae import WanVAE
    from models.vae_stream import ConditionEncoder, FrameDecoder

    with _meta():
        vae = WanVAE(vae_cfg).to(dtype)
        decoder = FrameDecoder(vae)
        with PeakTracker() as dec:
            for _ in range(STEADY_CHUNKS):
                decoder.decode(torch.empty(latent_shape, dtype=dtype))
        decode_cache = decoder.nbytes()
        encoder = ConditionEncoder(vae, torch.empty(3, height, width, dtype=dtype), chunk_latent_frames,
                                   constant_tail=False)  # the fixed point's snapshot is counted by the caller
        with PeakTracker() as enc:
            for _ in range(STEADY_CHUNKS):
                encoder.next_chunk()
        encode_cache = encoder.nbytes()
    return {"decode_cache": decode_cache, "decode_working": max(0, dec.peak - decode_cache),
            "encode_cache": encode_cache, "encode_working": max(0, enc.peak - encode_cache)}


def roles_of(config: Any, rank: int) -> list[str]:
    return [r for r in config.layout.roles_of(rank) if r != "coordinator"]


def counted(config: Any) -> bool:
    """Whether the model has anything to count for this config's backend."""
    return config.model.kind == "lingbot-fast"


def priced(config: Any, device_type: str) -> bool:
    """Whether sessions are priced at all: on CUDA always, on a CPU only under a ``memory.budget_gb`` (unlimited
    otherwise). The model builds the preset's full-size networks on the meta device, seconds of Python on rank 0 that
    a CPU job without a budget (tiny weights under a release preset, in tests) would spend for nothing."""
    return counted(config) and (device_type == "cuda" or config.memory.budget_gb > 0)


def session_items(config: Any, rank: int, height: int, width: int, device_type: str) -> dict[str, int]:
    """Bytes one more session of ``height x width`` frames costs ``rank``, by item."""
    if not counted(config):
        return {}
    return dict(_session_items(setting(config, device_type), tuple(roles_of(config, rank)), height, width))


@functools.lru_cache(maxsize=256)
def _session_items(s: Setting, roles: tuple[str, ...], height: int, width: int) -> dict[str, int]:
    items: dict[str, int] = {}
    if "denoise" in roles:
        items.update(_dit_session(s, height, width))
        if s.compile == "graphs":
            graphs = _graphs(s, height, width)
            items.update(graphs_camera=graphs["graphs_camera"], graphs_statics=graphs["graphs_statics"])
    g = _geometry(s, height, width)
    if "decode" in roles:
        items["decode_cache"] = _vae_runs(s, height, width)["decode_cache"]
        items["latents"] = s.latent_capacity * _wire(g.latent_shape)
    if "condition" in roles:
        cache = _vae_runs(s, height, width)["encode_cache"]
        items.update(encode_cache=cache, encode_snapshot=cache, context=_wire(g.context_shape),
                     conditions=PREFETCH * _wire(g.condition_shape))
    return items


def fixed_items(config: Any, rank: int, height: int, width: int, device_type: str) -> dict[str, int]:
    """Bytes ``rank`` holds whatever the sessions: weights and the working peak of a chunk of its stages."""
    if not counted(config):
        return {}
    s = setting(config, device_type)
    roles = roles_of(config, rank)
    items: dict[str, int] = {}
    vae_weights = nbytes(list(_vae(s).parameters()))
    if "denoise" in roles:
        items["dit_weights"] = nbytes(list(_dit(s).parameters()))
        items["dit_working"] = _dit_working(s, height, width)
        if s.compile == "graphs":
            items["graphs_pool"] = _graphs(s, height, width)["graphs_pool"]
        if s.cuda and MARGINS.dit_attention_workspace:
            items["dit_workspace"] = MARGINS.dit_attention_workspace
    if "condition" in roles:
        items["t5_weights"] = _t5_bytes(s)
        items["vae_encoder_weights"] = vae_weights  # the condition stage loads its own VAE
        items["encode_working"] = _vae_runs(s, height, width)["encode_working"]
        if s.cuda:
            items["encode_workspace"] = MARGINS.vae_conv_workspace(height, width)
    if "decode" in roles:
        items["vae_decoder_weights"] = vae_weights
        items["decode_working"] = _vae_runs(s, height, width)["decode_working"]
        if s.cuda:
            items["decode_workspace"] = MARGINS.vae_conv_workspace(height, width)
    return items


def working_bytes(config: Any, rank: int, height: int, width: int, device_type: str) -> int:
    """The part of ``fixed_items`` that must stay free for a chunk to run: working sets, cuDNN workspaces, the
    graphs' capture pool (``RESERVED_SUFFIXES``); the rest (weights) is resident before the room is measured."""
    items = fixed_items(config, rank, height, width, device_type)
    return sum(v for k, v in items.items() if k.endswith(RESERVED_SUFFIXES))


def session_costs(config: Any, height: int, width: int, device_type: str) -> dict[int, int]:
    """Bytes one more session of ``height x width`` frames costs each rank (every rank listed, 0 when nothing)."""
    return {rank: sum(session_items(config, rank, height, width, device_type).values())
            for rank in range(config.layout.world_size)}


@dataclass(frozen=True)
class RankMemory:
    rank: int
    roles: tuple[str, ...]
    fixed: dict[str, int]
    session: dict[str, int]

    @property
    def fixed_bytes(self) -> int:
        return sum(self.fixed.values())

    @property
    def session_bytes(self) -> int:
        return sum(self.session.values())

    def sessions(self, capacity: int) -> int | None:
        """Sessions that fit in ``capacity`` bytes beside the fixed bytes (None: no per-session cost)."""
        if self.session_bytes == 0:
            return None
        return max(0, (capacity - self.fixed_bytes) // self.session_bytes)


def ranks_memory(config: Any, height: int, width: int, device_type: str) -> list[RankMemory]:
    return [RankMemory(rank, tuple(config.layout.roles_of(rank)),
                       fixed_items(config, rank, height, width, device_type),
                       session_items(config, rank, height, width, device_type))
            for rank in range(config.layout.world_size)]
