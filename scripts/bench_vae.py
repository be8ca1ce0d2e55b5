"""Benchmark: streaming VAE encode/decode per chunk vs whole-clip, and FLOPs per chunk at 480x832.

For the ``tiny`` and ``small`` presets (random weights, CPU, one thread by default) it times

- whole-clip encode of ``[image, black ...]`` (K chunks of cs latent frames) vs the streaming condition encoder
  chunk by chunk (with the constant-tail shortcut off, so every chunk does real work), plus the cost of a chunk
  once the constant tail was reached;
- whole-clip decode of K*cs latent frames vs the streaming decoder chunk by chunk.

It also counts the FLOPs per chunk of the full-size ``wan2.1`` preset at 480x832 (meta device, no compute), for
the first chunk and a steady-state chunk. Results go to ``$OUT/bench_vae.json``; ratios are printed.

Usage: ``python -m scripts.bench_vae [--chunk-size 3] [--chunks 3] [--threads 1] [--out FILE] [--smoke]``
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file too, not only with -m

from models.vae import VAEConfig, WanVAE, decode_flops, encode_flops
from models.vae_stream import ConditionEncoder, FrameDecoder
from scripts.bench_json import out_path, parse_args, write_json

SIZES = {"tiny": (64, 96), "small": (32, 48)}  # CPU-friendly frame sizes per preset (H, W)


def _timed(fn: Callable[[], object], repeat: int = 2) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _stream_times(make_step: Callable[[], Callable[[int], object]], chunks: int, repeat: int = 2) -> list[float]:
    """Per-chunk seconds of a fresh stream, the minimum over ``repeat`` streams (as ``_timed`` for whole clips)."""
    best = [float("inf")] * chunks
    for _ in range(repeat):
        step = make_step()
        for k in range(chunks):
            start = time.perf_counter()
            step(k)
            best[k] = min(best[k], time.perf_counter() - start)
    return best


@torch.no_grad()
def bench_preset(name: str, cs: int, chunks: int) -> dict[str, object]:
    torch.manual_seed(0)
    cfg = VAEConfig.preset(name)
    vae = WanVAE(cfg).eval()
    height, width = SIZES[name]
    image = torch.rand(3, height, width) * 2 - 1
    frames = 1 + 4 * (cs * chunks - 1)
    video = torch.zeros(1, 3, frames, height, width)
    video[0, :, 0] = image
    whole_enc = _timed(lambda: vae.encode(video))
    def encode_step() -> Callable[[int], object]:
        enc = ConditionEncoder(vae, image, cs, constant_tail=False)
        return lambda _k: enc.next_chunk()

    enc_chunks = _stream_times(encode_step, chunks)

    frozen = ConditionEncoder(vae, image, cs, constant_tail=True)
    warm = 0
    while not frozen.frozen and warm < 64:
        frozen.next_chunk()
        warm += 1
    tail = _timed(frozen.next_chunk, repeat=5) if frozen.frozen else None

    latents = torch.randn(1, cfg.z_dim, cs * chunks, height // 8, width // 8)
    whole_dec = _timed(lambda: vae.decode(latents))
    def decode_step() -> Callable[[int], object]:
        dec = FrameDecoder(vae)
        return lambda k: dec.decode(latents[0, :, k * cs : (k + 1) * cs])

    dec_chunks = _stream_times(decode_step, chunks)
    return {
        "preset": name, "height": height, "width": width, "chunk_latent_frames": cs, "chunks": chunks,
        "encode_whole_clip_s": whole_enc, "encode_stream_chunk_s": enc_chunks,
        "encode_stream_over_whole": sum(enc_chunks) / whole_enc,
        "encode_chunks_until_constant_tail": warm if frozen.frozen else None,
        "encode_constant_tail_chunk_s": tail,
        "decode_whole_clip_s": whole_dec, "decode_stream_chunk_s": dec_chunks,
        "decode_stream_over_whole": sum(dec_chunks) / whole_dec,
    }  # fmt: skip


def flops_at_480p(cs: int) -> dict[str, float]:
    cfg = VAEConfig.preset("wan2.1")
    h, w = 480, 832
    return {
        "encode_first_chunk": encode_flops(cfg, 1 + 4 * (cs - 1), h, w, first=True),
        "encode_steady_chunk": encode_flops(cfg, 4 * cs, h, w, first=False),
        "decode_first_chunk": decode_flops(cfg, cs, h, w, first=True),
        "decode_steady_chunk": decode_flops(cfg, cs, h, w, first=False),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunk-size", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--out", type=Path, default=out_path("bench_vae.json"))
    args = parse_args(parser, argv, {"chunks": 2, "chunk_size": 1, "presets": "tiny"})
    torch.set_num_threads(args.threads)
    results = [bench_preset(p, args.chunk_size, args.chunks) for p in args.presets.split(",")]
    flops = {f"cs{cs}": flops_at_480p(cs) for cs in sorted({3, 4, args.chunk_size})}
    for r in results:
        tail = r["encode_constant_tail_chunk_s"]
        print(f"{r['preset']:6s} {r['height']}x{r['width']} cs={r['chunk_latent_frames']}: "
              f"encode stream/whole = {r['encode_stream_over_whole']:.2f} "
              f"(chunks {', '.join(f'{t * 1e3:.0f}' for t in r['encode_stream_chunk_s'])} ms; "
              f"constant tail after {r['encode_chunks_until_constant_tail']} chunks, then "
              f"{(tail or 0) * 1e6:.0f} us/chunk), decode stream/whole = {r['decode_stream_over_whole']:.2f} "
              f"(chunks {', '.join(f'{t * 1e3:.0f}' for t in r['decode_stream_chunk_s'])} ms)")  # fmt: skip
    for key, f in flops.items():
        print(f"wan2.1 480x832 {key}: " + ", ".join(f"{k} {v / 1e12:.2f} TFLOP" for k, v in f.items()))
    write_json(args.out, {"threads": args.threads, "presets": results, "flops_480x832": flops}, smoke=args.smoke)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
