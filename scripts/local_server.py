"""Start a worldstream server on this machine as a subprocess (demo, benchmarks, multi-process tests).

    with LocalServer("cpu-tiny", overrides=["--synthetic.denoise_s=0.1"]) as server:
        client = Client(server.endpoint)

It runs ``python launch.py`` (which starts a local torchrun), picks a free client port, waits until every
rank reported in, and on exit stops the job with SIGTERM and checks how it ended.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent


class ServerFailed(RuntimeError):
    pass


class LocalServer:
    def __init__(self, config: str, overrides: list[str] | None = None, startup_s: float = 120.0,
                 log_path: Path | None = None, env: dict[str, str] | None = None) -> None:
        self.config = config
        self.overrides = list(overrides or [])
        self.startup_s = startup_s
        self._dir = tempfile.TemporaryDirectory(prefix="worldstream-server-")
        self.log_path = log_path or Path(self._dir.name) / "server.log"
        self.env = env or {}
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.started_s = 0.0  # launch -> serving

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def start(self) -> LocalServer:
        port_file = Path(self._dir.name) / "port"
        env = {**os.environ, "WORLDSTREAM_PORT_FILE": str(port_file), "PYTHONUNBUFFERED": "1", **self.env}
        command = [sys.executable, str(ROOT / "launch.py"), "--config", self.config, "--server.port=0",
                   *self.overrides]
        began = time.monotonic()
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - kept open for the server's lifetime
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        while not port_file.exists():
            if self.process.poll() is not None:
                raise ServerFailed(f"server exited with {self.process.returncode} before serving:\n{self.log()}")
            if time.monotonic() - began > self.startup_s:
                self.stop()
                raise ServerFailed(f"server not serving after {self.startup_s:.0f} s:\n{self.log()}")
            time.sleep(0.1)
        self.port = int(port_file.read_text())
        self.started_s = time.monotonic() - began
        return self

    def ranks(self) -> dict[int, psutil.Process]:
        """The rank processes by rank (children of torchrun carrying RANK in their environment)."""
        assert self.process is not None
        out = {}
        for child in psutil.Process(self.process.pid).children(recursive=True):
            try:
                rank = child.environ().get("RANK")
                if rank is not None and "launch.py" in " ".join(child.cmdline()):
                    out[int(rank)] = child
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return out

    def kill_rank(self, rank: int) -> None:
        self.ranks()[rank].send_signal(signal.SIGKILL)

    def wait(self, timeout_s: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout=timeout_s)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM to the launcher (forwarded to rank 0, which shuts every rank down); the exit code."""
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                for child in psutil.Process(self.process.pid).children(recursive=True):
                    child.kill()
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._log.close()
