"""The DiT model, its caches, RoPE, attention selection and schedule behave as specified."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

from models.attention import sdpa
from models.dit import WanModelFast
from models.dit_config import DiTConfig
from models.kv_cache import KVCache, new_kv_cache
from models.rope import apply_rope, rope_angles, rope_freqs
from models.schedule import FlowMatchSchedule

torch.set_num_threads(1)
H, W = 4, 6  # latent grid: 6 tokens per latent frame


def _model(**overrides: object) -> WanModelFast:
    torch.manual_seed(0)
    cfg = DiTConfig.from_name("tiny", attention="sdpa", **overrides)
    model = WanModelFast(cfg).eval()
    with torch.no_grad():  # non-zero biases everywhere, so nothing is exercised by accident as zero
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


def test_full_size_model_on_meta_has_the_released_tensor_and_parameter_counts() -> None:
    with torch.device("meta"):
        model = WanModelFast(DiTConfig.from_name("lingbot-world-fast-v1"))
    sd = model.state_dict()
    assert len(sd) == 1421
    assert sum(t.numel() for t in sd.values()) == 18_544_332_864


def test_cached_chunk_by_chunk_path_equals_one_block_causal_full_sequence_forward() -> None:
    model = _model(kv_window=12, kv_sink=2)  # 9 frames fit: no eviction
    cfg, cs, fs = model.cfg, 3, (H // 2) * (W // 2)
    g = torch.Generator().manual_seed(1)
    clean = [torch.randn(16, cs, H, W, generator=g) for _ in range(2)]
    noisy = torch.randn(16, cs, H, W, generator=g)
    y = torch.randn(20, 3 * cs, H, W, generator=g)
    control = torch.randn(1, 384, 3 * cs, H, W, generator=g)
    context = torch.randn(7, cfg.text_dim, generator=g)
    with torch.no_grad():
        text = model.text_cache(context)
        caches = new_kv_cache(replace(cfg, kv_window=12, kv_sink=2), fs, cfg.num_heads, "cpu", torch.float32)
        outs = []
        for k in range(3):
            sl = slice(k * cs, (k + 1) * cs)
            cam = model.camera_modulation(control[:, :, sl])
            if k < 2:  # a noisy pass first, then the t = 0 refresh that rewrites the chunk's K/V
                model(torch.randn(16, cs, H, W, generator=g), y[:, sl], 900.0, k * cs, text, cam, caches)
                outs.append(model(clean[k], y[:, sl], 0.0, k * cs, text, cam, caches))
            else:
                outs.append(model(noisy, y[:, sl], 500.0, k * cs, text, cam, caches))
        chunk_of = torch.arange(3 * cs * fs) // (cs * fs)
        mask = chunk_of[:, None] >= chunk_of[None, :]  # block-causal: a chunk sees itself and the past
        full = model(
            torch.cat([*clean, noisy], dim=1), y, [0.0] * 2 * cs + [500.0] * cs, 0, text,
            model.camera_modulation(control), None, mask,
        )  # fmt: skip
    torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=1e-5, rtol=0)


def test_timestep_embedding_is_computed_once_per_distinct_t_and_not_per_token() -> None:
    model = _model()
    cfg, fs = model.cfg, 6
    seen: list[tuple[float, int]] = []
    with torch.no_grad():
        text = model.text_cache(torch.zeros(3, cfg.text_dim))
        cam = model.camera_modulation(torch.zeros(1, 384, 3, H, W))
        caches = new_kv_cache(replace(cfg, kv_window=8, kv_sink=2), fs, cfg.num_heads, "cpu", torch.float32)
        for t in (999.0, 978.0, 999.0, 0.0, 0.0):
            model(torch.zeros(16, 3, H, W), torch.zeros(20, 3, H, W), t, 0, text, cam, caches)
            seen.append((t, id(model._time_memo[t][0])))
    assert sorted(model._time_memo) == [0.0, 978.0, 999.0]  # computed once per distinct t ...
    assert all(e.shape == (1, cfg.dim) and mods.shape == (cfg.num_layers, 1, 6, cfg.dim)
               for e, mods in model._time_memo.values())  # fmt: skip
    assert seen[0][1] == seen[2][1] and seen[3][1] == seen[4][1]  # ... and reused, never rebuilt per call


def _frame_cache(cs: int, window: int, sink: int, chunks: int, fs: int = 2) -> KVCache:
    """A cache whose keys carry the absolute latent frame they were written for."""
    cache = KVCache(1, window * fs, sink * fs, heads=1, head_dim=1, device="cpu", dtype=torch.float32)
    for k in range(chunks):
        frames = torch.arange(k * cs, (k + 1) * cs, dtype=torch.float32).repeat_interleave(fs)
        for _ in range(3):  # first call appends; the rewrites of the same chunk must not move anything
            cache.begin(k * cs * fs, cs * fs)
            keys, _ = cache.write(0, frames.view(1, -1, 1), frames.view(1, -1, 1))
            assert keys.shape[1] == cache.local_end
    return cache


def _cached_frames(cache: KVCache, fs: int = 2) -> list[int]:
    """The frames the valid slots hold, from the keys themselves (the ring keeps no order), each once per token."""
    held = [int(v) for v in cache.k[0][0, : cache.local_end, 0]]
    assert all(held.count(f) == fs for f in held), "every cached frame keeps all of its tokens"
    assert sorted(set(held)) == cache.cached_frames(fs), "the slot bookkeeping agrees with the keys"
    return sorted(set(held))


def test_rolling_eviction_matches_the_fixture_trace_and_keeps_the_sink() -> None:
    assert _cached_frames(_frame_cache(3, 8, 2, 3)) == [0, 1, 3, 4, 5, 6, 7, 8]
    assert _cached_frames(_frame_cache(3, 8, 2, 4)) == [0, 1, 6, 7, 8, 9, 10, 11]


@settings(max_examples=40, deadline=None)
@given(cs=st.integers(1, 4), extra=st.integers(0, 6), sink=st.integers(0, 4), chunks=st.integers(1, 12))
def test_cache_always_holds_the_sink_frames_then_the_most_recent_frames(
    cs: int, extra: int, sink: int, chunks: int
) -> None:
    window = sink + cs + extra
    total = cs * chunks
    frames = _cached_frames(_frame_cache(cs, window, sink, chunks))
    if total <= window:
        assert frames == list(range(total))
    else:
        assert frames == list(range(sink)) + list(range(total - (window - sink), total))


def test_rope_keeps_working_past_the_reference_table_and_depends_only_on_frame_distance() -> None:
    hd = 12
    q, k = torch.randn(6, 2, hd, dtype=torch.float64), torch.randn(6, 2, hd, dtype=torch.float64)

    def score(qf: int, kf: int) -> torch.Tensor:
        rq = apply_rope(q, rope_freqs(rope_angles(hd, 1, 2, 3, qf), "cpu"))
        rk = apply_rope(k, rope_freqs(rope_angles(hd, 1, 2, 3, kf), "cpu"))
        return (rq * rk).sum(-1)

    torch.testing.assert_close(score(5000, 4990), score(15, 5), rtol=0, atol=1e-9)


def test_the_streaming_dit_runs_on_the_fused_attention_kernels_only() -> None:
    """A 3-D SDPA call cannot use the fused kernels and falls back to the float32 math path (23 s instead of 2.7 s
    per chunk on an H200); with only the fused CPU kernel allowed, such a call raises instead."""
    model, fs = _model(), (H // 2) * (W // 2)
    cfg = model.cfg
    g = torch.Generator().manual_seed(5)
    with torch.no_grad(), sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        cache = new_kv_cache(replace(cfg, kv_window=8, kv_sink=2), fs, cfg.num_heads, "cpu", torch.float32)
        text = model.text_cache(torch.randn(4, cfg.text_dim, generator=g))  # cross-attention keys
        for k in range(4):  # past the window: eviction included
            cam = model.camera_modulation(torch.randn(1, 384, 3, H, W, generator=g))
            out = model(torch.randn(16, 3, H, W, generator=g), torch.randn(20, 3, H, W, generator=g), 500.0, 3 * k,
                        text, cam, cache)  # fmt: skip
            assert torch.isfinite(out).all()
        with pytest.raises(RuntimeError, match="No available kernel"), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch explains why each kernel refused the 3-D call
            torch.nn.functional.scaled_dot_product_attention(*(torch.randn(2, 5, 4),) * 3)  # the guard is real


def test_ring_cache_holds_exactly_what_the_shifting_reference_holds() -> None:
    """The reference shifts kept tokens down on eviction; the ring writes new tokens over evicted slots. After every
    call both hold the same tokens (as a set) and attention over them gives the same result."""
    g = torch.Generator().manual_seed(2)
    for cs, window, sink in ((3, 8, 2), (4, 18, 6), (2, 7, 0), (1, 3, 1)):
        fs, heads, hd = 2, 2, 4
        ring = KVCache(1, window * fs, sink * fs, heads, hd, "cpu", torch.float64)
        ref_k = torch.empty(heads, 0, hd, dtype=torch.float64)
        for k in range(9):
            new = torch.randn(heads, cs * fs, hd, generator=g, dtype=torch.float64)
            if ref_k.shape[1] + new.shape[1] > window * fs:  # the reference's eviction: oldest non-sink first
                ev = ref_k.shape[1] + new.shape[1] - window * fs
                ref_k = torch.cat([ref_k[:, : sink * fs], ref_k[:, sink * fs + ev :]], dim=1)
            ref_k = torch.cat([ref_k, new], dim=1)
            ring.begin(k * cs * fs, cs * fs)
            got, _ = ring.write(0, new, new)
            assert got.shape == ref_k.shape
            assert sorted(got[0, :, 0].tolist()) == sorted(ref_k[0, :, 0].tolist())
            q = torch.randn(heads, 5, hd, generator=g, dtype=torch.float64)
            torch.testing.assert_close(sdpa(q, got, got), sdpa(q, ref_k, ref_k), rtol=0, atol=1e-12)


@torch.no_grad()
def test_bf16_model_runs_the_head_in_float32_and_rounds_one_plus_cam_scale_to_bf16() -> None:
    model = _model().to(torch.bfloat16)
    block, d = model.blocks[0], model.cfg.dim
    c = torch.randn(6, d).to(torch.bfloat16)
    one_plus_scale, _ = block.camera(c)
    assert one_plus_scale.dtype == torch.bfloat16  # the reference forms 1 + cam_scale in bf16
    x, e = torch.randn(6, d), torch.randn(1, d)
    head = model.head
    s = head.modulation.float() + e[:, None]
    h = torch.nn.functional.layer_norm(x, (d,), eps=1e-6) * (1 + s[:, 1]) + s[:, 0]
    want = h @ head.head.weight.float().T + head.head.bias.float()
    got = head(x, e)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # float32 matmul, not bf16 (which is off by ~1e-2)
    assert float((want - head.head(h.to(torch.bfloat16)).float()).abs().max()) > 1e-3


def test_schedule_uses_first_occurrence_sigma_for_x0_and_second_for_renoise() -> None:
    sched = FlowMatchSchedule.build(shift=10.0)
    step = sched.step(179)
    assert step.timestep == 978 and (step.sigma_x0_index, step.sigma_renoise_index) == (176, 177)
    assert sched.timesteps[176] == sched.timesteps[177] == 978 != sched.timesteps[175]
    single = next(i for i in range(1, 999) if (sched.timesteps == sched.timesteps[i]).sum() == 1)
    assert sched.step(single).sigma_x0_index == sched.step(single).sigma_renoise_index == single


def test_bfloat16_weights_run_the_stream_close_to_the_float32_path() -> None:
    """The GPU dtype on CPU: bf16 Linears with a float32 residual stream and float32 modulation."""
    ref = _model()
    low = _model().to(torch.bfloat16)
    cfg, fs = ref.cfg, 6
    torch.manual_seed(3)
    x, y, ctx = torch.randn(16, 3, H, W), torch.randn(20, 3, H, W), torch.randn(5, cfg.text_dim)
    control = torch.randn(1, 384, 3, H, W) * 0.1
    outs = []
    with torch.no_grad():
        for model, dtype in ((ref, torch.float32), (low, torch.bfloat16)):
            caches = new_kv_cache(replace(cfg, kv_window=8, kv_sink=2), fs, cfg.num_heads, "cpu", dtype)
            text, cam = model.text_cache(ctx), model.camera_modulation(control)
            outs.append([model(x, y, t, 0, text, cam, caches) for t in (999.0, 825.0, 0.0)])
    for a, b in zip(*outs):
        assert b.dtype == torch.float32 and torch.isfinite(b).all()
        assert float((a - b).norm() / a.norm()) < 0.05
