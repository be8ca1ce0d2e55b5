"""Wan2.1 VAE network: official layout, strides, causality, and chunked == whole-clip at the layer level."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models.vae import CausalConv3d, TemporalCache, VAEConfig, WanVAE, decode_flops, encode_flops

torch.set_num_threads(1)

# Smallest config with every kind of layer (two temporal downsamples, attention in the middle).
CFG = dataclasses.replace(VAEConfig.preset("tiny"), num_res_blocks=1)


@pytest.fixture(scope="module")
def vae() -> WanVAE:
    torch.manual_seed(0)
    return WanVAE(CFG).eval()


def test_tiny_preset_has_the_official_parameter_names() -> None:
    keys = set(WanVAE(VAEConfig.preset("tiny")).state_dict())
    for name in ("encoder.conv1.weight", "encoder.downsamples.5.time_conv.weight", "encoder.middle.1.to_qkv.weight",
                 "encoder.head.2.weight", "conv1.weight", "conv2.weight", "decoder.upsamples.3.time_conv.weight",
                 "decoder.upsamples.11.resample.1.weight", "decoder.upsamples.4.shortcut.weight",
                 "decoder.head.0.gamma"):  # fmt: skip
        assert name in keys, name
    assert not any("latent" in k for k in keys), "normalisation constants are not checkpoint entries"


def test_unknown_preset_lists_the_valid_ones() -> None:
    with pytest.raises(KeyError, match="tiny"):
        VAEConfig.preset("huge")


@torch.no_grad()
def test_encode_and_decode_follow_the_4x8x8_stride(vae: WanVAE) -> None:
    video = torch.rand(1, 3, 9, 16, 24) * 2 - 1
    z = vae.encode(video)
    assert z.shape == (1, 16, 3, 2, 3)
    frames = vae.decode(z)
    assert frames.shape == (1, 3, 9, 16, 24)
    assert frames.min() >= -1 and frames.max() <= 1


@torch.no_grad()
def test_encoder_is_causal_in_time(vae: WanVAE) -> None:
    video = torch.rand(1, 3, 9, 16, 16)
    changed = video.clone()
    changed[:, :, 5:] = torch.rand(1, 3, 4, 16, 16)  # only the last latent frame's input changes
    a, b = vae.encode(video), vae.encode(changed)
    assert torch.equal(a[:, :, :2], b[:, :, :2])
    assert not torch.equal(a[:, :, 2], b[:, :, 2])


@torch.no_grad()
def test_decoder_is_causal_in_time(vae: WanVAE) -> None:
    z = torch.randn(1, 16, 3, 2, 2)
    changed = z.clone()
    changed[:, :, 2] = torch.randn(1, 16, 2, 2)
    a, b = vae.decode(z), vae.decode(changed)
    assert torch.equal(a[:, :, :5], b[:, :, :5])  # latent frames 0, 1 -> video frames 0..4
    assert not torch.equal(a[:, :, 5:], b[:, :, 5:])


@torch.no_grad()
def test_causal_conv_with_cache_equals_one_pass() -> None:
    torch.manual_seed(1)
    conv = CausalConv3d(3, 5, 3, padding=1)
    x = torch.randn(1, 3, 7, 6, 6)
    cache = TemporalCache()
    pieces = []
    for a, b in ((0, 1), (1, 2), (2, 5), (5, 7)):
        cache.begin()
        pieces.append(conv(x[:, :, a:b], cache))
    torch.testing.assert_close(torch.cat(pieces, 2), conv(x), atol=1e-6, rtol=0)


@torch.no_grad()
def test_first_latent_frame_decodes_to_one_frame_and_later_ones_to_four(vae: WanVAE) -> None:
    cache = TemporalCache()
    assert vae.decode(torch.randn(1, 16, 1, 2, 2), cache).shape[2] == 1
    assert vae.decode(torch.randn(1, 16, 1, 2, 2), cache).shape[2] == 4
    assert vae.decode(torch.randn(1, 16, 2, 2, 2), cache).shape[2] == 8


def test_flop_counts_grow_with_frames_and_area() -> None:
    one = decode_flops(CFG, 1, 16, 16)
    assert one > 0
    assert decode_flops(CFG, 3, 16, 16) > 2 * one
    assert decode_flops(CFG, 1, 32, 32) == pytest.approx(4 * one, rel=0.05)
    assert encode_flops(CFG, 4, 16, 16, first=False) > encode_flops(CFG, 1, 16, 16, first=True)


@torch.no_grad()
def test_a_bfloat16_vae_encodes_and_decodes_a_stream_close_to_float32(vae: WanVAE) -> None:
    """The ``model.vae_dtype = "bfloat16"`` policy: weights in bf16, normalisation constants float32."""
    from models.vae_stream import ConditionEncoder, FrameDecoder

    low = WanVAE(CFG).eval()
    low.load_state_dict(vae.state_dict())
    low = low.to(torch.bfloat16)
    low.reset_latent_stats()
    g = torch.Generator().manual_seed(1)
    image = torch.rand(3, 32, 48, generator=g) * 2 - 1
    latents = [torch.randn(16, 3, 4, 6, generator=g) for _ in range(2)]
    for model in (vae, low):
        frames = [FrameDecoder(model).decode(z) for z in latents[:1]] + [FrameDecoder(model).decode(latents[1])]
        encoded = [ConditionEncoder(model, image, 3, constant_tail=False).next_chunk()]
        if model is vae:
            ref_frames, ref_encoded = frames, encoded
    for got, want in zip(frames + encoded, ref_frames + ref_encoded):
        assert got.shape == want.shape and torch.isfinite(got.float()).all()
        assert float((got.float() - want).norm() / want.norm()) < 0.05


@torch.no_grad()
def test_attention_block_runs_on_the_fused_kernel_not_the_math_path() -> None:
    """The VAE's attention hands SDPA q/k/v with a unit last stride: with only the fused (flash) kernel allowed it
    runs, and gives the same numbers as the default path (a strided q/k/v made every fused kernel refuse them)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from models.vae import AttentionBlock

    torch.manual_seed(0)
    block = AttentionBlock(32).eval()
    x = torch.randn(1, 32, 2, 4, 6)
    expected = block(x)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        fused = block(x)
    torch.testing.assert_close(fused, expected)
