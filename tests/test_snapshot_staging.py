"""models.snapshot_io.HostStaging: a save's copy to host goes through buffers kept and reused from save to save (pinned
on CUDA, with one event per capture), equal to the state it copied, and never overwritten while a copy is held."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models import snapshot_io
from models.snapshot_io import HostStaging


def make_state(seed: int = 0, frames: int = 3, device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {f"blocks.{i}.k": torch.randn(frames, 4, 8, generator=g) for i in range(5)}
    state |= {"cursor": torch.tensor([seed, frames]), "bf16": torch.randn(6, generator=g).to(torch.bfloat16)}
    return {name: t.to(device) for name, t in state.items()}


def test_capture_through_staging_is_equal_to_the_state_and_counts_one_copy_per_tensor() -> None:
    staging, state = HostStaging(), make_state()
    copy = snapshot_io.capture(state, staging)
    assert copy.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(copy[name], tensor) and copy[name].dtype == tensor.dtype
        assert copy[name].data_ptr() != tensor.data_ptr()  # a copy, not the live tensor
    assert (staging.stats.captures, staging.stats.copies, staging.stats.allocations) == (1, len(state), len(state))


def test_the_next_capture_reuses_the_buffers_once_the_previous_copy_is_dropped() -> None:
    staging = HostStaging()
    first = snapshot_io.capture(make_state(1), staging)
    pointers = {name: t.data_ptr() for name, t in first.items()}
    del first
    second = snapshot_io.capture(make_state(2), staging)
    assert {name: t.data_ptr() for name, t in second.items()} == pointers  # the same host memory, written again
    assert staging.stats.allocations == len(second) and staging.stats.reused == 1
    assert all(torch.equal(second[name], t) for name, t in make_state(2).items())


def test_a_copy_still_held_is_never_overwritten_by_the_next_capture() -> None:
    staging = HostStaging()
    held = snapshot_io.capture(make_state(1), staging)  # the saver thread still writing it
    snapshot_io.capture(make_state(2), staging)
    assert all(torch.equal(held[name], t) for name, t in make_state(1).items())
    assert staging.stats.reused == 0 and staging.stats.allocations == 2 * len(held)


def test_a_view_of_one_buffer_still_held_keeps_its_set_out_of_reuse() -> None:
    staging = HostStaging()
    copy = snapshot_io.capture(make_state(1), staging)
    row = copy["blocks.0.k"][0]  # e.g. a writer that kept a slice
    expected = row.clone()
    del copy
    snapshot_io.capture(make_state(2), staging)
    assert torch.equal(row, expected) and staging.stats.reused == 0


def test_a_session_of_another_size_gets_its_own_buffers_and_at_most_max_sets_are_kept() -> None:
    staging = HostStaging(max_sets=2)
    for frames in (3, 4, 5):
        snapshot_io.capture(make_state(frames=frames), staging)
    assert staging.stats.allocations == 3 * len(make_state()) and len(staging._sets) == 2
    snapshot_io.capture(make_state(frames=5), staging)  # the newest layout is still kept
    assert staging.stats.reused == 1


def test_a_staged_copy_writes_and_loads_back_equal(tmp_path: Path) -> None:
    staging, state = HostStaging(), make_state(3)
    entry, _ = snapshot_io.write(tmp_path, 0, "denoise", snapshot_io.capture(state, staging))
    loaded = load_file(str(tmp_path / entry.name))
    assert all(torch.equal(loaded[name], t) for name, t in state.items())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned buffers and events need CUDA")
def test_a_device_capture_lands_in_pinned_buffers_and_waits_on_one_event() -> None:
    staging, state = HostStaging(), make_state(4, device="cuda")
    copy = snapshot_io.capture(state, staging)
    assert all(t.is_pinned() for t in copy.values()) and staging.stats.events == 1
    assert all(torch.equal(copy[name], t.cpu()) for name, t in state.items())
