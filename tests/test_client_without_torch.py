"""A control client installs and runs the SDK without torch: the package's own dependencies are the SDK's three
(pyzmq, msgspec, numpy), the server's are the ``server`` extra, and both SDKs stream a session from a real server
in a process where torch (and every other server-side package) cannot be imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runtime.config import tomllib
from scripts.local_server import LocalServer

ROOT = Path(__file__).resolve().parent.parent
SDK_DEPENDENCIES = {"pyzmq", "msgspec", "numpy"}
SERVER_ONLY = ("torch", "PIL", "psutil", "safetensors", "tokenizers", "ftfy", "aiohttp")


def _name(requirement: str) -> str:
    return requirement.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip()


def test_the_package_depends_on_the_sdks_three_and_the_server_extra_pins_torch() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert {_name(r) for r in project["dependencies"]} == SDK_DEPENDENCIES
    server = project["optional-dependencies"]["server"]
    assert "torch==2.13.0" in server
    every = [r for extra in project["optional-dependencies"].values() for r in extra] + project["dependencies"]
    assert "msgpack" not in {_name(r) for r in every}  # msgspec speaks MessagePack
    makefile = (ROOT / "Makefile").read_text()
    assert '".[server,' in makefile  # the README's two commands still install the server


BLOCK = f"""
import sys
class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {SERVER_ONLY!r}:
            raise ImportError(f"{{name}} is blocked: the SDK must not need it")
sys.meta_path.insert(0, _Blocked())
"""

STREAM = """
import asyncio
from ipc.client import Client
from ipc.aio_client import AsyncClient
image = open(sys.argv[2], "rb").read()
with Client(sys.argv[1], timeout_s=60) as client:
    info = client.open(image, prompt="no torch here", num_chunks=3, live=True)
    indices = [chunk.index for chunk in client.chunks(info.id)]
    print("sync", indices)
async def main():
    async with AsyncClient(sys.argv[1], timeout_s=60) as client:
        info = await client.open(image, num_chunks=2, live=True)
        indices = [chunk.index async for chunk in client.chunks(info.id)]
        print("async", indices)
asyncio.run(main())
assert not any(m.split(".")[0] in {blocked} for m in sys.modules), "a server-side module was imported"
"""


@pytest.mark.multiprocess
def test_both_sdks_stream_a_session_from_a_real_server_with_torch_unimportable(shared_server: LocalServer) -> None:
    script = BLOCK + textwrap.dedent(STREAM).replace("{blocked}", repr(SERVER_ONLY))
    done = subprocess.run([sys.executable, "-c", script, shared_server.endpoint, str(ROOT / "assets/start.png")],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sync [0, 1, 2]" in done.stdout
    assert "async [0, 1]" in done.stdout
