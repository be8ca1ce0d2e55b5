"""A direct `srun` launch (no torchrun agent): ranks read SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, serve, and a
dead rank still ends the whole job with non-zero exits, found by the heartbeats alone."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
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


def test_srun_style_ranks_serve_and_a_killed_rank_ends_every_rank_nonzero(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    master_port = str(free_port())
    ranks = []
    for rank in range(7):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="7", SLURM_LOCALID=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=master_port, WORLDSTREAM_PORT_FILE=str(port_file), OMP_NUM_THREADS="1")
        log = open(tmp_path / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed with the process below
        ranks.append((subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "--config", "cpu-tiny",
                                        "--server.port=0", "--timeouts.rank_dead_s=3"], cwd=ROOT, env=env,
                                       stdout=log, stderr=subprocess.STDOUT), log))
    try:
        deadline = time.monotonic() + 90
        while not port_file.exists():
            assert time.monotonic() < deadline, "the srun-style job never started serving"
            time.sleep(0.1)
        with Client(f"tcp://127.0.0.1:{port_file.read_text()}") as client:
            info = client.open(IMAGE, num_chunks=2)
            for index in range(2):
                client.control(info.id, index, keys="a")
            assert [c.index for c in client.chunks(info.id, timeout_s=30)] == [0, 1]
            killed = time.monotonic()
            ranks[4][0].send_signal(signal.SIGKILL)
            codes = [process.wait(timeout=30) for process, _ in ranks]
            elapsed = time.monotonic() - killed
            error = client.error(timeout_s=5)
        assert all(code != 0 for code in codes), codes
        assert elapsed < 30
        assert error is not None and error.code == "rank_failed" and "rank 4" in error.message
    finally:
        for process, log in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
            log.close()
