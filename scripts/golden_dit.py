"""Golden conformance checks of the DiT, the camera path, the schedule and the streaming loop.

``checks(fixture_dir)`` loads a fixture directory (format: ``shared/fixtures/golden/README.md``) with this
project's code, recomputes every DiT/camera/schedule tensor it can and yields ``(name, actual, expected)``.
Every size comes from the fixture's ``config.json``; nothing about ``tiny-a`` is assumed. Integer facts
(timesteps, sigma indices, KV-cache counters) are yielded as tensors and must match exactly.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file

from models.camera import clip_control
from models.compiled import compile_dit
from models.dit import WanModelFast
from models.dit_checkpoint import config_from_dict, load_state_dict_strict
from models.dit_config import DiTConfig
from models.kv_cache import new_kv_cache
from models.lingbot_denoise import denoise_chunk
from models.schedule import FlowMatchSchedule

Check = tuple[str, torch.Tensor, torch.Tensor]


class FixtureNoise:
    """Replays the fixture's stored noise in place of the session's generator."""

    def __init__(self, inputs: dict[str, torch.Tensor], cs: int) -> None:
        self.inputs, self.cs = inputs, cs

    def draw(self, shape: tuple[int, ...], kind: str, chunk: int, step: int) -> torch.Tensor:
        if kind == "init":
            out = self.inputs["noise_init"][:, chunk * self.cs : (chunk + 1) * self.cs]
        else:
            out = self.inputs[f"noise_renoise_c{chunk}_s{step}"]
        assert tuple(out.shape) == tuple(shape), f"noise {kind} c{chunk} s{step}: {tuple(out.shape)} != {shape}"
        return out.clone()


def load_model(fixture_dir: Path, compile: str = "off") -> WanModelFast:
    """The fixture's DiT in float32 on CPU, loaded strictly from ``dit.safetensors``; ``compile`` as ``[model]
    compile``, strict (a block that does not compile raises instead of running eagerly)."""
    config = json.loads((fixture_dir / "config.json").read_text())
    stream = config["stream"]
    fs = stream["tokens_per_latent_frame"]
    constructor = config["dit"]["constructor"]
    whole_clip = constructor["local_attn_size"] < 0  # the official "full" cache: nothing is ever evicted
    # The streaming settings as the reference ran them; the constructor decides the architecture only.
    streaming = DiTConfig(
        kv_window=stream["kv_cache_size_tokens"] // fs,
        kv_sink=0 if whole_clip else stream.get("sink_size", constructor["sink_size"]),
        kv_policy="full" if whole_clip else "rolling",
        chunk_size=stream["chunk_size"],
        shift=stream["shift"],
        num_train_timesteps=stream["num_train_timesteps"],
        timestep_indices=tuple(stream["timestep_indices"]),
        attention="sdpa",
    )
    cfg = config_from_dict(constructor, streaming)
    with torch.device("meta"):
        model = WanModelFast(cfg)
    model = load_state_dict_strict(model, load_file(str(fixture_dir / "dit.safetensors")), None, "cpu", torch.float32)
    compile_dit(model, compile, "cpu", strict=True)
    return model


def _camera_checks(config: dict, inputs: dict, expected: dict) -> Iterator[Check]:
    stream = config["stream"]
    height, width, frames, cs = stream["image_height"], stream["image_width"], stream["lat_f"], stream["chunk_size"]
    out = clip_control(inputs["c2w"], inputs["intrinsics"], height, width, frames)
    for name, value in out.items():
        yield name, value, expected[name]
    for k in range(stream["num_chunks"]):
        yield f"control_c{k}", out["plucker_from_poses"][:, :, k * cs : (k + 1) * cs], inputs[f"control_c{k}"]


def _schedule_checks(stream: dict) -> Iterator[Check]:
    steps = FlowMatchSchedule.build(stream["shift"], stream["num_train_timesteps"]).steps(stream["timestep_indices"])
    ref = stream["denoising_steps"]
    yield "timesteps", torch.tensor([s.timestep for s in steps]), torch.tensor(stream["timesteps"])
    yield (
        "sigma_x0_index",
        torch.tensor([s.sigma_x0_index for s in steps]),
        torch.tensor([r["sigma_x0_index"] for r in ref]),
    )
    yield "sigma_x0", torch.tensor([s.sigma_x0 for s in steps]), torch.tensor([r["sigma_x0"] for r in ref])
    # Step 0 is never re-noised to (the reference records null there).
    yield (
        "sigma_renoise_index",
        torch.tensor([s.sigma_renoise_index for s in steps[1:]]),
        torch.tensor([r["sigma_renoise_index"] for r in ref[1:]]),
    )
    yield (
        "sigma_renoise",
        torch.tensor([s.sigma_renoise for s in steps[1:]]),
        torch.tensor([r["sigma_renoise"] for r in ref[1:]]),
    )


def checks(fixture_dir: Path, compile: str = "off") -> Iterator[Check]:
    """Yield ``(expected tensor name, actual, expected)`` for every DiT/camera/schedule tensor of the fixture (the DiT
    compiled as ``compile``)."""
    fixture_dir = Path(fixture_dir)
    config = json.loads((fixture_dir / "config.json").read_text())
    stream = config["stream"]
    inputs = load_file(str(fixture_dir / "inputs.safetensors"))
    expected = load_file(str(fixture_dir / "expected.safetensors"))
    yield from _camera_checks(config, inputs, expected)
    yield from _schedule_checks(stream)

    model = load_model(fixture_dir, compile)
    cfg = model.cfg
    cs, h, w, chunks = stream["chunk_size"], stream["lat_h"], stream["lat_w"], stream["num_chunks"]
    fs = stream["tokens_per_latent_frame"]
    assert fs == (h // 2) * (w // 2), "tokens_per_latent_frame disagrees with the latent grid"
    window = config["dit"]["constructor"]["local_attn_size"]
    yield (
        "kv_cache_size_tokens",
        torch.tensor((window if window > 0 else stream["lat_f"]) * fs),
        torch.tensor(stream["kv_cache_size_tokens"]),
    )
    steps = FlowMatchSchedule.build(cfg.shift, cfg.num_train_timesteps).steps(cfg.timestep_indices)
    context, y_all = inputs["dit_context"], inputs["dit_y"]

    def fresh_cache():  # type: ignore[no-untyped-def]
        return new_kv_cache(cfg, fs, cfg.num_heads, "cpu", torch.float32)

    with torch.no_grad():
        text = model.text_cache(context)
        # One DiT call: chunk 0, step 0, empty cache.
        cam0 = model.camera_modulation(inputs["control_c0"])
        v = model(inputs["noise_init"][:, :cs], y_all[:, :cs], float(steps[0].timestep), 0, text, cam0, fresh_cache())
        yield "dit_v_c0_s0", v, expected["dit_v_c0_s0"]

        # The whole stream on one persistent cache.
        cache = fresh_cache()
        noise = FixtureNoise(inputs, cs)
        traced: dict[str, torch.Tensor] = {}
        ends: list[list[int]] = []
        held: list[list[int]] = []
        for k in range(chunks):
            cam = model.camera_modulation(inputs[f"control_c{k}"])
            y = y_all[:, k * cs : (k + 1) * cs]
            denoise_chunk(model, steps, noise, k, y, cam, text, cache, trace=traced.__setitem__)
            ends.append([cache.global_end, cache.local_end])
            held.append(cache.cached_frames(fs))
    for name, value in traced.items():
        yield name, value, expected[name]
    yield "latents_all", torch.cat([traced[f"x0_c{k}"] for k in range(chunks)], dim=1), expected["latents_all"]
    trace = stream["kv_cache_trace_after_each_chunk"]
    yield (
        "kv_cache_global_local_end",
        torch.tensor(ends),
        torch.tensor([[t["global_end"], t["local_end"]] for t in trace]),
    )
    # Tokens evicted by each chunk's first call: l_prev + (g - g_prev) - l.
    prev = [[0, 0], *ends[:-1]]
    evicted = [lp + (g - gp) - l for (gp, lp), (g, l) in zip(prev, ends)]
    yield "kv_cache_evicted_tokens", torch.tensor(evicted), torch.tensor([t["evicted_tokens"] for t in trace])
    for k, (frames, t) in enumerate(zip(held, trace)):
        yield f"kv_cache_latent_frames_c{k}", torch.tensor(frames), torch.tensor(t["cached_latent_frames"])
