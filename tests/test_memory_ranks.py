"""Memory-aware admission and OOM containment on real ranks: a CPU budget that fits exactly two sessions of the tiny
model admits two, answers the third ``busy`` naming the rank short of room, and lets a new one in once a session
closed; an out-of-memory error on one DiT rank costs its session only, never the job."""

from __future__ import annotations

from pathlib import Path

import pytest

from ipc.client import Client, ServerError
from models import memory
from runtime import config as config_mod
from runtime.memory_admission import GIB
from scripts.local_server import LocalServer
from tests.test_failures import IMAGE, concurrent

pytestmark = pytest.mark.multiprocess

TWO_RANKS = ["--layout.world_size=2", "--layout.decode=1", "--layout.dit=[1]"]  # rank 0: condition; 1: DiT + decode


def test_a_budget_for_two_tiny_sessions_refuses_the_third_naming_the_rank_and_admits_one_after_a_close(
        tmp_path: Path) -> None:
    cfg = config_mod.load("cpu-tiny-model", TWO_RANKS)
    costs = memory.session_costs(cfg, cfg.stream.height, cfg.stream.width, "cpu")
    budget = 5 * max(costs.values()) // 2  # 2.5 sessions of the rank that needs most
    short = next(r for r, c in sorted(costs.items()) if budget - 2 * c < c)  # the rank the model says is full first
    flags = [*TWO_RANKS, f"--memory.budget_gb={budget / GIB!r}"]
    with LocalServer("cpu-tiny-model", flags, log_path=tmp_path / "server.log") as server, \
            Client(server.endpoint) as client:
        first = client.open(IMAGE, prompt="one", num_chunks=None)
        for index in range(2):  # the VAE caches reach their steady size: each rank checks them against the model
            client.control(first.id, index, keys="w")
            client.next_chunk(first.id, timeout_s=60)
        client.open(IMAGE, prompt="two", num_chunks=None)
        with pytest.raises(ServerError) as refused:
            client.open(IMAGE, prompt="three", num_chunks=None)
        error = refused.value
        assert error.code == "busy" and error.retry_after_s, error
        assert f"rank {short} " in error.message and f"needs {costs[short]} bytes" in error.message, error.message
        assert f"has {budget - 2 * costs[short]} bytes" in error.message, error.message
        ranks = client.stats().ranks
        for rank, cost in costs.items():
            assert ranks[str(rank)].session_bytes == 2 * cost
            assert abs(ranks[str(rank)].free_bytes - (budget - 2 * cost)) <= 1  # the budget travels in GiB
        measured = ranks["1"].measured_session_bytes  # what the stages of rank 1 count, the two sessions together
        assert 0 < measured <= ranks["1"].session_bytes
        client.close(first.id, timeout_s=60)
        third = client.open(IMAGE, prompt="three again", num_chunks=None)
        assert third.id and client.stats().open_sessions == 2
        assert server.stop() == 0
    assert "under-estimates" not in server.log()


def test_an_out_of_memory_error_on_one_dit_rank_fails_its_session_only_and_the_job_serves_on(
        shared_server: LocalServer) -> None:
    bad = "bad OOM:prepare:2"
    results = concurrent(shared_server.endpoint, [bad, "good beside an OOM"])
    received, _, summary = results[bad]
    assert summary.reason == "failed", summary
    assert "rank 3 could not prepare the chunk" in summary.error and "OutOfMemoryError" in summary.error
    assert received in ([], [0], [0, 1])
    assert sorted(summary.released["denoise"]) == [2, 3, 4, 5, 6]
    assert results["good beside an OOM"][0] == list(range(8))
    after = concurrent(shared_server.endpoint, ["after an OOM"], chunks=4)
    assert after["after an OOM"][0] == [0, 1, 2, 3]


def test_an_out_of_memory_error_opening_a_session_on_one_dit_rank_refuses_that_session_only(
        shared_server: LocalServer) -> None:
    with Client(shared_server.endpoint) as client:
        with pytest.raises(ServerError) as failed:
            client.open(IMAGE, prompt="OOM:open", num_chunks=4)
        assert failed.value.code == "failed" and "OutOfMemoryError" in failed.value.message, failed.value
    after = concurrent(shared_server.endpoint, ["after an OOM at open"], chunks=4)
    assert after["after an OOM at open"][0] == [0, 1, 2, 3]
