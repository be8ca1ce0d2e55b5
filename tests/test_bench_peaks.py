"""scripts/bench_gpu.py sets the memory model's figures beside the allocator's measured peaks (on CUDA), so the first
GPU run checks the model and its margins: here, on CPU, the model's side is there and agrees with the stage's own
count of its caches."""

from __future__ import annotations

import torch

from models.vae import VAEConfig, WanVAE
from scripts import bench_gpu

torch.set_num_threads(1)


def test_the_vae_entry_carries_the_models_decode_and_encode_bytes_beside_its_peaks() -> None:
    sizes = bench_gpu.Sizes(tiny=True)
    torch.manual_seed(0)
    vae = WanVAE(VAEConfig.preset(sizes.vae)).eval()
    g = torch.Generator().manual_seed(2)
    latents = [torch.randn(16, 3, sizes.height // 8, sizes.width // 8, generator=g) for _ in range(3)]
    image = torch.rand(3, sizes.height, sizes.width, generator=g) * 2 - 1
    entry = bench_gpu._vae_policy("tf32", vae, latents, image, torch.device("cpu"))
    assert entry["decode_peak_gib"] is None and entry["workspace_margin_gib"] == 0.0  # CPU: no allocator peak
    # the model's cache + working set: more than the caches the decoder and encoder count themselves
    assert entry["decode_model_gib"] * 2**30 > entry["decode_session_bytes_computed"] > 0
    assert entry["encode_model_gib"] * 2**30 > entry["encode_session_bytes_computed"] > 0
