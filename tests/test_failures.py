"""Stage failures on real ranks: one session's failure fails that session only (its client hears why, its
caches are released, every edge stays in step for the others); a failure inside the multi-rank DiT group, which
cannot be recovered, ends the job non-zero with the clients told. Failures are injected through the test backend
``tests/faulty_backend.py`` (a session's prompt names the stage and chunk that must fail)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from ipc.client import Client, ServerError
from scripts.local_server import ROOT, LocalServer

pytestmark = pytest.mark.multiprocess

IMAGE = (ROOT / "assets" / "start.png").read_bytes()
FAST = ["--synthetic.encode_s=0.01", "--synthetic.denoise_s=0.02", "--synthetic.decode_s=0.01",
        "--model.kind=tests.faulty_backend:build"]


def run_session(endpoint: str, prompt: str, chunks: int, results: dict[str, object]) -> None:
    with Client(endpoint) as client:
        info = client.open(IMAGE, prompt=prompt, num_chunks=chunks)
        received, errors = [], []
        try:
            for index in range(chunks):
                client.control(info.id, index, keys="w")
        except ServerError as error:  # controls of a failed session are refused
            errors.append(error)
        try:
            for chunk in client.chunks(info.id, timeout_s=30):
                received.append(chunk.index)
        except ServerError as error:
            errors.append(error)
        results[prompt] = (received, errors, client.wait_closed(info.id, timeout_s=30))


def concurrent(endpoint: str, prompts: list[str], chunks: int = 8) -> dict[str, object]:
    results: dict[str, object] = {}
    threads = [threading.Thread(target=run_session, args=(endpoint, p, chunks, results)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    return results


@pytest.fixture
def server(shared_server: LocalServer) -> LocalServer:
    return shared_server  # the session's server runs this backend (tests/conftest.py)


@pytest.mark.parametrize("stage", ["decode", "condition"])
def test_a_failing_stage_fails_only_its_session_and_the_edges_stay_in_step(server: LocalServer, stage: str) -> None:
    bad, good = f"bad FAIL:{stage}:2", f"good twin of {stage}"
    results = concurrent(server.endpoint, [bad, good])
    received, errors, summary = results[good]
    assert received == list(range(8)) and not errors and summary.reason == "complete"
    received, errors, summary = results[bad]
    expected = "not finite" if stage == "decode" else "injected condition failure"  # decode refuses a NaN latent
    assert summary.reason == "failed" and expected in (summary.error or ""), summary.error
    # chunks before the failure arrive in order and nothing after it (conditions run ahead: one may fail first)
    assert received == list(range(len(received))) and len(received) <= 2
    assert stage != "decode" or received == [0, 1]
    assert {k: sorted(v) for k, v in summary.released.items()} == {"decode": [1], "denoise": [2, 3, 4, 5, 6],
                                                                      "condition": [0]}
    # a new session afterwards streams normally: nothing on any edge was left out of step
    after = concurrent(server.endpoint, [f"after {stage}"], chunks=4)
    assert after[f"after {stage}"][0] == [0, 1, 2, 3]


def test_a_failure_preparing_a_chunk_on_one_dit_rank_fails_only_its_session_and_the_job_serves_on(
        server: LocalServer) -> None:
    bad = "bad FAIL:prepare:2"
    results = concurrent(server.endpoint, [bad, "good twin"])
    received, _, summary = results[bad]
    assert summary.reason == "failed", summary
    assert "rank 3 could not prepare the chunk" in summary.error and "injected failure preparing" in summary.error
    assert received in ([], [0], [0, 1])  # in order, and nothing from chunk 2 on (those in flight are dropped)
    assert results["good twin"][0] == list(range(8)) and results["good twin"][2].reason == "complete"
    assert sorted(summary.released["denoise"]) == [2, 3, 4, 5, 6]  # every DiT rank released its caches
    assert concurrent(server.endpoint, ["after a prepare failure"], chunks=4)["after a prepare failure"][0] == \
        [0, 1, 2, 3]


def test_a_denoise_failure_with_one_dit_rank_fails_only_that_session(tmp_path: Path) -> None:
    one_dit = ["--layout.world_size=3", "--layout.dit=[2]", *FAST]
    with LocalServer("cpu-tiny", one_dit, log_path=tmp_path / "server.log") as server:
        results = concurrent(server.endpoint, ["bad FAIL:denoise:3", "good"])
        assert results["good"][0] == list(range(8))
        received, _, summary = results["bad FAIL:denoise:3"]
        assert summary.reason == "failed" and "injected denoise failure" in summary.error
        assert received == list(range(len(received))) and len(received) <= 3  # in flight at the failure: dropped
        assert server.stop() == 0


def test_a_denoise_failure_inside_the_five_rank_dit_group_ends_the_job_and_tells_clients(tmp_path: Path) -> None:
    with LocalServer("cpu-tiny", FAST, log_path=tmp_path / "server.log") as server, Client(server.endpoint) as client:
        info = client.open(IMAGE, prompt="FAIL:denoise:1", num_chunks=4)
        for index in range(2):
            client.control(info.id, index, keys="w")
        assert server.wait(timeout_s=30) != 0
        error = client.error(timeout_s=5)
        assert error is not None and error.code == "rank_failed" and "denoise" in error.message, error
