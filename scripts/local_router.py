"""Start a router on this machine as a subprocess (multi-process tests, ``scripts/bench_router.py``).

    with LocalRouter([("a", server_a.endpoint, 2)], register_port=free_port()) as router:
        client = Client(router.endpoint)

It writes a router config (the listed replicas, ``router.register_bind`` on loopback when ``register_port`` is
given), runs ``python -m ranks.router`` on a free client port, waits until it serves, and on exit stops it with
SIGTERM and returns its exit code. ``Streamer`` is a session that streams until told to stop or until it fails (the
failover test and benchmark kill replicas under it).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ipc.client import Client, ServerError
from scripts.local_server import LocalProcess


def wait_for(what: str, predicate: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until ``predicate`` held (polled); an ``AssertionError`` after ``timeout_s`` (a failed test or run)."""
    began = time.monotonic()
    while not predicate():
        if time.monotonic() - began > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.05)
    return time.monotonic() - began


def replica_of(client: Client, session: str) -> str:
    return client.stats().per_session[session].replica


class RouterFailed(RuntimeError):
    pass


class LocalRouter(LocalProcess):
    kind = "router"
    failure = RouterFailed
    stop_timeout_s = 10.0

    def __init__(self, replicas: list[tuple[str, str, int]], overrides: list[str] | None = None,
                 register_port: int | None = None, log_path: Path | None = None, startup_s: float = 30.0) -> None:
        super().__init__(startup_s, log_path)
        self.replicas = replicas
        self.overrides = list(overrides or [])
        self.register_port = register_port
        self.config_path = Path(self._dir.name) / "router.toml"

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def register_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.register_port}"

    def start(self) -> LocalRouter:
        lines = ["[router]", 'host = "127.0.0.1"', "port = 0"]
        if self.register_port is not None:
            lines.append(f'register_bind = "tcp://127.0.0.1:{self.register_port}"')
        for name, endpoint, max_sessions in self.replicas:
            lines += ["", "[[replicas]]", f'name = "{name}"', f'endpoint = "{endpoint}"',
                      f"max_sessions = {max_sessions}"]
        self.config_path.write_text("\n".join(lines) + "\n")
        env = {**os.environ, "WORLDSTREAM_PORT_FILE": str(self.port_file), "PYTHONUNBUFFERED": "1"}
        self._spawn([sys.executable, "-m", "ranks.router", "--config", str(self.config_path), *self.overrides], env)
        return self


@dataclass
class Streamer:
    """A session that streams one chunk per control (sent once the previous chunk arrived) until ``stop`` is set,
    then closes; or until the session fails, keeping the error and when it came (client monotonic clock)."""

    client: Client
    session: str
    replica: str = ""
    chunks: list[tuple[int, float]] = field(default_factory=list)  # (index, arrival)
    error: ServerError | None = None
    error_at: float = 0.0
    summary: dict[str, Any] | None = None
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        index = 0
        try:
            while not self.stop.is_set():
                # fire and forget: a control in flight when its replica dies gets no answer; the session's error does
                self.client.control(self.session, index, keys="w", wait=False)
                chunk = self.client.next_chunk(self.session, timeout_s=30)
                self.chunks.append((chunk.index, time.monotonic()))
                index += 1
            self.summary = self.client.close(self.session)
        except ServerError as error:
            self.error, self.error_at = error, time.monotonic()

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, daemon=True)
        thread.start()
        return thread
