"""Checkpoints laid out exactly as the v1 and v2 releases are (at tiny sizes) load through the same config path as
split7 and stream through the real 7-rank pipeline.

v1: the fast DiT is ``lingbot_world_fast/`` of the base-cam download, beside the base model's two experts, with
``model-000NN-of-000MM.safetensors`` shards, their index and a released-style ``config.json`` (``local_attn_size``
-1, ``sink_size`` 0, keys the official class ignores); VAE, umT5 and tokenizer in the same download. v2: the DiT is
``transformers/`` with 8 shards; VAE, umT5 and tokenizer come from a second download (``model.components_dir``).
``.pth`` files are written the way the official code writes them (``torch.save`` of the state dict, umT5 in bf16).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ipc.client import Client
from models.controls import ChunkControl, motion_speeds
from models.dit_checkpoint import random_dit, save_dit
from models.dit_config import DiTConfig
from models.schedule import FlowMatchSchedule
from models.stages import SessionSpec, run_in_process
from models.t5 import T5Config, T5Encoder
from models.vae import VAEConfig, WanVAE
from runtime import config as config_mod
from runtime.images import decode_image
from scripts.local_server import ROOT, LocalServer
from tests.test_dit_checkpoint import RELEASED_KEYS
from tests.test_tokenizer import write_umt5_like_tokenizer

IMAGE = (ROOT / "assets" / "start.png").read_bytes()
KEYS = ["w", "wl", "d"]
PROMPT = "“a lake” at dawn"
TINY_DIT = DiTConfig.from_name("tiny")  # 5 heads: divisible by split7's 5 DiT ranks
T5_CFG = T5Config(vocab=320, dim=TINY_DIT.text_dim, dim_attn=32, dim_ffn=64, num_heads=4, num_layers=2)
CPU = ["--layout.backend=gloo", "--stream.size=fixed", "--stream.height=64", "--stream.width=96",
       "--model.dtype=float32", "--model.vae_dtype=float32", "--timeouts.startup_s=300"]  # fmt: skip


def _components(folder: Path) -> None:
    """VAE, umT5 and tokenizer as the Wan2.2 / base-cam downloads carry them."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(1)
    torch.save(WanVAE(VAEConfig.preset("tiny")).state_dict(), folder / "Wan2.1_VAE.pth")
    t5 = {k: v.to(torch.bfloat16) for k, v in T5Encoder(T5_CFG).state_dict().items()}
    torch.save(t5, folder / "models_t5_umt5-xxl-enc-bf16.pth")
    write_umt5_like_tokenizer(folder / "google" / "umt5-xxl")


def _dit(folder: Path, seed: int, shards: int) -> None:
    model = random_dit(TINY_DIT, "cpu", torch.float32, seed=seed)
    save_dit(model, folder, num_shards=shards, shard_name="model-{i:05d}-of-{n:05d}.safetensors",
             index_name="model.safetensors.index.json", extra_config=RELEASED_KEYS)  # fmt: skip


@pytest.fixture(scope="module")
def releases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("releases")
    base = root / "lingbot-world-base-cam"
    _dit(base / "lingbot_world_fast", seed=7, shards=4)
    _dit(base / "high_noise_model", seed=8, shards=2)  # the base model's experts: must not be picked
    _dit(base / "low_noise_model", seed=9, shards=2)
    _components(base)
    v2 = root / "lingbot-world-v2-14b-causal-fast"
    _dit(v2 / "transformers", seed=10, shards=8)
    _components(root / "Wan2.2-I2V-A14B")
    return {"v1": base, "v2": v2, "components": root / "Wan2.2-I2V-A14B"}


def test_the_layouts_are_what_the_releases_ship(releases: dict[str, Path]) -> None:
    fast = releases["v1"] / "lingbot_world_fast"
    assert len(list(fast.glob("model-*-of-*.safetensors"))) == 4
    assert len(list((releases["v2"] / "transformers").glob("model-*-of-00008.safetensors"))) == 8
    config = json.loads((fast / "config.json").read_text())
    assert (config["local_attn_size"], config["sink_size"], config["window_size"]) == (-1, 0, [-1, -1])


def _overrides(releases: dict[str, Path], version: str) -> list[str]:
    if version == "v1":
        return [*CPU, f"--model.checkpoint_dir={json.dumps(str(releases['v1']))}"]
    return [*CPU, "--model.preset=v2", "--stream.chunk_latent_frames=4",
            f"--model.checkpoint_dir={json.dumps(str(releases['v2']))}",
            f"--model.components_dir={json.dumps(str(releases['components']))}"]  # fmt: skip


def _one_process(overrides: list[str], dit_dir: Path, seed: int) -> list[np.ndarray]:
    """The same session in one process, with the DiT loaded explicitly from ``dit_dir`` (not through the resolver,
    so a server that picked another folder's weights disagrees)."""
    from models import lingbot, lingbot_config
    from models.lingbot_denoise import LingbotDenoiseStage

    cfg = config_mod.load("split7-h100", overrides)
    device = torch.device("cpu")
    denoise = LingbotDenoiseStage(lingbot_config.dit_config(cfg.model, cfg.stream),
                                  lingbot_config.lingbot_geometry(cfg.model, cfg.stream), weights=dit_dir,
                                  speeds=motion_speeds(cfg.controls))  # fmt: skip
    stages = (lingbot.build_condition(cfg.model, cfg.stream, device), denoise,
              lingbot.build_decode(cfg.model, cfg.stream, device))  # fmt: skip
    raw = decode_image(IMAGE, cfg.server.max_image_pixels)  # at its own size: the condition stage resizes it
    image = torch.frombuffer(bytearray(raw.pixels), dtype=torch.uint8).view(raw.height, raw.width, 3)
    controls = [ChunkControl(keys=frozenset(k)) for k in KEYS]
    spec = SessionSpec("ref", seed, PROMPT, image, cfg.stream.height, cfg.stream.width)
    return [f.numpy() for f in run_in_process(*stages, spec, controls)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_released_layout_streams_through_the_split7_config_path(releases: dict[str, Path], version: str) -> None:
    torch.set_num_threads(1)
    overrides = _overrides(releases, version)
    with LocalServer("split7-h100", overrides, startup_s=300) as server, Client(server.endpoint) as client:
        info = client.open(IMAGE, prompt=PROMPT, seed=3, num_chunks=len(KEYS))
        for index, keys in enumerate(KEYS):
            client.control(info.id, index, keys=keys)
        chunks = list(client.chunks(info.id, timeout_s=180))
        summary = client.wait_closed(info.id)
        log = server.log_path.read_text(errors="replace")
    cs = 3 if version == "v1" else 4
    assert summary.reason == "complete"
    assert [c.frames.shape for c in chunks] == [(1 + 4 * (cs - 1), 64, 96, 3)] + [(4 * cs, 64, 96, 3)] * 2
    # the recipe the DiT ranks actually run, from their own start-up line
    indices = (0, 179, 358, 679) if version == "v1" else (0, 250, 500, 750)
    timesteps = [s.timestep for s in FlowMatchSchedule.build(10.0).steps(indices)]
    if version == "v2":
        assert timesteps == [999, 967, 908, 768]
    assert log.count(f"chunks of {cs} latent frames, timesteps {timesteps}, KV window 18 latent frames (rolling, 6 "
                     "sink)") == 5, log[-3000:]
    # the weights are the released DiT folder's (not an expert's): the same stream in one process from that folder
    dit_dir = releases["v1"] / "lingbot_world_fast" if version == "v1" else releases["v2"] / "transformers"
    reference = _one_process(overrides, dit_dir, seed=3)
    assert len(reference) == len(chunks)
    for got, want in zip(chunks, reference, strict=True):
        assert np.abs(got.frames.astype(int) - want.astype(int)).max() <= 1
