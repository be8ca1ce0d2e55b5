"""The GPU benchmark: what a user with GPUs gets, against the physical floor, in one command that fits 10 minutes.

    python scripts/bench_gpu.py                   # on a CUDA machine: full-size model, 480x832, bf16
    python scripts/bench_gpu.py --serve           # also run a short session through the whole server on one GPU
    python scripts/bench_gpu.py --tiny            # the same code path at tiny sizes (CPU), as the tests run it

Measures, on the first device (seeded random weights; the numbers depend on shapes, not on weight values):

- the device's bf16 matmul peak (a large GEMM), which sets the FLOP floor;
- the bf16 DiT against its own float32 path (``small`` preset, one chunk);
- the DiT per chunk at steady state (the KV window full) for the v1 and v2 recipes, SDPA and (when it imports)
  SageAttention: seconds, achieved TFLOP/s, ratio to the floor, peak memory, whether
  the attention ran on fused kernels only, and where the time of one steady v1 chunk went (kernel categories);
- the Wan2.1 VAE per chunk, encode and decode, for each precision policy (strict fp32, TF32 + cudnn.benchmark,
  bf16) with its error against strict fp32;
- umT5-XXL for one 512-token prompt;
- the KV-cache bytes per session per DiT rank for each layout;
- with more than one GPU: the Ulysses all-to-all per layer, SP=N vs SP=1 per pass, and concurrent transfers on two
  NCCL groups per GPU (the pattern of the decode and coordinator ranks);
- projected chunk period and FPS for split7, fast4 and aggregated8 from the measured stage times, marked as
  projections, next to the published 17.07 FPS (7 x H100 split) and 29.5 FPS (8 x H100 aggregated);
- the issue's targets, each with pass/fail.

Prints a table and writes everything to ``$OUT/bench_gpu.json`` (or ``--out``). Every section records its result or
its error; a failing section never stops the others.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models import precision
from models.attention import _load_sage
from models.controls import ChunkControl
from models.dit import DiTConfig, chunk_flops
from models.dit_checkpoint import random_dit
from models.kv_cache import kv_cache_bytes
from models.lingbot_denoise import LingbotDenoiseStage
from models.stages import SessionSpec, StreamGeometry

PUBLISHED_FPS = {"split7 (7 x H100, seed PR)": 17.07, "aggregated8 (8 x H100, FlashDreams)": 29.5}
# layout -> (DiT ranks, whether the VAE roles share GPUs with DiT ranks)
LAYOUTS = {"split7": (5, False), "fast4": (4, True), "aggregated8": (8, True), "single": (1, True)}
TARGETS = {"dit_v1_over_floor": 1.6, "vae_decode_s": 0.25, "vae_encode_s": 0.2, "split7_fps": 25.0}


class Sizes:
    """Full size on CUDA; ``--tiny``: the tiny presets at 32x48 so the CPU path runs in seconds."""

    def __init__(self, tiny: bool) -> None:
        self.tiny = tiny
        self.height, self.width = (32, 48) if tiny else (480, 832)
        self.dit = {"v1": "tiny", "v2": "tiny"} if tiny else {"v1": "lingbot-world-fast-v1",
                                                              "v2": "lingbot-world-fast-v2"}  # fmt: skip
        self.v2_recipe = {"chunk_size": 4, "timestep_indices": (0, 250, 500, 750)}
        self.vae = "tiny" if tiny else "wan2.1"
        self.t5 = "tiny" if tiny else "umt5-xxl"
        self.gemm = 256 if tiny else 8192


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, repeat: int = 3) -> float:
    fn()  # warm-up: kernel selection, autotuning, lazy module loading
    sync(device)
    began = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync(device)
    return (time.perf_counter() - began) / repeat


def peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# ------------------------------------------------------------------------------------------------ sections


def matmul_peak(sizes: Sizes, device: torch.device) -> dict[str, Any]:
    n = sizes.gemm
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    seconds = timed(lambda: a @ b, device, repeat=10)
    return {"n": n, "dtype": str(dtype), "tflops": 2 * n**3 / seconds / 1e12}


def _geometry(cfg: DiTConfig, height: int, width: int) -> StreamGeometry:
    cs, h, w = cfg.chunk_size, height // 8, width // 8
    return StreamGeometry(height=height, width=width, chunk_latent_frames=cs, context_shape=(cfg.text_len,
                          cfg.text_dim), condition_shape=(20, cs, h, w), latent_shape=(16, cs, h, w))  # fmt: skip


def _kernel_shares(run: Callable[[], Any], device: torch.device) -> dict[str, float]:
    """Seconds of device time per kernel category for one call of ``run`` (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        sync(device)
    shares: dict[str, float] = {}
    for event in prof.key_averages():
        name = event.key.lower()
        seconds = getattr(event, "device_time_total", getattr(event, "cuda_time_total", 0.0)) / 1e6
        if seconds <= 0:
            continue
        if any(k in name for k in ("flash", "fmha", "attention", "sdpa", "cudnn_sdp", "sage")):
            kind = "attention"
        elif any(k in name for k in ("gemm", "nvjet", "cutlass", "sm90_xmma", "matmul")):
            kind = "gemm"
        elif "nccl" in name:
            kind = "communication"
        elif any(k in name for k in ("copy", "cat", "memcpy", "index")):
            kind = "copies"
        else:
            kind = "elementwise/norm/other"
        shares[kind] = shares.get(kind, 0.0) + seconds
    return dict(sorted(shares.items(), key=lambda kv: -kv[1]))


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
        geometry = _geometry(cfg, sizes.height, sizes.width)
        fill = math.ceil(cfg.local_attn_size / cfg.chunk_size)  # chunks until the window is full
        for kind in attention:
            name = f"{recipe}_{kind}"
            try:
                reset_peak(device)
                stage = LingbotDenoiseStage(replace(cfg, attention="sdpa" if kind == "sdpa" else "sage"), geometry,
                                            device=device, dtype=dtype, weights=model)  # fmt: skip
                g = torch.Generator(device="cpu").manual_seed(1)
                stage.open(SessionSpec("bench", 0, ""), torch.randn(cfg.text_len, cfg.text_dim, generator=g))
                condition = torch.randn(geometry.condition_shape, generator=g).to(device)
                times = []
                for k in range(fill + 2):
                    sync(device)
                    began = time.perf_counter()
                    stage.denoise("bench", k, condition, ChunkControl(keys=frozenset("wl")))
                    sync(device)
                    times.append(time.perf_counter() - began)
                steady = min(times[-2:])
                flops = chunk_flops(cfg, lat_h, lat_w)["per_chunk"]
                entry: dict[str, Any] = {"chunk_s": times, "steady_s": steady, "pflop_per_chunk": flops / 1e15,
                                         "tflops": flops / steady / 1e12, "peak_gib": peak_gib(device),
                                         "frames_per_chunk": 4 * cfg.chunk_size,
                                         "kv_cache_gib": stage.kv_cache_bytes(sizes.height, sizes.width) / 2**30}
                index = fill + 2
                if kind == "sdpa":
                    entry["fused_kernels_only"] = _fused_only(stage, "bench", index, condition)
                    index += 1
                    if recipe == "v1" and device.type == "cuda":
                        entry["kernel_seconds"] = _kernel_shares(
                            lambda i=index, st=stage, c=condition: st.denoise("bench", i, c, ChunkControl()), device)
                stage.release("bench")
                out[name] = entry
            except Exception as error:
                out[name] = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()[-1500:]}
            print(f"  dit {name}: {json.dumps(out[name])[:300]}", flush=True)
    del model
    reset_peak(device)
    return out


def dit_bf16_vs_fp32(device: torch.device) -> dict[str, Any]:
    """The bf16 path against its own float32 path (the golden fixtures judge float32 only): the ``small`` preset,
    one chunk through the real stage with the same weights in both dtypes."""
    cfg = DiTConfig.from_name("small", attention="sdpa")
    geometry = _geometry(cfg, 240, 416)
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
        decoder = FrameDecoder(vae)
        decode_times, frames = [], None
        for latent in latents:  # chunk 0, then two steady chunks
            sync(device)
            began = time.perf_counter()
            frames = decoder.decode(latent)
            sync(device)
            decode_times.append(time.perf_counter() - began)
        encoder = ConditionEncoder(vae, image, 3, constant_tail=False)
        encode_times = []
        for _ in range(3):
            sync(device)
            began = time.perf_counter()
            encoder.next_chunk()
            sync(device)
            encode_times.append(time.perf_counter() - began)
    assert frames is not None
    return {"decode_chunk_s": decode_times, "decode_steady_s": min(decode_times[1:]), "encode_chunk_s": encode_times,
            "encode_steady_s": min(encode_times[1:]), "frames": frames.float(),
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
        print(f"  vae {policy}: {json.dumps(entry)[:300]}", flush=True)
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
            nbytes = kv_cache_bytes(cfg.num_layers, cfg.local_attn_size, fs, heads, cfg.head_dim, torch.bfloat16)
            out[f"{recipe}_{layout}_gib"] = nbytes / 2**30
    return out


def projection(results: dict[str, Any], alltoall_s_per_pass: float | None) -> dict[str, Any]:
    """Projected steady period and FPS per layout from the measured stage times (marked as projections).

    DiT at SP=N: the measured SP=1 chunk over N (compute scales with the head split) plus the Ulysses all-to-alls
    (measured when several GPUs were present, else stated as 2 x 8 % of a pass at SP=1: bytes of q/k/v and the
    output over NVLink). A disaggregated layout pipelines the stages: period = the slowest of DiT, decode,
    encode. A layout whose VAE roles share GPUs with DiT ranks adds the VAE work to the DiT's critical path."""
    dit = results.get("dit", {}).get("v1_sdpa", {})
    vae = results.get("vae", {}).get("tf32", {})
    if "steady_s" not in dit or "decode_steady_s" not in vae:
        return {"error": "needs dit.v1_sdpa and vae.tf32"}
    passes = 5  # four denoising passes and the refresh pass
    per_pass = dit["steady_s"] / passes
    out: dict[str, Any] = {"note": "PROJECTIONS from one-GPU measurements, not measured multi-GPU runs"}
    for layout, (ranks, colocated) in LAYOUTS.items():
        comm = passes * (alltoall_s_per_pass if alltoall_s_per_pass is not None else 0.16 * per_pass / ranks)
        dit_s = dit["steady_s"] / ranks + (comm if ranks > 1 else 0.0)
        vae_s = max(vae["decode_steady_s"], vae["encode_steady_s"])
        period = dit_s + vae_s if colocated else max(dit_s, vae["decode_steady_s"], vae["encode_steady_s"])
        out[layout] = {"dit_s": dit_s, "period_s": period, "fps": dit["frames_per_chunk"] / period,
                       "alltoall": "measured" if alltoall_s_per_pass is not None else "stated"}
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


# ------------------------------------------------------------------------------------------------ several GPUs


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _multi_gpu_worker(rank: int, world: int, port: int, sizes_tiny: bool, out_dir: str) -> None:
    import torch.distributed as dist

    from models.dit import apply_sequence_parallel
    from models.ulysses import Ulysses

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    result: dict[str, Any] = {}
    sizes = Sizes(sizes_tiny)
    cfg = DiTConfig.from_name(sizes.dit["v1"])
    fs = (sizes.height // 16) * (sizes.width // 16)
    n = cfg.chunk_size * fs
    sp = Ulysses(dist.group.WORLD)
    local = -(-n // world)
    q = torch.randn(local, cfg.num_heads, cfg.head_dim, device=device, dtype=torch.bfloat16)
    a2a = timed(lambda: (sp.heads_to_seq(sp.qkv_to_heads(q, q, q, n)[0])), device, repeat=10)
    result["alltoall_s_per_layer"] = a2a
    # SP=N vs SP=1 per pass of the real model (same seeded weights on every rank)
    model = apply_sequence_parallel(random_dit(cfg, device, torch.bfloat16, seed=0), dist.group.WORLD)
    stage = LingbotDenoiseStage(replace(cfg, attention="sdpa"), _geometry(cfg, sizes.height, sizes.width),
                                device=device, dtype=torch.bfloat16, weights=model)  # fmt: skip
    g = torch.Generator(device="cpu").manual_seed(1)
    stage.open(SessionSpec("b", 0, ""), torch.randn(cfg.text_len, cfg.text_dim, generator=g))
    cond = torch.randn(20, cfg.chunk_size, sizes.height // 8, sizes.width // 8, generator=g).to(device)
    fill = math.ceil(cfg.local_attn_size / cfg.chunk_size)
    times = []
    for k in range(fill + 2):
        dist.barrier()
        began = time.perf_counter()
        stage.denoise("b", k, cond, ChunkControl(keys=frozenset("w")))
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - began)
    result["spN_chunk_s"] = min(times[-2:])
    # two NCCL groups per GPU used from two threads at once (the decode and coordinator ranks' pattern)
    if world >= 2:
        result["concurrent_groups"] = _concurrent_groups(rank, device)
    if rank == 0:
        (Path(out_dir) / "multi.json").write_text(json.dumps({"world": world, **result}))
    dist.barrier()
    dist.destroy_process_group()


def _concurrent_groups(rank: int, device: torch.device, rounds: int = 200) -> dict[str, Any]:
    """Ranks 0 and 1: on group A rank 0 sends to rank 1 while on group B rank 1 sends to rank 0, each from its own
    thread and stream, as the coordinator (frames in, conditions out) and decode ranks (latents in, frames out)
    do. A deadlock shows as the group timeout."""
    import datetime

    import torch.distributed as dist

    world = dist.get_world_size()
    timeout = datetime.timedelta(seconds=60)
    group_a = dist.new_group([0, 1], timeout=timeout)
    group_b = dist.new_group([0, 1], timeout=timeout)
    if rank > 1:
        return {}
    errors: list[str] = []
    tensor_a = torch.ones(1 << 20, device=device)
    tensor_b = torch.ones(1 << 18, device=device)

    def edge(group: Any, buf: torch.Tensor, sender: int) -> None:
        torch.cuda.set_device(device)
        stream = torch.cuda.Stream(device)
        try:
            with torch.cuda.stream(stream):
                for _ in range(rounds):
                    if rank == sender:
                        dist.send(buf, dst=1 - rank, group=group)
                    else:
                        dist.recv(buf, src=1 - rank, group=group)
                stream.synchronize()
        except Exception as error:
            errors.append(f"{type(error).__name__}: {error}")

    began = time.perf_counter()
    threads = [threading.Thread(target=edge, args=(group_a, tensor_a, 0)),
               threading.Thread(target=edge, args=(group_b, tensor_b, 1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"rounds": rounds, "seconds": time.perf_counter() - began, "errors": errors, "world": world}


def multi_gpu(sizes: Sizes) -> dict[str, Any]:
    import tempfile

    import torch.multiprocessing as mp

    world = torch.cuda.device_count()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_multi_gpu_worker, args=(world, _free_port(), sizes.tiny, tmp), nprocs=world, join=True)
        return json.loads((Path(tmp) / "multi.json").read_text())


# ------------------------------------------------------------------------------------------------ the server


def serve(tiny: bool, chunks: int = 8) -> dict[str, Any]:
    """A short session through the whole runtime on one device (every role on rank 0): the chunk period."""
    from ipc.client import Client
    from scripts.local_server import ROOT, LocalServer

    overrides = ["--model.preset=tiny", "--stream.height=64", "--stream.width=96"] if tiny else []
    image = (ROOT / "assets" / "start.png").read_bytes()
    with LocalServer("single-gpu", overrides, startup_s=900.0) as server, Client(server.endpoint) as client:
        info = client.open(image, prompt="a walk", seed=1, num_chunks=chunks)
        for index in range(chunks):
            client.control(info.id, index, keys="w")
        received = [chunk.index for chunk in client.chunks(info.id, timeout_s=600)]
        summary = client.wait_closed(info.id)
    return {"chunk_indices": received, "summary": summary, "server_start_s": server.started_s,
            "period_p50_s": summary.get("chunk_period_s", {}).get("p50")}


# ------------------------------------------------------------------------------------------------ main


def run_section(results: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    print(f"# {name}", flush=True)
    began = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as error:
        results[name] = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()[-2000:]}
    print(f"  {name} done in {time.perf_counter() - began:.1f} s: {json.dumps(results[name])[:400]}", flush=True)


def table(results: dict[str, Any]) -> str:
    lines = [f"device: {results['device']}  torch {results['torch']}  matmul peak "
             f"{results.get('matmul', {}).get('tflops', float('nan')):.0f} TFLOP/s"]
    for name, entry in results.get("dit", {}).items():
        if "steady_s" in entry:
            lines.append(f"DiT {name:18s} steady {entry['steady_s']:.3f} s/chunk  {entry['tflops']:.0f} TFLOP/s  "
                         f"peak {entry['peak_gib']:.1f} GiB  fused-only {entry.get('fused_kernels_only', '-')}")
        else:
            lines.append(f"DiT {name:18s} {entry.get('error', '?')[:100]}")
    for name, entry in results.get("vae", {}).items():
        if "decode_steady_s" in entry:
            err = f"rel L2 {entry['rel_l2_vs_fp32']:.4f}" if "rel_l2_vs_fp32" in entry else "reference"
            lines.append(f"VAE {name:9s} decode {entry['decode_steady_s']:.3f} s  encode {entry['encode_steady_s']:.3f}"
                         f" s  ({err})")
    if "prompt_s" in results.get("umt5", {}):
        lines.append(f"umT5 prompt {results['umt5']['prompt_s']:.3f} s")
    for layout, entry in results.get("projection", {}).items():
        if isinstance(entry, dict) and "fps" in entry:
            lines.append(f"PROJECTED {layout:11s} period {entry['period_s']:.3f} s  {entry['fps']:.1f} FPS "
                         f"(all-to-all {entry['alltoall']})")
    for key, entry in results.get("targets", {}).items():
        lines.append(f"target {key:18s} {entry['value']:.3f} vs {entry['target']}  "
                     f"{'PASS' if entry['pass'] else 'FAIL'}{' (projected)' if entry.get('projected') else ''}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (the CPU path; default without CUDA)")
    parser.add_argument("--serve", action="store_true", help="also run a session through the single-GPU server")
    parser.add_argument("--skip", action="append", default=[], help="a section to skip (dit, vae, umt5, multi)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")) / "bench_gpu.json")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    sizes = Sizes(args.tiny or not cuda)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(min(4, os.cpu_count() or 1))
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
                               "sizes": "tiny" if sizes.tiny else "full", "gpus": torch.cuda.device_count()}
    run_section(results, "matmul", lambda: matmul_peak(sizes, device))
    attention = ["sdpa"] + (["sage"] if _load_sage() is not None else [])
    if "dit" not in args.skip:
        run_section(results, "dit", lambda: dit_steady(sizes, device, attention))
        if cuda:
            run_section(results, "dit_bf16_vs_fp32", lambda: dit_bf16_vs_fp32(device))
    if "vae" not in args.skip:
        run_section(results, "vae", lambda: vae_policies(sizes, device))
    if "umt5" not in args.skip:
        run_section(results, "umt5", lambda: umt5_prompt(sizes, device))
    run_section(results, "kv_cache", lambda: kv_bytes(sizes))
    alltoall = None
    if cuda and torch.cuda.device_count() > 1 and "multi" not in args.skip:
        run_section(results, "multi_gpu", lambda: multi_gpu(sizes))
        alltoall = results["multi_gpu"].get("alltoall_s_per_layer")
        if alltoall is not None:
            alltoall *= DiTConfig.from_name(sizes.dit["v1"]).num_layers
    run_section(results, "projection", lambda: projection(results, alltoall))
    peak = results.get("matmul", {}).get("tflops", float("nan"))
    results["targets"] = targets(results, peak)
    if args.serve:
        run_section(results, "serve", lambda: serve(sizes.tiny))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, default=str))
    print(table(results))
    print(f"full results: {args.out}")
    failed = [name for name, entry in results.items() if isinstance(entry, dict) and "error" in entry]
    if failed:
        print(f"sections with errors: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
