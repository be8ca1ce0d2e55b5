"""The README's CPU quick starts, run as written: the commands are read from the README itself, each ``python`` is
this interpreter and each port the README names is swapped for a free one (other servers may hold 5555 on this
machine); nothing else changes. ``tests/test_docs.py`` checks that every other README command is run by ``.ci/run``
or says what it needs."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from ipc.client import Client
from scripts.ports import free_port

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
STARTUP_S = 240.0


def section_blocks(heading: str, fence: str = "bash") -> list[str]:
    """The fenced blocks of the README section ``### heading`` (up to the next heading)."""
    body = README.split(f"### {heading}\n", 1)[1].split("\n#", 1)[0]
    return re.findall(rf"```{fence}\n(.*?)```", body, re.DOTALL)


def commands(block: str) -> list[str]:
    """A shell block's commands, continuations joined and trailing comments dropped."""
    joined = re.sub(r"\\\n\s*", "", block)
    return [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip()]


CPU_SERVER_AND_CLIENT = commands(section_blocks("CPU: a server and a client")[0])
ROUTER = commands(section_blocks("Many replicas behind a router")[0])
PLAY = commands(section_blocks("Play in a browser")[0])
SDK = section_blocks("The client SDK in ten lines", "python")[0]
RUN_AS_WRITTEN = frozenset(CPU_SERVER_AND_CLIENT + ROUTER + PLAY)


def localised(command: str, ports: dict[int, int]) -> list[str]:
    """``command`` as argv with this interpreter for ``python`` and the README's ports swapped for free ones."""
    for readme_port, port in ports.items():
        command = re.sub(rf"(?<=[:=]){readme_port}\b", str(port), command)
    argv = shlex.split(command)
    return [sys.executable if argv[0] == "python" else argv[0], *argv[1:]]


def environment(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


@contextmanager
def serving(argv: list[str], tmp_path: Path, name: str, **env: str) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``argv`` (a server, router or gateway writing its port to ``WORLDSTREAM_PORT_FILE``), wait until it
    serves, and on exit stop it with SIGTERM and check it exited 0."""
    port_file = tmp_path / f"{name}.port"
    log = (tmp_path / f"{name}.log").open("wb")
    process = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                               env=environment(WORLDSTREAM_PORT_FILE=str(port_file), **env))
    try:
        deadline = time.monotonic() + STARTUP_S
        while not port_file.exists():
            tail = (tmp_path / f"{name}.log").read_text()[-3000:]
            assert process.poll() is None, f"{name} exited {process.returncode}: {tail}"
            assert time.monotonic() < deadline, f"{name} not serving within {STARTUP_S} s"
            time.sleep(0.2)
        yield process
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, f"{name} did not exit 0 after SIGTERM"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()


def test_the_readme_cpu_server_client_and_sdk_run_as_written_and_the_server_exits_0_on_sigterm(
        tmp_path: Path) -> None:
    server, client = CPU_SERVER_AND_CLIENT
    assert server.startswith("python launch.py --config cpu-tiny")
    ports = {5555: free_port()}
    with serving([*localised(server, ports), f"--server.port={ports[5555]}"], tmp_path, "server"):
        done = subprocess.run(localised(client, ports), cwd=ROOT, env=environment(), capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert (ROOT / "out" / "run.mp4").stat().st_size > 0 and (ROOT / "out" / "run.json").exists()
        sdk = SDK.replace("tcp://127.0.0.1:5555", f"tcp://127.0.0.1:{ports[5555]}")
        ran = subprocess.run([sys.executable, "-c", sdk], cwd=ROOT, env=environment(), capture_output=True,
                             text=True, timeout=300)
        assert ran.returncode == 0, ran.stderr[-3000:]
        lines = ran.stdout.splitlines()
        assert [line.split()[0] for line in lines[:8]] == [str(i) for i in range(8)], ran.stdout
        assert len(lines) == 9 and lines[8].startswith("chunk period p50:"), ran.stdout


def test_the_readme_play_command_serves_the_page(tmp_path: Path) -> None:
    assert PLAY == ["make play"]
    recipe = (ROOT / "Makefile").read_text().split("\nplay:", 1)[1].split("\n\n", 1)[0]
    assert "$(PY) scripts/play.py" in recipe  # what `make play` runs once .venv exists
    log = (tmp_path / "play.log").open("wb")
    process = subprocess.Popen([sys.executable, "scripts/play.py", "--port", "0"], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=log, start_new_session=True, env=environment())
    try:
        assert process.stdout is not None
        url = None
        deadline = time.monotonic() + STARTUP_S
        while url is None and time.monotonic() < deadline:
            line = process.stdout.readline().decode()
            assert line or process.poll() is None, (tmp_path / "play.log").read_text()[-3000:]
            found = re.search(r"open (http://127\.0\.0\.1:\d+/)", line)
            url = found.group(1) if found else None
        assert url is not None
        import urllib.request

        with urllib.request.urlopen(url, timeout=30) as reply:
            assert reply.status == 200 and b"worldstream" in reply.read()
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()


def test_the_readme_router_quick_start_runs_as_written(tmp_path: Path) -> None:
    router, replica_a, replica_b, client = ROUTER
    ports = {port: free_port() for port in (5555, 5556, 5560, 5561)}
    with ExitStack() as stack:
        # the router's ports come from its config file (5560, 5561): swapped by overrides, as the others'
        swapped = [f"--router.port={ports[5560]}", f"--router.register_bind=tcp://127.0.0.1:{ports[5561]}"]
        stack.enter_context(serving([*localised(router, ports), *swapped], tmp_path, "router"))
        stack.enter_context(serving(localised(replica_a, ports), tmp_path, "a"))
        stack.enter_context(serving(localised(replica_b, ports), tmp_path, "b"))
        with Client(f"tcp://127.0.0.1:{ports[5560]}") as probe:
            deadline = time.monotonic() + 60
            while {name: r.state for name, r in probe.stats().replicas.items()} != {"a": "up", "b": "up"}:
                assert time.monotonic() < deadline, "both replicas up at the router"
                time.sleep(0.2)
        done = subprocess.run(localised(client, ports), cwd=ROOT, env=environment(), capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
