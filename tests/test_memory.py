"""The memory model (``models.memory``) against what a real session allocates, and its meta-device tools."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ipc.protocol import Stage
from models import lingbot, lingbot_config, memory
from models.controls import ChunkControl
from models.stages import SessionSpec
from runtime import config as config_mod
from runtime.placement import STAGES

torch.set_num_threads(1)


def _config(*overrides: str) -> config_mod.Config:
    return config_mod.load("cpu-tiny-model", list(overrides))


ONE_RANK = ("--layout.world_size=1", "--layout.decode=0", "--layout.dit=[0]")


@pytest.mark.parametrize("size", [(64, 96), (48, 128)])
def test_session_items_equal_the_bytes_a_real_tiny_session_holds_after_two_chunks(size: tuple[int, int]) -> None:
    height, width = size
    cfg = _config(*ONE_RANK)  # one rank holding every role
    device = torch.device("cpu")
    condition = lingbot.build_condition(cfg.model, cfg.stream, device)
    denoise = lingbot.build_denoise(cfg.model, cfg.stream, cfg.controls, device, None)
    decode = lingbot.build_decode(cfg.model, cfg.stream, device)
    image = torch.from_numpy(np.full((height, width, 3), 90, dtype=np.uint8))
    spec = SessionSpec("s", 1, "a prompt", image, height, width)
    context = condition.open(spec)
    denoise.open(SessionSpec("s", 1, "a prompt", None, height, width), context)
    decode.open(SessionSpec("s", 0, "", None, height, width))
    for index in range(memory.STEADY_CHUNKS):
        latent = denoise.denoise("s", index, condition.encode("s", index), ChunkControl())
        decode.decode("s", index, latent)
    items = memory.session_items(cfg, 0, height, width, "cpu")
    assert denoise.session_nbytes("s") == items["kv_cache"] + items["text_cache"]
    assert decode.session_nbytes("s") == items["decode_cache"]
    # after two chunks the encoder holds its cache and the fixed-point snapshot (until it freezes)
    assert condition.session_nbytes("s") == items["encode_cache"] + items["encode_snapshot"]
    held = {Stage.CONDITION: condition, Stage.DENOISE: denoise, Stage.DECODE: decode}
    for stage, spec in STAGES.items():  # the items a rank checks each stage against (``ranks.memory``)
        assert held[stage].session_nbytes("s") == sum(items[k] for k in spec.memory_items)
    g = lingbot_config.lingbot_geometry(cfg.model, cfg.stream).with_size(height, width)
    assert items["dit_inputs"] == 4 * (int(np.prod(g.context_shape)) + 2 * int(np.prod(g.condition_shape)))
    assert items["context"] == context.numel() * context.element_size()


def test_kv_cache_is_shared_out_over_the_dit_ranks_and_vae_caches_stay_on_their_ranks() -> None:
    one, five = _config("--layout.world_size=3", "--layout.dit=[2]"), _config()
    single = memory.session_items(one, 2, 64, 96, "cpu")
    split = memory.session_items(five, 2, 64, 96, "cpu")
    assert split["kv_cache"] * 5 == single["kv_cache"]
    assert split["text_cache"] == single["text_cache"]  # cross-attention keys/values of every head on every rank
    costs = memory.session_costs(five, 64, 96, "cpu")
    assert set(memory.session_items(five, 0, 64, 96, "cpu")) == {"encode_cache", "encode_snapshot", "context",
                                                                   "conditions"}
    assert set(memory.session_items(five, 1, 64, 96, "cpu")) == {"decode_cache", "latents"}
    assert costs[2] == costs[6] == sum(split.values())


def test_the_peak_tracker_counts_new_storages_once_and_frees_them() -> None:
    base = torch.zeros(1000, device="meta")
    with memory.PeakTracker() as tracker:
        a = torch.empty(256, device="meta")  # 1 KiB
        view = a[:10]
        base.add_(1)  # in place: no new bytes
        b = a * 2  # another 1 KiB
        del a, view, b
    assert tracker.peak == 2048
    assert tracker.live == 0


def test_synthetic_backends_cost_nothing() -> None:
    cfg = config_mod.load("cpu-tiny")
    assert memory.session_costs(cfg, 160, 256, "cpu") == {rank: 0 for rank in range(cfg.layout.world_size)}


class _Counted:
    """A stage that says how many bytes a session holds."""

    def __init__(self, held: int) -> None:
        self.held = held

    def session_nbytes(self, session: str) -> int:
        return self.held


def test_a_session_holding_more_than_the_model_said_logs_a_warning_on_its_rank(caplog: pytest.LogCaptureFixture
                                                                                ) -> None:
    from ranks.memory import check_session

    cfg = _config("--memory.budget_gb=1")  # a CPU job prices sessions only under a budget
    assert memory.priced(cfg, "cpu") and not memory.priced(_config(), "cpu") and memory.priced(_config(), "cuda")
    items = memory.session_items(cfg, 1, 64, 96, "cpu")
    with caplog.at_level("DEBUG", logger="ranks.memory"):
        check_session(_config(), 1, "decode", _Counted(items["decode_cache"] * 2), "s", 64, 96)  # no budget: no check
        assert not [r for r in caplog.records if r.levelname == "WARNING"]
        check_session(cfg, 1, "decode", _Counted(items["decode_cache"]), "s", 64, 96)
        assert not [r for r in caplog.records if r.levelname == "WARNING"]
        check_session(cfg, 1, "decode", _Counted(int(items["decode_cache"] * 1.2)), "s", 64, 96)
    (warning,) = [r for r in caplog.records if r.levelname == "WARNING"]
    assert "under-estimates this rank by 20%" in warning.getMessage() and "session s (64x96)" in warning.getMessage()


def test_a_cpu_rank_has_the_configured_budget_or_no_limit() -> None:
    from ranks.memory import room_bytes

    assert room_bytes(_config(), 0, torch.device("cpu")) == -1
    assert room_bytes(_config("--memory.budget_gb=0.5"), 0, torch.device("cpu")) == 1 << 29


def test_a_chunk_without_its_working_memory_is_an_out_of_memory_error_before_it_starts() -> None:
    cuda = torch.device("cuda", 0)
    assert memory.headroom_error(3 * memory.GIB, 2 * memory.GIB, "chunk 4 of s", cuda) is None
    error = memory.headroom_error(memory.GIB, 2 * memory.GIB, "chunk 4 of s", cuda)
    assert isinstance(error, torch.OutOfMemoryError)
    assert str(error) == "chunk 4 of s needs 2.00 GiB of working memory and 1.00 GiB are free on cuda:0"
    memory.ensure_headroom(torch.device("cpu"), 1 << 60, "anything")  # the CPU has no such check


@pytest.mark.parametrize("kv_window, policy", [("full", "full"), ("preset", "rolling"), ("9", "rolling")])
def test_the_kv_policy_travels_in_the_dit_config_so_the_stage_and_the_memory_model_build_the_same_cache(
        kv_window: str, policy: str) -> None:  # fmt: skip
    cfg = _config(*ONE_RANK, f"--model.kv_window={kv_window}", "--model.kv_full_frames=6")
    dit = lingbot_config.dit_config(cfg.model, cfg.stream)
    assert dit.kv_policy == policy
    denoise = lingbot.build_denoise(cfg.model, cfg.stream, cfg.controls, torch.device("cpu"), None)
    denoise.open(SessionSpec("s", 1, "", None, 64, 96), torch.zeros(dit.text_len, dit.text_dim))
    held = denoise.sessions["s"].cache
    s = memory.setting(cfg, "cpu")
    model = memory._dit(s)
    counted, _, _ = memory._full_window(model, model.cfg, s.dit_dtype, 64 // 8, 96 // 8)
    assert (held.policy, held.slots, held.sink, len(held.k)) == (counted.policy, counted.slots, counted.sink,
                                                                 len(counted.k))  # fmt: skip
    assert held.policy.name == policy and held.slots == dit.kv_window * 4 * 6
    chunk = dit.chunk_size * 4 * 6  # the cache does what its policy says once the window is full
    for k in range(held.slots // chunk):
        held.begin(k * chunk, chunk)
    if policy == "full":
        with pytest.raises(ValueError, match="the full KV cache holds"):
            held.begin(held.global_end, chunk)
    else:
        held.begin(held.global_end, chunk)
        assert held.evicted > 0 and held.steady
