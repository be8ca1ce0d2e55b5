"""The real LingBot-World-Fast path across 7 ranks (umT5 + VAE encode on rank 0, Ulysses DiT on ranks 2-6,
VAE decode on rank 1) equals the same stages run in one process, chunk by chunk."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ipc.client import Client
from models.camera import intrinsics_at
from models.controls import ChunkControl
from models.stages import SessionSpec, run_in_process
from runtime import config as config_mod
from runtime.images import decode_image
from scripts.local_server import ROOT, LocalServer

pytestmark = pytest.mark.multiprocess

IMAGE = (ROOT / "assets" / "start.png").read_bytes()
KEYS = ["w", "wl", "d"]
CAMERA = (520.0, 520.0, 416.0, 240.0)  # not the server's default: the session's own camera must reach every DiT rank


def one_process_reference(prompt: str, seed: int) -> list[np.ndarray]:
    from models import lingbot

    cfg = config_mod.load("cpu-tiny-model")
    device = torch.device("cpu")
    condition = lingbot.build_condition(cfg.model, cfg.stream, device)
    denoise = lingbot.build_denoise(cfg.model, cfg.stream, cfg.controls, device, None)
    decode = lingbot.build_decode(cfg.model, cfg.stream, device)
    raw = decode_image(IMAGE, cfg.server.max_image_pixels)  # at its own size: the condition stage resizes it
    image = torch.frombuffer(bytearray(raw.pixels), dtype=torch.uint8).view(raw.height, raw.width, 3)
    controls = [ChunkControl(keys=frozenset(keys)) for keys in KEYS]
    spec = SessionSpec("ref", seed, prompt, image, cfg.stream.height, cfg.stream.width, CAMERA)
    frames = run_in_process(condition, denoise, decode, spec, controls)
    return [f.numpy() for f in frames]


def test_seven_rank_real_model_stream_matches_the_one_process_stages() -> None:
    torch.set_num_threads(1)
    with LocalServer("cpu-tiny-model") as server, Client(server.endpoint) as client:
        info = client.open(IMAGE, prompt="a red house", seed=5, num_chunks=len(KEYS), intrinsics=CAMERA)
        for index, keys in enumerate(KEYS):
            client.control(info.id, index, keys=keys)
        chunks = list(client.chunks(info.id, timeout_s=120))
        summary = client.wait_closed(info.id)
    assert [c.frames.shape for c in chunks] == [(9, 64, 96, 3), (12, 64, 96, 3), (12, 64, 96, 3)]
    assert summary.reason == "complete"
    assert info.intrinsics == intrinsics_at(CAMERA, 64, 96)
    reference = one_process_reference("a red house", 5)
    assert len(reference) == len(chunks) == len(KEYS)
    for got, want in zip(chunks, reference, strict=True):
        # Ulysses over 5 ranks vs one process: float32 sums in another order, at most one uint8 level apart
        assert np.abs(got.frames.astype(int) - want.astype(int)).max() <= 1
    assert not np.array_equal(chunks[1].frames, chunks[2].frames)
