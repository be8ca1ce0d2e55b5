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
from typing import TypeVar

import psutil

ROOT = Path(__file__).resolve().parent.parent


class ServerFailed(RuntimeError):
    pass


_Process = TypeVar("_Process", bound="LocalProcess")


class LocalProcess:
    """A local subprocess that writes its port to a file once it serves (the server, the router, the gateway):
    started and waited for, stopped with SIGTERM (killed after ``stop_timeout_s``), its log kept in a file."""

    kind = "process"  # in error messages and the temporary directory's name
    failure: type[Exception] = RuntimeError
    stop_timeout_s = 30.0

    def __init__(self, startup_s: float, log_path: Path | None) -> None:
        self.startup_s = startup_s
        self._dir = tempfile.TemporaryDirectory(prefix=f"worldstream-{self.kind}-")
        self.log_path = log_path or Path(self._dir.name) / f"{self.kind}.log"
        self.port_file = Path(self._dir.name) / "port"
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.started_s = 0.0  # launch -> serving

    def _spawn(self, command: list[str], env: dict[str, str] | None = None, new_session: bool = False) -> None:
        """Start ``command`` and wait until its port file holds the port."""
        began = time.monotonic()
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - kept open for the process's lifetime
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=new_session)
        while not self.port_file.exists() or not self.port_file.read_text():
            if self.process.poll() is not None:
                raise self.failure(f"{self.kind} exited with {self.process.returncode} before serving:\n{self.log()}")
            if time.monotonic() - began > self.startup_s:
                self.stop()
                raise self.failure(f"{self.kind} not serving after {self.startup_s:.0f} s:\n{self.log()}")
            time.sleep(0.05)
        self.port = int(self.port_file.read_text())
        self.started_s = time.monotonic() - began

    def start(self: _Process) -> _Process:
        raise NotImplementedError

    def stop(self, timeout_s: float | None = None) -> int:
        """SIGTERM, then a kill after ``timeout_s``; the exit code."""
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=self.stop_timeout_s if timeout_s is None else timeout_s)
            except subprocess.TimeoutExpired:
                self._kill()
                self.process.wait()
        return self.process.returncode

    def _kill(self) -> None:
        assert self.process is not None
        self.process.kill()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    def __enter__(self: _Process) -> _Process:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if self.process is not None:
            self._log.close()


class LocalServer(LocalProcess):
    kind = "server"
    failure = ServerFailed

    def __init__(self, config: str, overrides: list[str] | None = None, startup_s: float = 120.0,
                 log_path: Path | None = None, env: dict[str, str] | None = None) -> None:
        super().__init__(startup_s, log_path)
        self.config = config
        self.overrides = list(overrides or [])
        self.env = env or {}

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def start(self) -> LocalServer:
        env = {**os.environ, "WORLDSTREAM_PORT_FILE": str(self.port_file), "PYTHONUNBUFFERED": "1", **self.env}
        self._spawn([sys.executable, str(ROOT / "launch.py"), "--config", self.config, "--server.port=0",
                     *self.overrides], env)
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

    def _kill(self) -> None:  # SIGTERM goes to the launcher (forwarded to rank 0); a kill takes torchrun's ranks too
        assert self.process is not None
        for child in psutil.Process(self.process.pid).children(recursive=True):
            child.kill()
        self.process.kill()
