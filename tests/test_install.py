"""A non-editable install, as a user gets it: the wheel built from this checkout carries every console command, the
config presets and the top-level ``launch`` module; installed into a fresh virtual environment (its dependencies
borrowed from this one's site-packages, never from the checkout), the commands run from outside the checkout: the
installed server starts by preset name, the installed ``worldstream-ctl`` reads its stats and the installed SDK
streams a session from it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from runtime import config as config_mod
from scripts.local_server import ROOT

pytestmark = pytest.mark.multiprocess

COMMANDS = {"worldstream-server": "launch:main", "worldstream-router": "router.shell:main",
            "worldstream-web": "web.__main__:main", "worldstream-client": "scripts.client:main",
            "worldstream-ctl": "runtime.ctl:main"}
STREAM = """
import sys
from pathlib import Path
import ipc.client
from ipc.client import Client
assert not ipc.client.__file__.startswith(sys.argv[2]), ipc.client.__file__  # the installed copy, not the checkout
with Client(sys.argv[1], timeout_s=120) as client:
    info = client.open(Path(sys.argv[3]).read_bytes(), num_chunks=2)
    for index in range(2):
        client.control(info.id, index, keys="w")
    print([chunk.index for chunk in client.chunks(info.id, timeout_s=120)])
"""


@dataclass
class Installed:
    wheel: Path
    venv: Path
    home: Path  # a folder outside the checkout: the commands run from here

    def run(self, command: str, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.venv / "bin" / command), *args], capture_output=True, text=True,
                              cwd=self.home, timeout=timeout_s, env=self.env())

    def env(self) -> dict[str, str]:
        return {"PATH": f"{self.venv / 'bin'}:/usr/bin:/bin", "HOME": str(self.home), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    source, out, home = (tmp_path_factory.mktemp(name) for name in ("source", "wheel", "home"))
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    with tarfile.open(source / "tree.tar", "w") as tree:  # what git tracks (or would): no build/, no .venv
        for name in filter(None, listed):
            if (ROOT / name).is_file():
                tree.add(ROOT / name, arcname=name)
    with tarfile.open(source / "tree.tar") as tree:
        tree.extractall(source / "tree", filter="data")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", ".", "-w",
                    str(out)], cwd=source / "tree", check=True, capture_output=True, timeout=600)
    wheel = next(out.glob("worldstream-*.whl"))
    venv = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python3*/site-packages"))
    # the dependencies (and pip) from this interpreter's site-packages: a path in a .pth file is not itself scanned
    # for .pth files, so this environment's editable finder of the checkout stays out
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True, capture_output=True, timeout=300, cwd=home)
    return Installed(wheel, venv, home)


def test_the_wheel_carries_every_command_the_presets_and_the_launch_module(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = set(wheel.namelist())
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        listed = wheel.read(entry_points).decode()
    for command, target in COMMANDS.items():
        assert f"{command} = {target}" in listed, listed
    presets = {p.name for p in config_mod.CONFIG_DIR.glob("*.toml")}
    assert presets and {f"configs/{name}" for name in presets} <= names
    assert "configs/router/router.toml" in names
    assert {"launch.py", "runtime/ctl.py", "scripts/client.py", "web/static/index.html"} <= names, sorted(names)[:20]
    assert not any(n.startswith(("tests/", "scripts/slurm/", "docs/")) for n in names)


def test_every_installed_command_answers_help_from_outside_the_checkout(installed: Installed) -> None:
    for command in COMMANDS:
        done = installed.run(command, "--help")
        assert done.returncode == 0, f"{command}: {done.stderr[-2000:]}"
    located = subprocess.run([str(installed.venv / "bin" / "python"), "-c", "import runtime, launch, configs; "
                              "print(runtime.__file__, launch.__file__, configs.__file__)"],
                             capture_output=True, text=True, cwd=installed.home, env=installed.env(), check=True)
    assert str(ROOT) not in located.stdout and located.stdout.count(str(installed.venv)) == 3, located.stdout


def test_the_installed_server_finds_its_presets_by_name(installed: Installed) -> None:
    done = installed.run("worldstream-server", "--config", "cpu-mini", "--print-config")
    assert done.returncode == 0, done.stderr
    assert 'name = "cpu-mini"' in done.stdout


@pytest.fixture(scope="module")
def served(installed: Installed) -> Iterator[str]:
    port_file = installed.home / "port"
    log = (installed.home / "server.log").open("wb")
    server = subprocess.Popen([str(installed.venv / "bin" / "worldstream-server"), "--config", "cpu-mini",
                               "--server.port=0", "--synthetic.encode_s=0.01", "--synthetic.denoise_s=0.03",
                               "--synthetic.decode_s=0.015"], cwd=installed.home, stdout=log, stderr=subprocess.STDOUT,
                              env={**installed.env(), "WORLDSTREAM_PORT_FILE": str(port_file)})
    try:
        deadline = time.monotonic() + 180
        while not (port_file.exists() and port_file.read_text()):
            assert server.poll() is None and time.monotonic() < deadline, (installed.home / "server.log").read_text()
            time.sleep(0.1)
        yield f"tcp://127.0.0.1:{port_file.read_text()}"
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
        log.close()
    assert code == 0, (installed.home / "server.log").read_text()[-4000:]


def test_the_installed_ctl_and_sdk_talk_to_the_installed_server(installed: Installed, served: str) -> None:
    stats = installed.run("worldstream-ctl", "stats", "--endpoint", served, "--timeout", "30")
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["layout"] == "cpu-mini"
    streamed = subprocess.run([str(installed.venv / "bin" / "python"), "-c", STREAM, served, str(ROOT),
                               str(ROOT / "assets" / "start.png")], capture_output=True, text=True,
                              cwd=installed.home, env=installed.env(), timeout=300)
    assert streamed.returncode == 0, streamed.stderr[-3000:]
    assert streamed.stdout.strip() == "[0, 1]"
    assert os.path.exists(installed.venv / "bin" / "worldstream-client")
