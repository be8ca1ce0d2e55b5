"""Attention kernel selection: the choice from a timing table, the process-wide pin, explicit kernels, CPU rules."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.nn.attention import SDPBackend

from models import attention
from models.attention import (
    AttentionShapes,
    choose_attention,
    pin_sdpa_backend,
    pinned_backend,
    priority_order,
    resolve_attention,
    sdpa,
    select_attention,
    time_attention,
)
from models.controls import ChunkControl
from models.dit_config import DiTConfig
from models.lingbot_denoise import LingbotDenoiseStage
from models.stages import SessionSpec, StreamGeometry

torch.set_num_threads(1)
CPU = torch.device("cpu")
SHAPES = AttentionShapes(heads=2, tokens=18, window=36, head_dim=8, cross_heads=4, local_tokens=18, text_len=5)
GEOMETRY = StreamGeometry(height=32, width=48, chunk_latent_frames=3, context_shape=(16, 32),
                          condition_shape=(20, 3, 4, 6), latent_shape=(16, 3, 4, 6))  # fmt: skip


def order() -> list[SDPBackend]:
    """The process's SDPA kernel priority order as torch holds it."""
    return [SDPBackend(i) for i in torch._C._get_sdp_priority_order()]


@pytest.fixture(autouse=True)
def unpinned() -> Iterator[None]:
    """Every test starts and ends with PyTorch's own order (the pin is process state)."""
    pin_sdpa_backend("sdpa")
    yield
    pin_sdpa_backend("sdpa")


def test_the_fastest_kernel_over_both_calls_is_pinned_and_a_kernel_that_failed_is_skipped() -> None:
    # milliseconds per (self-attention, cross-attention) call; None: the kernel refused or failed
    table: dict[str, Any] = {"flash": (2.0, 0.10), "cudnn": (1.5, 0.20), "efficient": (None, 0.05)}
    assert choose_attention(table) == ("sdpa", "cudnn")  # efficient is fastest on cross but failed self-attention
    assert choose_attention({**table, "cudnn": (1.5, 0.9)}) == ("sdpa", "flash")  # 2.1 beats 2.4 over a block
    assert choose_attention({**table, "cudnn": (float("nan"), 0.1)}) == ("sdpa", "flash")  # not a number: failed
    assert choose_attention({**table, "sage": (1.2, None)}) == ("sage", "cudnn")  # sage takes self-attention only
    assert choose_attention({**table, "sage": (1.6, None)}) == ("sdpa", "cudnn")
    assert choose_attention({**table, "sage": (None, None)}) == ("sdpa", "cudnn")
    nothing = {"flash": (None, None), "cudnn": (None, 0.1), "efficient": (None, None)}
    assert choose_attention(nothing) == ("sdpa", "sdpa")  # no fused kernel ran: PyTorch's own order stays
    assert choose_attention({**nothing, "sage": (3.0, None)}) == ("sage", "sdpa")


def test_timing_on_this_machine_skips_the_kernels_it_lacks() -> None:
    """Real refusals: on CPU only flash (of the fused kernels) exists, so cuDNN and efficient time as failed."""
    table = time_attention(SHAPES, CPU, torch.float32, repeat=1)
    assert table["flash"][0] is not None and table["flash"][1] is not None
    assert table["cudnn"] == (None, None) and table["efficient"] == (None, None) and "sage" not in table
    assert choose_attention(table) == ("sdpa", "flash")
    assert "refused" in attention.format_table(table, SHAPES) and "TFLOP/s" in attention.format_table(table, SHAPES)


def test_auto_on_cpu_times_nothing_and_an_explicit_kernel_is_checked_to_run_here() -> None:
    assert resolve_attention("auto", SHAPES, CPU, torch.float32) == ("sdpa", "sdpa", {})
    assert resolve_attention("sdpa", SHAPES, CPU, torch.float32) == ("sdpa", "sdpa", {})
    assert resolve_attention("flash", SHAPES, CPU, torch.float32) == ("sdpa", "flash", {})
    for lacking in ("cudnn", "efficient"):
        with pytest.raises(RuntimeError, match=rf"attention = '{lacking}' cannot run here \(torch.float32, head dim 8"):
            resolve_attention(lacking, SHAPES, CPU, torch.float32)
    with pytest.raises(ValueError, match="attention must be one of"):
        resolve_attention("fastest", SHAPES, CPU, torch.float32)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="sage"):
            select_attention("sage")
    assert select_attention("flash") is sdpa and select_attention("auto") is sdpa


def test_a_pin_puts_its_kernel_first_for_every_thread_and_calls_it_cannot_take_still_run() -> None:
    default = order()
    pin_sdpa_backend("cudnn")  # a kernel this CPU lacks: every call falls through to the next in the order
    assert order() == priority_order(SDPBackend.CUDNN_ATTENTION) and order()[-2:] == [SDPBackend.MATH,
                                                                                       SDPBackend.OVERRIDEABLE]
    seen: list[list[SDPBackend]] = []
    thread = threading.Thread(target=lambda: seen.append(order()))  # a role thread of the same rank
    thread.start()
    thread.join()
    assert seen == [priority_order(SDPBackend.CUDNN_ATTENTION)]
    q = torch.randn(2, 5, 8)
    torch.testing.assert_close(sdpa(q, q, q), torch.softmax(q @ q.transpose(1, 2) / 8**0.5, -1) @ q)
    pin_sdpa_backend("flash")  # a new pin replaces the old one
    assert order() == priority_order(SDPBackend.FLASH_ATTENTION) and pinned_backend() == "flash"
    pin_sdpa_backend("sdpa")
    assert order() == default and pinned_backend() == "sdpa"
    with pytest.raises(ValueError, match="an SDPA kernel"):
        pin_sdpa_backend("sage")


def test_the_stage_pins_its_kernel_once_at_start_and_no_attention_call_touches_the_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``model.attention = "flash"`` is honoured: the stage pins flash for the process when it is built. While it
    streams, nothing enters ``sdpa_kernel`` or changes the order (a compiled block must see no context manager)."""
    stage = LingbotDenoiseStage(DiTConfig.from_name("tiny", attention="flash"), GEOMETRY, init_seed=5)
    assert (stage.attention, stage.sdpa_backend, pinned_backend()) == ("sdpa", "flash", "flash")
    assert order() == priority_order(SDPBackend.FLASH_ATTENTION)
    changes: list[object] = []
    real = torch.nn.attention._sdpa_kernel  # what sdpa_kernel calls to set the flags and the order
    monkeypatch.setattr(torch.nn.attention, "_sdpa_kernel", lambda *a, **k: (changes.append(a), real(*a, **k)))
    stage.open(SessionSpec(session="s", seed=1, prompt=""), torch.randn(16, 32))
    for k in range(2):
        stage.denoise("s", k, torch.randn(20, 3, 4, 6), ChunkControl(keys=frozenset("w")))
    assert changes == [] and order() == priority_order(SDPBackend.FLASH_ATTENTION)
    with pytest.raises(RuntimeError, match="attention = 'efficient' cannot run here"):
        LingbotDenoiseStage(DiTConfig.from_name("tiny", attention="efficient"), GEOMETRY, init_seed=5)
    LingbotDenoiseStage(DiTConfig.from_name("tiny", attention="sdpa"), GEOMETRY, init_seed=5)
    assert pinned_backend() == "sdpa"  # the conformance path: PyTorch's own order again


def test_a_pinned_kernel_that_disagrees_with_the_math_path_is_dropped_for_pytorchs_order(
        caplog: pytest.LogCaptureFixture) -> None:
    """Pinned on timing alone, a kernel is checked once against the float32 math path: CPU's flash kernel agrees; a
    wrong one (here: an injected kernel that scales its output, as a broken build might) falls back with a warning."""
    cpu = torch.device("cpu")
    assert attention.kernel_error("flash", 16, cpu, torch.float32) < attention.PIN_BOUND[torch.float32]
    assert attention.checked_pin("flash", 16, cpu, torch.float32) == "flash"

    def wrong(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention.sdpa(q, k, v) * 1.05

    with caplog.at_level("WARNING", logger="models.attention"):
        assert attention.checked_pin("flash", 16, cpu, torch.float32, run=wrong) == "sdpa"
    assert "SDPA kernel flash disagrees with the math path" in caplog.text

    def refuses(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("No available kernel")

    assert attention.checked_pin("flash", 16, cpu, torch.bfloat16, run=refuses) == "sdpa"
    assert attention.checked_pin("flash", 16, cpu, torch.bfloat16) == "flash"  # bf16 rounding is within its bound
