"""The GPU benchmark: what a user with GPUs gets, against the physical floor, in one command that fits 10 minutes.

    python scripts/bench_gpu.py                   # on a CUDA machine: full-size model, 480x832, bf16
    python scripts/bench_gpu.py --serve           # also run a short session through the whole server on one GPU
    python scripts/bench_gpu.py --tiny            # the same code path at tiny sizes (CPU), as the tests run it
    python scripts/bench_gpu.py --only dit --merge --out X.json    # one section, merged into X.json
    python scripts/bench_gpu.py --summary --out X.json             # projections, targets and the table from X.json

Measures, on the first device (seeded random weights; the numbers depend on shapes, not on weight values):

- the device's bf16 matmul peak (a large GEMM), which sets the FLOP floor;
- each SDPA backend (default, flash, cuDNN, efficient) at the DiT's real steady self-attention shape;
- the bf16 DiT against its own float32 path (``small`` preset, one chunk);
- the DiT per chunk at steady state (the KV window full) for the v1 and v2 recipes, SDPA and (when it imports)
  SageAttention: seconds, achieved TFLOP/s, ratio to the floor, peak memory, whether
  the attention ran on fused kernels only, the bytes one session's caches take (allocator delta against the
  computed KV ring), and the top 25 kernels of one steady v1 chunk by device time;
- the Wan2.1 VAE per chunk, encode and decode, for each precision policy (strict fp32, TF32 + cudnn.benchmark,
  bf16) with its error against strict fp32 and the bytes of one session's decode and encode caches;
- umT5-XXL for one 512-token prompt;
- the KV-cache bytes per session per DiT rank for each layout;
- with more than one GPU: for each layout's DiT group size N that fits, the Ulysses all-to-all per layer and the
  DiT chunk at SP = N, and concurrent transfers on two NCCL groups per GPU (the decode and coordinator ranks);
- a session served through the whole runtime on one GPU at 480x832 (``--serve``): its first chunk against its
  steady chunks;
- projected chunk period and FPS per layout, only from a DiT chunk measured at that layout's SP degree, marked as
  projections, next to the published 17.07 FPS (7 x H100 split) and 29.5 FPS (8 x H100 aggregated);
- the issue's targets, each with pass/fail.

Prints a table and writes everything to ``$OUT/bench_gpu.json`` (or ``--out``), rewritten after every section so a
crash or a timeout keeps what finished. Every section records its result or its error; a failing section never stops
the others. SIGTERM (``timeout``) records the running section as timed out and ends the run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import logging
import math
import os
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models import memory, precision
from models.attention import _load_sage, pinned_backend
from models.controls import ChunkControl
from models.dit import chunk_flops
from models.dit_checkpoint import random_dit
from models.dit_config import DiTConfig
from models.kv_cache import kv_cache_bytes
from models.lingbot_denoise import LingbotDenoiseStage
from models.stages import SessionSpec
from scripts import bench_split_rank
from scripts.bench_split_rank import dit_model_gib
from scripts.gpu_base import (
    LAYOUTS,
    Sizes,
    allocated,
    chunk_times,
    delta,
    geometry_of,
    peak_gib,
    peak_over,
    reset_peak,
    sync,
    timed,
)
from scripts.gpu_multi import multi_gpu
from scripts.gpu_summary import table

PUBLISHED_FPS = {"split7 (7 x H100, seed PR)": 17.07, "aggregated8 (8 x H100, FlashDreams)": 29.5}
TARGETS = {"dit_v1_over_floor": 1.6, "vae_decode_s": 0.25, "vae_encode_s": 0.2, "split7_fps": 25.0}


# ------------------------------------------------------------------------------------------------ sections


def matmul_peak(sizes: Sizes, device: torch.device) -> dict[str, Any]:
    n = sizes.gemm
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    seconds = timed(lambda: a @ b, device, repeat=10)
    return {"n": n, "dtype": str(dtype), "tflops": 2 * n**3 / seconds / 1e12}


def sdpa_backends(sizes: Sizes, device: torch.device, repeat: int = 10) -> dict[str, Any]:
    """Each SDPA backend at the DiT's steady self-attention shape (full size, v1: q ``[1, 40, 4680, 128]`` against
    k/v ``[1, 40, 28080, 128]``, bf16; q in the model's layout, a transposed ``[1, n, heads, d]``): seconds per call
    and TFLOP/s. A backend that refuses the shape records its error."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = DiTConfig.from_name(sizes.dit["v1"])
    fs = (sizes.height // 16) * (sizes.width // 16)
    n, kv = cfg.chunk_size * fs, cfg.kv_window * fs
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)  # drawn on the device: no host round trip for the 0.6 GB of k/v
    q = torch.randn(1, n, cfg.num_heads, cfg.head_dim, device=device, dtype=dtype).transpose(1, 2)
    k, v = (torch.randn(1, cfg.num_heads, kv, cfg.head_dim, device=device, dtype=dtype) for _ in range(2))
    flops = 4 * cfg.num_heads * n * kv * cfg.head_dim
    out: dict[str, Any] = {"q": list(q.shape), "kv": list(k.shape), "dtype": str(dtype)}
    backends = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}  # fmt: skip
    for name, backend in backends.items():
        try:
            with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
                seconds = timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), device, repeat)
            out[name] = {"s": seconds, "tflops": flops / seconds / 1e12}
        except RuntimeError as error:
            out[name] = {"error": f"{type(error).__name__}: {error}"[:300]}
    return out


def top_kernels(run: Callable[[], Any], device: torch.device, top: int = 25) -> dict[str, Any]:
    """The ``top`` kernels of one call of ``run`` by device time (on CPU: the ops by self CPU time), named as the
    profiler names them, with their calls and share of the total."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        run()
        sync(device)
    rows = []
    for event in prof.key_averages():
        if cuda:
            # kernels have no children: self and total device time agree (one of them may read 0 on some versions)
            micros = getattr(event, "self_device_time_total", 0) or getattr(event, "device_time_total", 0)
        else:
            micros = event.self_cpu_time_total
        if micros > 0:
            rows.append((event.key, micros / 1e6, event.count))
    total = sum(seconds for _, seconds, _ in rows)
    rows.sort(key=lambda row: -row[1])
    return {"total_s": total, "clock": "device" if cuda else "cpu (self time)",
            "kernels": [{"name": name[:200], "s": seconds, "calls": calls, "share": seconds / total}
                        for name, seconds, calls in rows[:top]]}  # fmt: skip


def _fused_only(stage: LingbotDenoiseStage, session: str, index: int, condition: torch.Tensor) -> bool | str:
    """Whether one more chunk runs with SDPA restricted to its fused kernels (a 3-D or math-path call raises)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    if stage.device.type == "cuda":
        fused.append(SDPBackend.CUDNN_ATTENTION)
    try:
        with sdpa_kernel(fused):
            stage.denoise(session, index, condition, ChunkControl(keys=frozenset("w")))
        return True
    except RuntimeError as error:
        return f"math path: {error}"[:300]


def dit_steady(sizes: Sizes, device: torch.device, attention: list[str]) -> dict[str, Any]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out: dict[str, Any] = {}
    base = DiTConfig.from_name(sizes.dit["v1"])
    model = random_dit(base, device, dtype, seed=0)  # one set of weights for every recipe and kernel
    lat_h, lat_w = sizes.height // 8, sizes.width // 8
    for recipe in ("v1", "v2"):
        cfg = base if recipe == "v1" else replace(base, **sizes.v2_recipe)
        geometry = geometry_of(cfg, sizes.height, sizes.width)
        fill = math.ceil(cfg.kv_window / cfg.chunk_size)  # chunks until the window is full
        for kind in attention:
            name = f"{recipe}_{kind}"
            stage: LingbotDenoiseStage | None = None
            try:
                reset_peak(device)
                # "sdpa" runs as the server's default does (attention = "auto": on CUDA the SDPA kernel timed
                # fastest at these shapes is pinned first), so the number is the one a served session gets
                stage = LingbotDenoiseStage(replace(cfg, attention="auto" if kind == "sdpa" else "sage"), geometry,
                                            device=device, dtype=dtype, weights=model)  # fmt: skip
                g = torch.Generator(device="cpu").manual_seed(1)
                context = torch.randn(cfg.text_len, cfg.text_dim, generator=g)
                condition = torch.randn(geometry.condition_shape, generator=g).to(device)
                before_open = allocated(device)
                stage.open(SessionSpec("bench", 0, ""), context)
                opened_bytes = delta(before_open, device)
                times = chunk_times(stage, "bench", fill + 2, condition, device)
                steady = min(times[-2:])
                flops = chunk_flops(cfg, lat_h, lat_w)["per_chunk"]
                entry: dict[str, Any] = {"chunk_s": times, "steady_s": steady, "pflop_per_chunk": flops / 1e15,
                                         "tflops": flops / steady / 1e12, "peak_gib": peak_gib(device),
                                         "model_peak_gib": dit_model_gib(stage, "bench", sizes.height, sizes.width),
                                         "frames_per_chunk": 4 * cfg.chunk_size,
                                         "kv_cache_gib": stage.kv_cache_bytes(sizes.height, sizes.width) / 2**30,
                                         # one session's caches as the allocator sees them (KV ring, text cache,
                                         # camera state): after open and with the window full
                                         "session_bytes_open": opened_bytes,
                                         "session_bytes_steady": delta(before_open, device),
                                         "session_bytes_computed_kv": stage.kv_cache_bytes(sizes.height, sizes.width)}
                index = fill + 2
                if kind == "sdpa":
                    entry["sdpa_kernel_pinned"] = pinned_backend()
                    entry["fused_kernels_only"] = _fused_only(stage, "bench", index, condition)
                    index += 1
                    if recipe == "v1":
                        entry["top_kernels"] = top_kernels(
                            lambda i=index, st=stage, c=condition: st.denoise("bench", i, c, ChunkControl()), device)
                out[name] = entry
            except Exception as error:
                out[name] = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()[-1500:]}
            finally:  # the next recipe must not run beside this one's KV ring (21 GiB at full size)
                if stage is not None and "bench" in stage.sessions:
                    stage.release("bench")
                del stage
            print(f"  dit {name}: {json.dumps(out[name])[:600]}", flush=True)
    del model
    reset_peak(device)
    return out


def dit_bf16_vs_fp32(device: torch.device) -> dict[str, Any]:
    """The bf16 path against its own float32 path (the golden fixtures judge float32 only): the ``small`` preset,
    one chunk through the real stage with the same weights in both dtypes."""
    cfg = DiTConfig.from_name("small", attention="sdpa")
    geometry = geometry_of(cfg, 240, 416)
    outs = []
    for dtype in (torch.float32, torch.bfloat16):
        stage = LingbotDenoiseStage(cfg, geometry, device=device, dtype=dtype,
                                    weights=random_dit(cfg, device, dtype, seed=3))  # fmt: skip
        g = torch.Generator(device="cpu").manual_seed(4)
        stage.open(SessionSpec("c", 1, ""), torch.randn(cfg.text_len, cfg.text_dim, generator=g))
        outs.append(stage.denoise("c", 0, torch.randn(geometry.condition_shape, generator=g).to(device),
                                  ChunkControl(keys=frozenset("w"))).float())  # fmt: skip
    a, b = outs
    return {"rel_l2": float((a - b).norm() / a.norm()), "max_abs": float((a - b).abs().max())}


def _vae_policy(policy: str, reference: torch.nn.Module, latents: list[torch.Tensor], image: torch.Tensor,
                device: torch.device) -> dict[str, Any]:  # fmt: skip
    """Decode three latent chunks and encode three condition chunks under one precision policy (flags as a rank
    sets them); the last decoded chunk comes back as ``frames`` for the error against strict fp32."""
    from models.vae import WanVAE
    from models.vae_stream import ConditionEncoder, FrameDecoder

    precision.apply(device, policy, holds_vae=True)
    vae = reference
    if policy == "bfloat16":
        vae = WanVAE(reference.cfg).to(device).eval()  # type: ignore[arg-type]
        vae.load_state_dict(reference.state_dict())
        vae = vae.to(torch.bfloat16)
        vae.reset_latent_stats()  # the normalisation constants stay float32
    with torch.no_grad():
        before_decoder = allocated(device)
        reset_peak(device)
        decoder = FrameDecoder(vae)
        decode_times, frames = [], None
        for latent in latents:  # chunk 0, then two steady chunks
            sync(device)
            began = time.perf_counter()
            frames = decoder.decode(latent)
            sync(device)
            decode_times.append(time.perf_counter() - began)
        assert frames is not None
        decode_peak = peak_over(before_decoder, device)
        frames = frames.float().cpu()  # off the device, so the delta below is the decoder's caches alone
        decode_bytes = delta(before_decoder, device)
        before_encoder = allocated(device)
        reset_peak(device)
        encoder = ConditionEncoder(vae, image, 3, constant_tail=False)
        encode_times = []
        for _ in range(3):
            sync(device)
            began = time.perf_counter()
            encoder.next_chunk()
            sync(device)
            encode_times.append(time.perf_counter() - began)
        encode_bytes = delta(before_encoder, device)
        encode_peak = peak_over(before_encoder, device)
    h, w = image.shape[-2:]
    modelled = memory.vae_run_bytes(vae.cfg, next(vae.parameters()).dtype, tuple(latents[0].shape), h, w, 3)
    return {
            # the allocator's peak above what was live before (caches + working set + cuDNN's workspace) beside the
            # memory model's caches + working set and its workspace margin (CUDA): the first GPU run checks both
            "decode_peak_gib": decode_peak, "encode_peak_gib": encode_peak,
            "decode_model_gib": (modelled["decode_cache"] + modelled["decode_working"]) / 2**30,
            "encode_model_gib": (modelled["encode_cache"] + modelled["encode_working"]) / 2**30,
            "workspace_margin_gib": memory.MARGINS.vae_conv_workspace(h, w) / 2**30 if device.type == "cuda" else 0.0,
            "decode_chunk_s": decode_times, "decode_steady_s": min(decode_times[1:]), "encode_chunk_s": encode_times,
            "encode_steady_s": min(encode_times[1:]), "frames": frames,
            # one session's caches: allocator delta (CUDA) and what the caches count themselves
            "decode_session_bytes": decode_bytes, "decode_session_bytes_computed": decoder.nbytes(),
            "encode_session_bytes": encode_bytes, "encode_session_bytes_computed": encoder.nbytes(),
            "conv_tf32": precision.conv_tf32_enabled() if device.type == "cuda" else False}


def vae_policies(sizes: Sizes, device: torch.device) -> dict[str, Any]:
    from models.vae import VAEConfig, WanVAE

    torch.manual_seed(0)
    reference = WanVAE(VAEConfig.preset(sizes.vae)).to(device).eval()
    g = torch.Generator(device="cpu").manual_seed(2)
    latents = [torch.randn(16, 3, sizes.height // 8, sizes.width // 8, generator=g).to(device) for _ in range(3)]
    image = (torch.rand(3, sizes.height, sizes.width, generator=g) * 2 - 1).to(device)
    out: dict[str, Any] = {}
    baseline: torch.Tensor | None = None
    for policy in ("float32", "tf32", "bfloat16"):
        try:
            entry = _vae_policy(policy, reference, latents, image, device)
        except Exception as error:
            entry = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()[-1500:]}
        if "error" not in entry:
            if baseline is None:
                baseline = entry.pop("frames")
            else:
                diff = entry.pop("frames") - baseline
                entry["rel_l2_vs_fp32"] = float(diff.norm() / baseline.norm())
                entry["max_abs_vs_fp32"] = float(diff.abs().max())
        out[policy] = entry
        print(f"  vae {policy}: {json.dumps(entry)[:600]}", flush=True)
    precision.apply(device, "tf32", holds_vae=True)
    return out


def umt5_prompt(sizes: Sizes, device: torch.device) -> dict[str, Any]:
    from models.t5 import T5Config, T5Encoder

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = T5Config.preset(sizes.t5)
    with torch.device("meta"):
        t5 = T5Encoder(cfg)
    t5.to(dtype).to_empty(device=device)
    with torch.no_grad():
        for p in t5.parameters():
            p.normal_(0, 0.02)
    text_len = 16 if sizes.tiny else 512
    ids = torch.randint(2, cfg.vocab, (text_len,), device=device)
    mask = torch.ones(text_len, dtype=torch.int64, device=device)
    reset_peak(device)
    seconds = timed(lambda: t5.context(ids, mask), device, repeat=3)
    return {"prompt_s": seconds, "tokens": text_len, "peak_gib": peak_gib(device)}


def kv_bytes(sizes: Sizes) -> dict[str, Any]:
    """Bytes of one session's KV cache on one DiT rank (bf16) for each layout and recipe, from the sizes alone."""
    out: dict[str, Any] = {}
    fs = (sizes.height // 16) * (sizes.width // 16)
    for recipe, name in sizes.dit.items():
        cfg = DiTConfig.from_name(name)
        for layout, (ranks, _) in LAYOUTS.items():
            heads = math.ceil(cfg.num_heads / ranks)
            nbytes = kv_cache_bytes(cfg.num_layers, cfg.kv_window, fs, heads, cfg.head_dim, torch.bfloat16)
            out[f"{recipe}_{layout}_gib"] = nbytes / 2**30
    return out


def projection(results: dict[str, Any]) -> dict[str, Any]:
    """Projected steady period and FPS per layout, each only from a DiT chunk measured at the layout's own SP degree
    (``dit.v1_sdpa`` for one DiT rank, ``multi_gpu.spN`` for N): never from the one-GPU time divided by N, which
    hides the all-to-alls, the padding and the small-GEMM efficiency. A disaggregated layout (encode and decode on
    GPUs of their own) pipelines the stages: its period is the slowest of DiT, decode and encode. A co-located layout
    runs decode and encode on DiT ranks, so they add to the DiT's time: its period is DiT + decode + encode."""
    vae = results.get("vae", {}).get("tf32", {})
    if "decode_steady_s" not in vae:
        return {"error": "needs vae.tf32 (the layouts' VAE precision)"}
    measured: dict[int, tuple[float, int, str]] = {}  # SP degree -> (chunk seconds, frames per chunk, where from)
    dit = results.get("dit", {}).get("v1_sdpa", {})
    if "steady_s" in dit:
        measured[1] = (dit["steady_s"], dit["frames_per_chunk"], "dit.v1_sdpa")
    for key, entry in results.get("multi_gpu", {}).items():
        if isinstance(entry, dict) and "spN_chunk_s" in entry and entry.get("sp_size") == entry.get("world"):
            measured[entry["sp_size"]] = (entry["spN_chunk_s"], entry["frames_per_chunk"], f"multi_gpu.{key}")
    decode, encode = vae["decode_steady_s"], vae["encode_steady_s"]
    out: dict[str, Any] = {"note": "PROJECTIONS: measured stage times combined per layout, not a measured run of it"}
    for layout, (ranks, colocated) in LAYOUTS.items():
        if ranks not in measured:
            out[layout] = {"projected": False,
                           "why": f"no DiT chunk measured at SP={ranks} ({ranks} GPUs): nothing to project from"}
            continue
        dit_s, frames, source = measured[ranks]
        period = dit_s + decode + encode if colocated else max(dit_s, decode, encode)
        out[layout] = {"projected": True, "dit_s": dit_s, "dit_from": source, "decode_s": decode, "encode_s": encode,
                       "colocated": colocated, "period_s": period, "fps": frames / period}
    out["published_fps"] = PUBLISHED_FPS
    return out


def targets(results: dict[str, Any], peak_tflops: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    dit = results.get("dit", {}).get("v1_sdpa", {})
    if "steady_s" in dit:
        floor = dit["pflop_per_chunk"] * 1e15 / (peak_tflops * 1e12)
        ratio = dit["steady_s"] / floor
        out["dit_v1_over_floor"] = {"value": ratio, "floor_s": floor, "target": TARGETS["dit_v1_over_floor"],
                                    "pass": ratio <= TARGETS["dit_v1_over_floor"]}  # fmt: skip
    vae = results.get("vae", {}).get("tf32", {})
    for key, measured in (("vae_decode_s", "decode_steady_s"), ("vae_encode_s", "encode_steady_s")):
        if measured in vae:
            out[key] = {"value": vae[measured], "target": TARGETS[key], "pass": vae[measured] <= TARGETS[key]}
    split7 = results.get("projection", {}).get("split7", {})
    if "fps" in split7:
        out["split7_fps"] = {"value": split7["fps"], "target": TARGETS["split7_fps"], "projected": True,
                             "pass": split7["fps"] >= TARGETS["split7_fps"]}
    return out


# ------------------------------------------------------------------------------------------------ the server


def start_image(height: int, width: int) -> bytes:
    """PNG bytes of a ``height x width`` gradient: a start image whose size is the stream's, so the served session
    runs at the DiT section's frame size (no resize, no aspect-ratio rounding)."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], -1)
    buf = io.BytesIO()
    Image.fromarray(rgb.astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def serve(tiny: bool, log_path: Path | None = None, chunks: int = 8) -> dict[str, Any]:
    """A short session through the whole runtime on one device (every role on rank 0) at the stream's full size
    (480x832; tiny: 64x96): its first chunk against its steady ones, at the client and per stage on rank 0. The
    server's log (INFO: start-up, CUDA context, each rank's room, the attention table, warm-up times, any rank's
    failure) is kept at ``log_path``, the only place those facts are written."""
    from ipc.client import Client
    from ipc.protocol import to_builtins
    from scripts.local_server import LocalServer

    height, width = (64, 96) if tiny else (480, 832)
    overrides = ["--stream.size=fixed", f"--stream.height={height}", f"--stream.width={width}"]
    overrides += ["--model.preset=tiny"] if tiny else []
    server = LocalServer("single-gpu", overrides, startup_s=900.0, log_path=log_path,
                         env={"WORLDSTREAM_LOG": "INFO"})
    try:
        server.start()
        with Client(server.endpoint) as client:
            began = time.monotonic()
            info = client.open(start_image(height, width), prompt="a walk", seed=1, num_chunks=chunks)
            opened = time.monotonic()
            for index in range(chunks):
                client.control(info.id, index, keys="w")
            results = list(client.chunks(info.id, timeout_s=600))
            summary = client.wait_closed(info.id)
    finally:
        server.__exit__(None, None, None)  # also when SIGTERM lands while the server starts (no ``with`` yet)
    per_chunk = []
    for result in results:
        t = result.facts.times
        per_chunk.append({"index": result.index, "frames": result.facts.frames, "received_s": result.received - opened,
                          "denoise_s": t.denoise_end - t.denoise_start, "decode_s": t.decode_end - t.decode_start,
                          "condition_s": t.condition_ready - (t.condition_start or t.condition_submitted)})
    steady = per_chunk[2:]  # chunk 0 has fewer frames and first-use work; chunk 1 can still queue behind it

    def median(key: str) -> float | None:
        return statistics.median(c[key] for c in steady) if steady else None

    gaps = [b["received_s"] - a["received_s"] for a, b in itertools.pairwise(per_chunk[1:])]
    return {"size": [info.height, info.width], "chunk_indices": [c["index"] for c in per_chunk],
            "server_start_s": server.started_s, "server_log": str(server.log_path), "open_s": opened - began,
            "chunks": per_chunk,
            "first_chunk_s": per_chunk[0]["received_s"] if per_chunk else None,
            "steady_period_s": statistics.median(gaps) if gaps else None,
            "first": {k: per_chunk[0][k] for k in ("denoise_s", "decode_s", "condition_s")} if per_chunk else None,
            "steady": {k: median(k) for k in ("denoise_s", "decode_s", "condition_s")},
            "period_p50_s": summary.chunk_period_s.p50, "summary": to_builtins(summary)}


# ------------------------------------------------------------------------------------------------ main


class TimedOut(Exception):
    """SIGTERM arrived (``timeout`` ended the step's budget)."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise TimedOut("SIGTERM: the step's time budget ran out")


def save(results: dict[str, Any], path: Path) -> None:
    """Write ``results`` whole (to a temporary name first: a kill mid-write keeps the last complete file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str))
    tmp.replace(path)


def run_section(results: dict[str, Any], name: str, fn: Callable[[], Any], out: Path | None = None) -> None:
    began = time.perf_counter()
    interrupted: TimedOut | None = None
    try:  # the header inside: a SIGTERM that lands right after it is still this section's
        print(f"# {name}", flush=True)
        results[name] = fn()
    except TimedOut as error:
        interrupted = error
        results[name] = {"error": f"timed out after {time.perf_counter() - began:.0f} s ({error})"}
    except Exception as error:
        results[name] = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()[-2000:]}
    print(f"  {name} done in {time.perf_counter() - began:.1f} s: {json.dumps(results[name], default=str)[:600]}",
          flush=True)  # fmt: skip
    if out is not None:
        save(results, out)
    if interrupted is not None:
        raise interrupted


SECTIONS = ("matmul", "sdpa", "dit", "split_rank", "dit_bf16_vs_fp32", "vae", "umt5", "kv_cache", "multi_gpu",
            "serve")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (the CPU path; default without CUDA)")
    parser.add_argument("--serve", action="store_true", help="also run a session through the single-GPU server")
    parser.add_argument("--skip", action="append", default=[], choices=SECTIONS, help="a section to skip")
    parser.add_argument("--only", action="append", default=[], choices=SECTIONS, help="run only these sections")
    parser.add_argument("--merge", action="store_true", help="keep the other sections already in --out")
    parser.add_argument("--summary", action="store_true", help="run nothing: projections, targets, table of --out")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")) / "bench_gpu.json")
    args = parser.parse_args(argv)
    # the sections' own INFO lines (the attention table, a compile fallback) reach run.log only through this
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if args.summary:
        if not args.out.exists():
            print(f"no results at {args.out}")
            return 1
        results = json.loads(args.out.read_text())
        finish(results, args.out)
        return 0
    cuda = torch.cuda.is_available()
    sizes = Sizes(args.tiny or not cuda)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(min(4, os.cpu_count() or 1))
    results: dict[str, Any] = json.loads(args.out.read_text()) if args.merge and args.out.exists() else {}
    results.update({"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
                    "sizes": "tiny" if sizes.tiny else "full", "gpus": torch.cuda.device_count()})  # fmt: skip
    attention = ["sdpa"] + (["sage"] if _load_sage() is not None else [])
    plan: dict[str, Callable[[], Any]] = {
        "matmul": lambda: matmul_peak(sizes, device),
        "sdpa": lambda: sdpa_backends(sizes, device),
        "dit": lambda: dit_steady(sizes, device, attention),
        "split_rank": lambda: bench_split_rank.split_rank(sizes, device),
        "dit_bf16_vs_fp32": lambda: dit_bf16_vs_fp32(device),
        "vae": lambda: vae_policies(sizes, device),
        "umt5": lambda: umt5_prompt(sizes, device),
        "kv_cache": lambda: kv_bytes(sizes),
        "multi_gpu": lambda: multi_gpu(sizes),
        "serve": lambda: serve(sizes.tiny, log_path=args.out.parent / "server.log"),
    }
    wanted = set(args.only) if args.only else {n for n in SECTIONS if n != "serve" or args.serve}
    skipped = set()
    if not cuda:
        skipped.add("dit_bf16_vs_fp32")  # bf16 against fp32 means something on CUDA only (and is slow on CPU)
    if not (cuda and torch.cuda.device_count() > 1):
        skipped.add("multi_gpu")
    for name in sorted(wanted & skipped):
        print(f"# {name}: skipped on this machine (needs {'CUDA' if name != 'multi_gpu' else 'several GPUs'})")
    wanted -= skipped
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        for name in SECTIONS:
            if name in wanted and name not in args.skip:
                run_section(results, name, plan[name], args.out)
    except TimedOut:
        print(f"stopped by SIGTERM; the finished sections are in {args.out}", flush=True)
        return 124
    finally:
        signal.signal(signal.SIGTERM, previous)
    return finish(results, args.out) if not args.only else _status(results, set(args.only))


def _status(results: dict[str, Any], names: set[str]) -> int:
    failed = [name for name in names if "error" in results.get(name, {})]
    if failed:
        print(f"sections with errors: {failed}")
    return 1 if failed else 0


def finish(results: dict[str, Any], out: Path) -> int:
    """Projections and targets from whatever sections ``results`` holds, saved, and the table printed."""
    results["projection"] = projection(results)
    peak = results.get("matmul", {}).get("tflops", float("nan"))
    results["targets"] = targets(results, peak)
    save(results, out)
    print(table(results))
    print(f"full results: {out}")
    failed = [name for name, entry in results.items() if isinstance(entry, dict) and "error" in entry]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
