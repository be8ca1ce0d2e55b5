"""Golden conformance of the umT5 encoder, the VAE condition encoding and the streaming VAE decode.

``checks(fixture_dir)`` yields ``(expected tensor name, actual, expected)`` for one fixture directory; every size
comes from its ``config.json``. Yielded names (a name may repeat, e.g. the frames of the stage path):

- ``t5_encoder_out_full``, ``t5_context``: the encoder on ``inputs.text_ids``/``text_mask``;
- ``vae_cond_latent``: whole-clip causal encode of ``[image, zeros...]``, then the streaming encoder's chunks;
- ``y``: mask + latent, whole clip, then chunk by chunk through ``LingbotConditionStage`` (the image from
  ``image_u8_hwc``);
- ``frames_c<k>``: ``latents_all`` decoded chunk by chunk with one persistent cache, then through
  ``LingbotDecodeStage.decode_float`` (the uint8 wire conversion is checked in ``tests/test_vae_t5_golden.py``).

``scripts/check_golden.py`` compares them (one bound for every module).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file

from models.checkpoints import load_t5, load_vae
from models.lingbot_vae_stages import MASK_CHANNELS, LingbotConditionStage, LingbotDecodeStage
from models.stages import SessionSpec
from models.t5 import T5Config
from models.vae import VAEConfig
from models.vae_stream import ConditionEncoder, FrameDecoder


def checks(fixture_dir: Path) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    fixture_dir = Path(fixture_dir)
    cfg = json.loads((fixture_dir / "config.json").read_text())
    inputs = load_file(str(fixture_dir / "inputs.safetensors"))
    expected = load_file(str(fixture_dir / "expected.safetensors"))
    stream = cfg["stream"]
    cs, num_chunks = int(stream["chunk_size"]), int(stream["num_chunks"])
    with torch.no_grad():
        yield from _t5_checks(fixture_dir, cfg, inputs, expected)
        vae = load_vae(fixture_dir / "vae.safetensors", VAEConfig.from_fixture(cfg["vae"]))
        yield from _condition_checks(vae, cs, num_chunks, int(stream["num_video_frames"]), inputs, expected)
        yield from _decode_checks(vae, cs, num_chunks, expected)
        yield from _stage_checks(fixture_dir, cfg, vae, cs, num_chunks, inputs, expected)


Check = tuple[str, torch.Tensor, torch.Tensor]  # (expected tensor name, actual, expected)


def _t5_checks(fixture_dir: Path, cfg: dict, inputs: dict, expected: dict) -> Iterator[Check]:
    t5 = load_t5(fixture_dir / "t5.safetensors", T5Config.from_fixture(cfg["t5"]), dtype=torch.float32)
    ids, mask = inputs["text_ids"], inputs["text_mask"]  # [1, T]
    yield "t5_encoder_out_full", t5(ids, mask)[0], expected["t5_encoder_out_full"]
    yield "t5_context", t5.context(ids[0], mask[0]), expected["t5_context"]


def _condition_checks(vae: torch.nn.Module, cs: int, num_chunks: int, num_video_frames: int, inputs: dict,
                      expected: dict) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:  # fmt: skip
    image = inputs["image"]  # [3, H, W] in [-1, 1]
    video = torch.zeros(1, 3, num_video_frames, *image.shape[1:])
    video[0, :, 0] = image
    latent = vae.encode(video)[0]  # [16, F, h, w]: the whole clip in one call
    yield "vae_cond_latent", latent, expected["vae_cond_latent"]
    mask = torch.zeros(MASK_CHANNELS, *latent.shape[1:])
    mask[:, 0] = 1.0
    yield "y", torch.cat([mask, latent]), expected["y"]
    encoder = ConditionEncoder(vae, image, cs)
    streamed = torch.cat([encoder.next_chunk() for _ in range(num_chunks)], 1)
    yield "vae_cond_latent", streamed, expected["vae_cond_latent"]


def _decode_checks(vae: torch.nn.Module, cs: int, num_chunks: int,
                   expected: dict) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:  # fmt: skip
    decoder = FrameDecoder(vae)
    latents = expected["latents_all"]  # [16, F, h, w]
    for k in range(num_chunks):
        yield f"frames_c{k}", decoder.decode(latents[:, k * cs : (k + 1) * cs]), expected[f"frames_c{k}"]


def _stage_checks(fixture_dir: Path, cfg: dict, vae: torch.nn.Module, cs: int, num_chunks: int, inputs: dict,
                  expected: dict) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:  # fmt: skip
    """End to end through the stage interface, with the fixture's token ids fed through the tokenizer hook."""
    t5 = load_t5(fixture_dir / "t5.safetensors", T5Config.from_fixture(cfg["t5"]), dtype=torch.float32)
    ids, mask = inputs["text_ids"][0], inputs["text_mask"][0]
    condition = LingbotConditionStage(vae, t5, lambda _prompt: (ids, mask), cs)
    context = condition.open(SessionSpec(session="golden", seed=0, prompt="fixture", image=inputs["image_u8_hwc"]))
    length = int(mask.sum())
    assert not context[length:].any(), "the prompt context must be zero-padded after the valid rows"
    yield "t5_context", context[:length], expected["t5_context"]
    y = torch.cat([condition.encode("golden", k) for k in range(num_chunks)], 1)
    yield "y", y, expected["y"]
    condition.release("golden")
    decode = LingbotDecodeStage(vae)
    decode.open(SessionSpec(session="golden", seed=0, prompt=""))
    latents = expected["latents_all"]
    for k in range(num_chunks):
        frames = decode.decode_float("golden", k, latents[:, k * cs : (k + 1) * cs])
        yield f"frames_c{k}", frames, expected[f"frames_c{k}"]
    decode.release("golden")
