"""Golden conformance end to end: from the fixture's raw inputs only (start image bytes, token ids, camera poses,
stored noise) through every stage of this project to the clean latents and the decoded frames.

The other golden checks feed each network the fixture's own intermediate tensors (``dit_y``, ``dit_context``,
``control_c<k>``, ``latents_all``); this one chains the project's own outputs, so an error that only shows when
the stages are composed (a layout, dtype or slicing mismatch at a boundary) is caught too.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file

from models.camera import clip_control
from models.checkpoints import load_t5, load_vae
from models.kv_cache import new_kv_cache
from models.lingbot_denoise import denoise_chunk
from models.lingbot_vae_stages import LingbotConditionStage, LingbotDecodeStage
from models.schedule import FlowMatchSchedule
from models.stages import SessionSpec
from models.t5 import T5Config
from models.vae import VAEConfig
from scripts.golden_dit import FixtureNoise, load_model

Check = tuple[str, torch.Tensor, torch.Tensor]


def checks(fixture_dir: Path, compile: str = "off") -> Iterator[Check]:
    fixture_dir = Path(fixture_dir)
    config = json.loads((fixture_dir / "config.json").read_text())
    stream = config["stream"]
    inputs = load_file(str(fixture_dir / "inputs.safetensors"))
    expected = load_file(str(fixture_dir / "expected.safetensors"))
    cs, chunks = stream["chunk_size"], stream["num_chunks"]
    height, width = stream["image_height"], stream["image_width"]

    vae = load_vae(fixture_dir / "vae.safetensors", VAEConfig.from_fixture(config["vae"]))
    t5 = load_t5(fixture_dir / "t5.safetensors", T5Config.from_fixture(config["t5"]), dtype=torch.float32)
    ids, mask = inputs["text_ids"][0], inputs["text_mask"][0]
    condition = LingbotConditionStage(vae, t5, lambda _prompt: (ids, mask), cs)
    context = condition.open(SessionSpec(session="e2e", seed=0, prompt="", image=inputs["image_u8_hwc"]))
    control = clip_control(inputs["c2w"], inputs["intrinsics"], height, width, stream["lat_f"])["plucker_from_poses"]

    model = load_model(fixture_dir, compile)
    cfg = model.cfg
    steps = FlowMatchSchedule.build(cfg.shift, cfg.num_train_timesteps).steps(cfg.timestep_indices)
    cache = new_kv_cache(cfg, stream["tokens_per_latent_frame"], cfg.num_heads, "cpu", torch.float32)
    noise = FixtureNoise(inputs, cs)
    decode = LingbotDecodeStage(vae)
    decode.open(SessionSpec(session="e2e", seed=0, prompt=""))
    with torch.no_grad():
        text = model.text_cache(context)
        for k in range(chunks):
            y = condition.encode("e2e", k)
            cam = model.camera_modulation(control[:, :, k * cs : (k + 1) * cs])
            x0 = denoise_chunk(model, steps, noise, k, y, cam, text, cache)
            yield f"end_to_end:x0_c{k}", x0, expected[f"x0_c{k}"]
            yield f"end_to_end:frames_c{k}", decode.decode_float("e2e", k, x0), expected[f"frames_c{k}"]
    condition.release("e2e")
    decode.release("e2e")
