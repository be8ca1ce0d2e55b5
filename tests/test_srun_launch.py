"""A direct `srun` launch (no torchrun agent): ranks read SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, serve, and a
dead or frozen rank still ends the whole job with non-zero exits, with no agent to tear the others down."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ipc.client import Client
from scripts.local_server import ROOT

pytestmark = pytest.mark.multiprocess

IMAGE = (ROOT / "assets" / "start.png").read_bytes()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


DEAD_S = 3.0  # timeouts.rank_dead_s of these jobs


@pytest.fixture
def srun_job(tmp_path: Path) -> Iterator[tuple[list[subprocess.Popen[bytes]], str]]:
    """Seven ranks started the way `srun` starts them (no torchrun agent), serving; (their processes, endpoint)."""
    port_file = tmp_path / "port"
    master_port = str(free_port())
    ranks, logs = [], []
    for rank in range(7):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="7", SLURM_LOCALID=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=master_port, WORLDSTREAM_PORT_FILE=str(port_file), OMP_NUM_THREADS="1")
        logs.append(open(tmp_path / f"rank{rank}.log", "wb"))  # noqa: SIM115 - closed with the process below
        ranks.append(subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "--config", "cpu-tiny",
                                       "--server.port=0", f"--timeouts.rank_dead_s={DEAD_S}"], cwd=ROOT, env=env,
                                      stdout=logs[-1], stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + 90
        while not port_file.exists():
            assert time.monotonic() < deadline, "the srun-style job never started serving"
            time.sleep(0.1)
        yield ranks, f"tcp://127.0.0.1:{port_file.read_text()}"
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
        for log in logs:
            log.close()


def test_srun_style_ranks_serve_and_a_killed_rank_ends_every_rank_nonzero(
        srun_job: tuple[list[subprocess.Popen[bytes]], str]) -> None:
    ranks, endpoint = srun_job
    with Client(endpoint) as client:
        info = client.open(IMAGE, num_chunks=2)
        for index in range(2):
            client.control(info.id, index, keys="a")
        assert [c.index for c in client.chunks(info.id, timeout_s=30)] == [0, 1]
        killed = time.monotonic()
        ranks[4].send_signal(signal.SIGKILL)
        codes = [process.wait(timeout=30) for process in ranks]
        elapsed = time.monotonic() - killed
        error = client.error(timeout_s=5)
    assert all(code != 0 for code in codes), codes
    assert elapsed < 30
    assert error is not None and error.code == "rank_failed" and "rank 4" in error.message


def test_srun_style_a_frozen_dit_rank_mid_stream_ends_every_rank_within_its_deadline(
        srun_job: tuple[list[subprocess.Popen[bytes]], str]) -> None:
    ranks, endpoint = srun_job
    with Client(endpoint) as client:
        info = client.open(IMAGE, num_chunks=200)
        for index in range(5):  # accepted as the stream moves: chunks 3 and 4 are in flight when the rank freezes
            client.control(info.id, index, keys="w")
        chunks = client.chunks(info.id, timeout_s=30)
        assert [next(chunks).index for _ in range(3)] == [0, 1, 2]
        frozen = time.monotonic()
        ranks[4].send_signal(signal.SIGSTOP)  # alive to the kernel, silent to its peers
        error = client.error(timeout_s=DEAD_S + 10)
        to_error = time.monotonic() - frozen
        codes = [process.wait(timeout=DEAD_S + 10) for process in ranks]
        to_exit = time.monotonic() - frozen
    print(f"\nsrun-style launch, SIGSTOP rank 4 mid-stream (rank_dead_s {DEAD_S:.0f}): client error after "
          f"{to_error:.2f} s, every rank gone after {to_exit:.2f} s")
    assert error is not None and error.code == "rank_failed" and "rank 4" in error.message, error
    assert all(code != 0 for code in codes), codes
    assert to_exit < DEAD_S + 5, to_exit
