"""The two split7 settings in one process: the fused q/k/v projection (one GEMM over weights concatenated once,
the state dict unchanged) and the overlapped Ulysses exchange (head groups, each exchange started before the
previous group attends). The values on 5 gloo ranks are in ``tests/test_ulysses_settings.py``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from models.dit import DiTConfig, SelfAttention
from models.dit_checkpoint import random_dit
from models.kv_cache import new_kv_cache
from models.memory import dit_working_bytes
from models.schedule import FlowMatchSchedule
from models.ulysses import InFlight, StandInUlysses, head_groups
from scripts.check_golden import compare
from scripts.golden_dit import load_model
from tests.golden_fixtures import fixture_params, require

TINY = DiTConfig.from_name("tiny", attention="sdpa")


class LoggedStandIn(StandInUlysses):
    """The stand-in, noting each exchange it starts (what the pipeline issues, in order)."""

    def __init__(self, size: int, events: list[str]) -> None:
        super().__init__(size)
        self.events = events

    def _start(self, send: torch.Tensor) -> InFlight:
        self.events.append(f"start {tuple(send.shape)}")
        return super()._start(send)


def test_head_groups_are_two_the_larger_first() -> None:
    assert head_groups(8) == [slice(0, 4), slice(4, 8)]  # split7: 40 heads over 5 DiT ranks
    assert head_groups(5) == [slice(0, 3), slice(3, 5)]  # aggregated8: 40 over 8 (not 5 single-head calls)
    assert head_groups(1) == [slice(0, 1)]  # one head: nothing to overlap


def test_overlapped_exchange_starts_the_next_group_before_attending_and_gives_the_one_exchange_result() -> None:
    n_local, heads, hd, n = 12, 20, 4, 57  # 4 local heads on 5 ranks: 2 groups; 57 tokens: 3 rows of padding
    q, k, v = (torch.randn(n_local, heads, hd) for _ in range(3))
    events: list[str] = []

    def attend(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, group: slice) -> torch.Tensor:
        events.append(f"attend {group.start}:{group.stop}")
        return qh * 2 + kh * vh

    got = LoggedStandIn(5, events).attend_overlapped(q, k, v, n, attend)
    assert events == ["start (5, 12, 3, 2, 4)", "start (5, 12, 3, 2, 4)",  # both groups' q/k/v in flight first
                      "attend 0:2", "start (5, 12, 2, 4)", "attend 2:4", "start (5, 12, 2, 4)"]  # fmt: skip
    sp = StandInUlysses(5)
    want = sp.heads_to_seq(attend(*sp.qkv_to_heads(q, k, v, n), slice(0, 4)))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_overlapped_exchange_of_unequal_groups_gives_the_one_exchange_result() -> None:
    n_local, heads, hd, n = 12, 25, 4, 57  # 5 local heads on 5 ranks: groups of 3 and 2
    q, k, v = (torch.randn(n_local, heads, hd) for _ in range(3))

    def attend(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, group: slice) -> torch.Tensor:
        return qh * 2 + kh * vh

    sp = StandInUlysses(5)
    want = sp.heads_to_seq(attend(*sp.qkv_to_heads(q, k, v, n), slice(0, 5)))
    torch.testing.assert_close(sp.attend_overlapped(q, k, v, n, attend), want, rtol=0, atol=0)


def _fused_copy(model: torch.nn.Module) -> None:
    for block in model.blocks:
        block.self_attn.set_fused_qkv(True)


def _parameter_bytes(model: torch.nn.Module) -> int:
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


def test_fused_qkv_keeps_the_state_dict_and_holds_the_weights_once() -> None:
    model = random_dit(TINY, seed=1)
    before = {name: (tuple(t.shape), t.clone()) for name, t in model.state_dict().items()}
    bytes_before = _parameter_bytes(model)
    _fused_copy(model)
    after = model.state_dict()
    assert list(after) == list(before)
    for name, (shape, value) in before.items():
        assert tuple(after[name].shape) == shape and torch.equal(after[name], value), name
    attn = model.blocks[0].self_attn
    assert attn.fused_qkv is not None
    for lin in (attn.q, attn.k, attn.v):
        assert lin.weight.untyped_storage().data_ptr() == attn.fused_qkv[0].untyped_storage().data_ptr()
        assert lin.bias.untyped_storage().data_ptr() == attn.fused_qkv[1].untyped_storage().data_ptr()
    assert _parameter_bytes(model) == bytes_before  # the concatenation replaced the three, it is not a second copy


def _three_gemms(attn: SelfAttention, a: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return attn.q(a), attn.k(a), attn.v(a)


@pytest.mark.parametrize("assign", [False, True])
def test_fused_qkv_follows_a_load_and_a_cast(assign: bool) -> None:
    model, other = random_dit(TINY, seed=1), random_dit(TINY, seed=2)
    _fused_copy(model)
    model.load_state_dict(other.state_dict(), assign=assign)  # the views (or, with assign, new tensors) take it
    model.to(torch.float64)
    attn = model.blocks[1].self_attn
    a = torch.randn(7, TINY.dim, dtype=torch.float64)
    fused = attn.project_linear(a)
    assert attn.fused_qkv is not None and attn.fused_qkv[0].dtype == torch.float64
    want = _three_gemms(other.blocks[1].self_attn.double(), a)
    for got, expected in zip(fused, want):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_fused_projection_matches_the_three_gemms_to_float_rounding() -> None:
    model = random_dit(TINY, seed=1)
    a = torch.randn(96, TINY.dim)
    attn = model.blocks[0].self_attn
    with torch.no_grad():
        want = _three_gemms(attn, a)
        attn.set_fused_qkv(True)
        got = attn.project_linear(a)
    error = max(float((g - w).abs().max()) for g, w in zip(got, want))
    print(f"fused q/k/v vs three GEMMs, float32: max error {error:.2e}")
    assert error <= 1e-6


@pytest.mark.parametrize("fixture", fixture_params())
def test_the_fused_projection_reproduces_the_golden_dit_call(fixture: Path | None) -> None:
    import json

    from safetensors.torch import load_file

    fixture = require(fixture)
    torch.set_num_threads(1)
    stream = json.loads((fixture / "config.json").read_text())["stream"]
    inputs, expected = load_file(str(fixture / "inputs.safetensors")), load_file(str(fixture / "expected.safetensors"))
    cs, fs = stream["chunk_size"], stream["tokens_per_latent_frame"]
    outputs = []
    for fused in (False, True):
        model = load_model(fixture)
        model.set_qkv_exchange(fused, overlap_all_to_all=False)
        cfg = model.cfg
        step = FlowMatchSchedule.build(cfg.shift, cfg.num_train_timesteps).steps(cfg.timestep_indices)[0]
        cache = new_kv_cache(cfg, fs, cfg.num_heads, "cpu", torch.float32)
        with torch.no_grad():
            text, cam = model.text_cache(inputs["dit_context"]), model.camera_modulation(inputs["control_c0"])
            outputs.append(model(inputs["noise_init"][:, :cs], inputs["dit_y"][:, :cs], float(step.timestep), 0, text,
                                 cam, cache))  # fmt: skip
    ok, error, _, bound = compare("dit_v_c0_s0", outputs[1], expected["dit_v_c0_s0"])
    print(f"fused q/k/v golden dit_v_c0_s0: max error {error:.2e} (bound {bound:.2e}); against three GEMMs "
          f"{float((outputs[1] - outputs[0]).abs().max()):.2e}")
    assert ok, f"max error {error:.3e} > {bound:.3e}"


def test_the_memory_model_runs_each_setting_on_the_meta_device_and_finds_the_default_peak() -> None:
    """The overlapped exchange's buffers (every group's send and receive, held until waited for) add up to the one
    exchange's, and the fused GEMM's [n, 3d] output to the three [n, d]: the modelled peak of a steady chunk on one of
    5 ranks is the same (480x832 v1: 1331.5 MiB with each setting)."""
    peaks = {(fused, overlap): dit_working_bytes(replace(TINY, fused_qkv=fused, overlap_all_to_all=overlap),
                                                  torch.bfloat16, 5, 64, 96)
             for fused in (False, True) for overlap in (False, True)}  # fmt: skip
    assert len(set(peaks.values())) == 1, peaks


def test_the_denoise_stage_runs_the_settings_it_is_given_also_on_a_model_built_without_them() -> None:
    from models.lingbot_denoise import LingbotDenoiseStage
    from tests.test_ulysses import GEOMETRY

    shared = random_dit(TINY, seed=1)  # benchmarks hand one built model to stages of several settings
    stage = LingbotDenoiseStage(replace(TINY, fused_qkv=True, overlap_all_to_all=True), GEOMETRY, weights=shared)
    attn = stage.model.blocks[0].self_attn
    assert attn.fused_qkv is not None and attn.overlap and stage.model.cfg.fused_qkv


def test_fusing_a_fused_projection_again_copies_nothing() -> None:
    """Stage start and a plain load ask for the fusion again: the views stay, no [d, 3d] copy is made (a compiled,
    shared model keeps its weights' identities)."""
    block = random_dit(TINY, seed=2).blocks[0].self_attn
    block.set_fused_qkv(True)
    fused = block.fused_qkv
    block.set_fused_qkv(True)
    block.load_state_dict({name: t.clone() for name, t in block.state_dict().items()})
    assert block.fused_qkv is fused and block.q.weight.data_ptr() == fused[0].data_ptr()
