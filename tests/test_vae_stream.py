"""Streaming encode/decode: equal to whole-clip processing, constant tail, isolated and releasable sessions."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch

from models.lingbot_vae_stages import random_stages
from models.stages import SessionSpec
from models.t5 import T5Config
from models.vae import VAEConfig, WanVAE
from models.vae_stream import ConditionEncoder, FrameDecoder, frames_to_uint8, image_from_uint8

torch.set_num_threads(1)

CFG = dataclasses.replace(VAEConfig.preset("tiny"), num_res_blocks=1)
CS = 2  # latent frames per chunk


@pytest.fixture(scope="module")
def vae() -> WanVAE:
    torch.manual_seed(0)
    return WanVAE(CFG).eval()


def _image(seed: int, h: int = 16, w: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(3, h, w, generator=g) * 2 - 1


@torch.no_grad()
@pytest.mark.parametrize("per_call", [None, 1])
def test_streaming_encode_equals_whole_clip_encode(vae: WanVAE, per_call: int | None) -> None:
    chunks = 3
    image = _image(1)
    video = torch.zeros(1, 3, 1 + 4 * (CS * chunks - 1), 16, 16)
    video[0, :, 0] = image
    whole = vae.encode(video)[0]  # [16, F, h, w]
    enc = ConditionEncoder(vae, image, CS, max_latent_frames_per_call=per_call)
    streamed = torch.cat([enc.next_chunk() for _ in range(chunks)], 1)
    torch.testing.assert_close(streamed, whole, atol=1e-5, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("per_call", [None, 1])
def test_streaming_decode_equals_whole_clip_decode(vae: WanVAE, per_call: int | None) -> None:
    chunks = 3
    latents = torch.randn(16, CS * chunks, 2, 2, generator=torch.Generator().manual_seed(2))
    whole = vae.decode(latents[None])[0]  # [3, 1 + 4(F-1), H, W]
    dec = FrameDecoder(vae, max_latent_frames_per_call=per_call)
    outs = [dec.decode(latents[:, k * CS : (k + 1) * CS]) for k in range(chunks)]
    assert [o.shape[1] for o in outs] == [1 + 4 * (CS - 1), 4 * CS, 4 * CS]
    torch.testing.assert_close(torch.cat(outs, 1), whole, atol=1e-5, rtol=0)


@torch.no_grad()
def test_constant_tail_shortcut_gives_identical_chunks_and_stops_encoding(vae: WanVAE) -> None:
    image = _image(3, 8, 8)
    fast = ConditionEncoder(vae, image, CS, constant_tail=True)
    slow = ConditionEncoder(vae, image, CS, constant_tail=False)
    frozen_at = None
    for k in range(24):
        assert torch.equal(fast.next_chunk(), slow.next_chunk()), f"chunk {k} differs"
        if fast.frozen and frozen_at is None:
            frozen_at = k
    assert frozen_at is not None, "the black tail never reached its fixed point"
    calls = fast.encoder_calls
    assert calls == frozen_at + 1 < 24  # no encoder work after the fixed point
    assert slow.encoder_calls == 24
    assert fast.nbytes() == 16 * CS * 1 * 1 * 4  # only the repeating latent chunk is kept
    fast.next_chunk()
    assert fast.encoder_calls == calls


def _spec(session: str, seed: int, prompt: str = "a castle") -> SessionSpec:
    image = ((_image(seed) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).contiguous()
    return SessionSpec(session=session, seed=seed, prompt=prompt, image=image)


@pytest.fixture()
def stages():  # type: ignore[no-untyped-def]
    return random_stages(CFG, T5Config.preset("tiny"), CS, text_len=8, seed=0)


@torch.no_grad()
def test_interleaved_sessions_decode_and_encode_exactly_as_each_alone(stages) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(4)
    lat = {s: [torch.randn(16, CS, 2, 2, generator=g) for _ in range(3)] for s in ("a", "b")}
    alone = {}
    for s, seed in (("a", 1), ("b", 2)):
        stages.condition.open(_spec(s, seed))
        stages.decode.open(SessionSpec(s, 0, ""))
        alone[s] = [(stages.condition.encode(s, k), stages.decode.decode(s, k, lat[s][k])) for k in range(3)]
        stages.condition.release(s)
        stages.decode.release(s)
    for s, seed in (("a", 1), ("b", 2)):
        stages.condition.open(_spec(s, seed))
        stages.decode.open(SessionSpec(s, 0, ""))
    for k in range(3):
        for s in ("b", "a"):
            y, frames = stages.condition.encode(s, k), stages.decode.decode(s, k, lat[s][k])
            assert torch.equal(y, alone[s][k][0]) and torch.equal(frames, alone[s][k][1])


def test_release_frees_the_session_caches(stages) -> None:  # type: ignore[no-untyped-def]
    stages.decode.open(SessionSpec("s", 0, ""))
    stages.condition.open(_spec("s", 1))
    stages.decode.decode("s", 0, torch.zeros(16, CS, 2, 2))
    stages.condition.encode("s", 0)
    dec_ref = weakref.ref(stages.decode._sessions.get("s"))
    enc_ref = weakref.ref(stages.condition._sessions.get("s"))
    assert stages.decode.session_nbytes("s") > 0
    stages.decode.release("s")
    stages.condition.release("s")
    stages.decode.release("s")  # idempotent
    gc.collect()
    assert dec_ref() is None and enc_ref() is None
    assert "s" not in stages.decode and "s" not in stages.condition
    with pytest.raises(KeyError, match="not open"):
        stages.decode.decode("s", 1, torch.zeros(16, CS, 2, 2))


def test_chunks_out_of_order_are_rejected(stages) -> None:  # type: ignore[no-untyped-def]
    stages.decode.open(SessionSpec("s", 0, ""))
    stages.condition.open(_spec("s", 1))
    with pytest.raises(ValueError, match="chunk 1"):
        stages.decode.decode("s", 1, torch.zeros(16, CS, 2, 2))
    with pytest.raises(ValueError, match="chunk 2"):
        stages.condition.encode("s", 2)
    with pytest.raises(KeyError, match="already open"):
        stages.decode.open(SessionSpec("s", 0, ""))


def test_condition_has_the_mask_only_in_the_first_latent_frame(stages) -> None:  # type: ignore[no-untyped-def]
    stages.condition.open(_spec("s", 1))
    y0, y1 = stages.condition.encode("s", 0), stages.condition.encode("s", 1)
    assert y0.shape == y1.shape == (20, CS, 2, 2)
    assert torch.equal(y0[:4, 0], torch.ones(4, 2, 2)) and not y0[:4, 1:].any() and not y1[:4].any()


def test_prompt_context_is_zero_padded_and_cached_by_prompt(stages) -> None:  # type: ignore[no-untyped-def]
    cond = stages.condition
    ctx = cond.open(_spec("a", 1, prompt="hi"))
    assert ctx.shape == (8, 32)
    valid = 3  # "h", "i", eos
    assert ctx[:valid].abs().sum() > 0 and not ctx[valid:].any()
    again = cond.open(_spec("b", 2, prompt="hi"))
    cond.open(_spec("c", 3, prompt="other"))
    assert again is ctx and cond.prompts.misses == 2


def test_uint8_frames_are_rounded_clamped_and_channel_last() -> None:
    frames = torch.tensor([-2.0, -1.0, 0.0, 0.5, 1.0, 3.0]).view(1, 6, 1, 1).expand(3, 6, 1, 1)
    out = frames_to_uint8(frames)
    assert out.dtype == torch.uint8 and out.shape == (6, 1, 1, 3)
    assert out[:, 0, 0, 0].tolist() == [0, 0, 128, 191, 255, 255]  # round(127.5) = 128 (half to even)
    image = torch.tensor([[[0, 255, 128]]], dtype=torch.uint8)
    assert image_from_uint8(image).flatten().tolist() == pytest.approx([-1.0, 1.0, 128 / 127.5 - 1], abs=1e-6)
