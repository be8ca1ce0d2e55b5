"""Start the web gateway (``python -m web``) on this machine as a subprocess (``make play``, benchmarks, tests).

    with LocalServer("cpu-tiny") as server, LocalGateway(server.endpoint) as gateway:
        print(gateway.url)

It picks a free port unless given one, waits until the gateway serves (it checks the server answers first), and
on exit stops it with SIGTERM (the gateway then closes every tab's session on the server).
"""

from __future__ import annotations

import sys
from pathlib import Path

from scripts.local_server import LocalProcess


class LocalGateway(LocalProcess):
    """``python -m web`` as a subprocess against ``endpoint``; ``url`` once it serves (tests, bench, ``make play``)."""

    kind = "gateway"

    def __init__(self, endpoint: str, port: int = 0, args: list[str] | None = None, log_path: Path | None = None,
                 startup_s: float = 30.0) -> None:
        super().__init__(startup_s, log_path)
        self.endpoint = endpoint
        self.port = port
        self.args = list(args or [])
        self.url = ""

    def start(self) -> LocalGateway:
        # its own session: a Ctrl-C at the terminal reaches the caller, which stops the gateway once (SIGTERM)
        self._spawn([sys.executable, "-m", "web", "--server", self.endpoint, "--port", str(self.port),
                     "--port-file", str(self.port_file), *self.args], new_session=True)
        self.url = f"http://127.0.0.1:{self.port}/"
        return self
