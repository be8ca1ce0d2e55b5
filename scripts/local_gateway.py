"""Start the web gateway (``python -m web``) on this machine as a subprocess (``make play``, benchmarks, tests).

    with LocalServer("cpu-tiny") as server, LocalGateway(server.endpoint) as gateway:
        print(gateway.url)

It picks a free port unless given one, waits until the gateway serves (it checks the server answers first), and
on exit stops it with SIGTERM (the gateway then closes every tab's session on the server).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.local_server import ROOT


class LocalGateway:
    """``python -m web`` as a subprocess against ``endpoint``; ``url`` once it serves (tests, bench, ``make play``)."""

    def __init__(self, endpoint: str, port: int = 0, args: list[str] | None = None, log_path: Path | None = None,
                 startup_s: float = 30.0) -> None:
        self.endpoint = endpoint
        self.port = port
        self.args = list(args or [])
        self.startup_s = startup_s
        self._dir = tempfile.TemporaryDirectory(prefix="worldstream-web-")
        self.log_path = log_path or Path(self._dir.name) / "gateway.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self) -> LocalGateway:
        port_file = Path(self._dir.name) / "port"
        command = [sys.executable, "-m", "web", "--server", self.endpoint, "--port", str(self.port),
                   "--port-file", str(port_file), *self.args]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - kept open for the gateway's lifetime
        # its own session: a Ctrl-C at the terminal reaches the caller, which stops the gateway once (SIGTERM)
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        began = time.monotonic()
        while not port_file.exists() or not port_file.read_text():
            if self.process.poll() is not None:
                self._log.close()
                raise RuntimeError(f"gateway exited with {self.process.returncode}:\n{self.log()}")
            if time.monotonic() - began > self.startup_s:
                self.stop()
                raise RuntimeError(f"gateway not serving after {self.startup_s:.0f} s:\n{self.log()}")
            time.sleep(0.05)
        self.port = int(port_file.read_text())
        self.url = f"http://127.0.0.1:{self.port}/"
        return self

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    def __enter__(self) -> LocalGateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._log.close()
