"""The operator command (``python -m runtime.ctl``) run as an operator runs it, a process of its own, against a real
2-rank server that requires a client token and serves its probes, and a real router with no replica (alive, never
ready): each subcommand's output and exit code (0 ok, 1 not ready, 2 usage or nothing answers, 3 refused)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq

from ipc import protocol
from ipc.aio_client import AsyncClient
from ipc.client import BadRequest, Client, ServerError, SessionDraining, input_state
from runtime import ctl
from scripts.local_router import LocalRouter
from scripts.local_server import ROOT, LocalServer
from tests.shared import FAST, free_port

pytestmark = pytest.mark.multiprocess

TOKEN = "ctl-test-token-0123456789abcdef"
OPERATOR = "ctl-operator-token-0123456789"
IMAGE = (ROOT / "assets" / "start.png").read_bytes()


@dataclass
class Fleet:
    server: LocalServer
    server_probes: str  # host:port of rank 0's probe server
    router: LocalRouter
    router_probes: str
    token_file: Path
    operator_file: Path


def run_ctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runtime.ctl", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", **(env or {})})


def until_ready(fleet: Fleet) -> subprocess.CompletedProcess[str]:
    """``ctl ready`` until it exits 0: the probe's snapshot is published by rank 0's loop once every rank is warm."""
    deadline = time.monotonic() + 60
    while (ready := run_ctl("ready", "--probe", fleet.server_probes)).returncode != ctl.OK:
        assert time.monotonic() < deadline, ready.stdout + ready.stderr
        time.sleep(0.5)  # the next look: a process per look would slow the warm-up it waits for
    return ready


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    token_file = tmp_path_factory.mktemp("ctl") / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    operator_file = token_file.with_name("operator")
    operator_file.write_text(OPERATOR)
    operator_file.chmod(0o600)
    server_port, router_port = free_port(), free_port()
    server = LocalServer("cpu-mini", [*FAST, f"--metrics.prometheus_port={server_port}",
                                      f"--server.auth_token_file={token_file}",
                                      f"--server.operator_token_file={operator_file}"])
    router = LocalRouter([], [f"--router.metrics_port={router_port}"], register_port=free_port())
    with server, router:
        yield Fleet(server, f"127.0.0.1:{server_port}", router, f"http://127.0.0.1:{router_port}", token_file,
                    operator_file)


def test_stats_prints_the_servers_stats_as_json_presenting_the_token_from_a_file_or_the_environment(
        fleet: Fleet) -> None:
    done = run_ctl("stats", "--endpoint", fleet.server.endpoint, "--token-file", str(fleet.token_file))
    assert done.returncode == ctl.OK, done.stderr
    stats = json.loads(done.stdout)
    assert stats["layout"] == "cpu-mini" and stats["uptime_s"] > 0 and "open_sessions" in stats
    by_env = run_ctl("stats", "--endpoint", fleet.server.endpoint,
                     env={"WORLDSTREAM_TOKEN_FILE": str(fleet.token_file)})
    assert by_env.returncode == ctl.OK, by_env.stderr


def test_stats_without_the_token_exits_3_saying_unauthorized(fleet: Fleet) -> None:
    done = run_ctl("stats", "--endpoint", fleet.server.endpoint)
    assert done.returncode == ctl.REFUSED, done.stderr
    assert json.loads(done.stderr.splitlines()[0])["code"] == "unauthorized"
    assert "unauthorized" in done.stderr.splitlines()[-1] and done.stdout == ""


def test_nothing_at_the_endpoint_or_the_probe_address_exits_2_and_a_bad_command_too() -> None:
    began = time.monotonic()
    done = run_ctl("stats", "--endpoint", f"tcp://127.0.0.1:{free_port()}", "--timeout", "1")
    assert done.returncode == ctl.UNREACHABLE and "no answer" in done.stderr
    assert time.monotonic() - began < 60
    done = run_ctl("ready", "--probe", f"127.0.0.1:{free_port()}")
    assert done.returncode == ctl.UNREACHABLE and "no probe server" in done.stderr
    assert run_ctl("no-such-command").returncode == 2
    assert run_ctl("stats", "--timeout", "0").returncode == 2
    assert run_ctl("stats", "--token-file", "/no/such/token").returncode == 2


def test_health_and_ready_of_a_warm_server_exit_0_with_the_probes_json(fleet: Fleet) -> None:
    health = run_ctl("health", "--probe", fleet.server_probes)
    assert health.returncode == ctl.OK, health.stderr
    assert json.loads(health.stdout) == {"alive": True, "role": "rank0"}
    ready = until_ready(fleet)
    assert json.loads(ready.stdout)["ready"] is True


def test_a_router_without_a_replica_is_healthy_but_not_ready_exit_1(fleet: Fleet) -> None:
    assert run_ctl("health", "--probe", fleet.router_probes).returncode == ctl.OK
    ready = run_ctl("ready", "--probe", fleet.router_probes)
    assert ready.returncode == ctl.NO, ready.stderr
    assert json.loads(ready.stdout)["ready"] is False


def test_drain_against_a_router_is_refused_exit_3(fleet: Fleet) -> None:
    done = run_ctl("drain", "--endpoint", fleet.router.endpoint, "--operator-token-file", str(fleet.operator_file))
    assert done.returncode == ctl.REFUSED, done.stdout + done.stderr
    assert json.loads(done.stderr.splitlines()[0])["code"] == "bad_request"


def test_drain_without_the_operator_token_is_refused_and_the_server_serves_on(fleet: Fleet, tmp_path: Path) -> None:
    client = ["--token-file", str(fleet.token_file)]
    done = run_ctl("drain", "--endpoint", fleet.server.endpoint, *client)  # no operator token at all
    assert done.returncode == ctl.UNREACHABLE and "operator token" in done.stderr
    wrong = tmp_path / "wrong"
    wrong.write_text(TOKEN)  # the client token is not the operator's
    wrong.chmod(0o600)
    done = run_ctl("drain", "--endpoint", fleet.server.endpoint, *client, "--operator-token-file", str(wrong))
    assert done.returncode == ctl.REFUSED, done.stdout + done.stderr
    assert json.loads(done.stderr.splitlines()[0])["code"] == "unauthorized"
    until_ready(fleet)  # warm (whichever test ran first) and not draining
    assert json.loads(run_ctl("ready", "--probe", fleet.server_probes).stdout)["draining"] is False


def test_the_sdks_drain_with_a_wrong_operator_token_or_at_a_router_raises_and_nothing_drains(fleet: Fleet) -> None:
    """Both SDKs, both refusals: ``unauthorized`` with the client token in place of the operator's at a server, and
    ``bad_request`` at a router (it is drained by its replicas' signals, not by a client)."""
    server, router = fleet.server.endpoint, fleet.router.endpoint
    refusals = {}
    with Client(server, token_file=str(fleet.token_file), timeout_s=60) as client, \
            Client(router, token_file=str(fleet.token_file), timeout_s=60) as routed:
        for name, endpoint, token in (("server", client, TOKEN), ("router", routed, OPERATOR)):
            with pytest.raises(ServerError) as refused:
                endpoint.drain(token)
            refusals[f"sync {name}"] = refused.value

    async def both() -> None:
        for name, endpoint, token in (("server", server, TOKEN), ("router", router, OPERATOR)):
            async with AsyncClient(endpoint, token_file=str(fleet.token_file), timeout_s=60) as client:
                with pytest.raises(ServerError) as refused:
                    await client.drain(token)
                refusals[f"async {name}"] = refused.value

    asyncio.run(both())
    codes = {name: error.code for name, error in refusals.items()}
    assert codes == {"sync server": "unauthorized", "sync router": "bad_request", "async server": "unauthorized",
                     "async router": "bad_request"}, codes
    assert isinstance(refusals["sync router"], BadRequest) and isinstance(refusals["async router"], BadRequest)
    until_ready(fleet)
    assert json.loads(run_ctl("ready", "--probe", fleet.server_probes).stdout)["draining"] is False


def test_drain_hands_off_the_servers_session_and_the_server_exits_0(fleet: Fleet) -> None:
    # last in the module: it ends the shared server
    with Client(fleet.server.endpoint, token_file=str(fleet.token_file), timeout_s=60) as client:
        info = client.open(IMAGE, num_chunks=None, live=True)
        client.control_state(info.id, input_state(["w"], revision=1))
        client.next_chunk(info.id, timeout_s=60)
        done = run_ctl("drain", "--endpoint", fleet.server.endpoint, "--token-file", str(fleet.token_file),
                       env={"WORLDSTREAM_OPERATOR_TOKEN_FILE": str(fleet.operator_file)})
        assert done.returncode == ctl.OK, done.stderr
        assert json.loads(done.stdout)["sessions"] == 1
        with pytest.raises(SessionDraining) as told:
            while True:
                client.next_chunk(info.id, timeout_s=60)
        assert told.value.snapshot and told.value.session == info.id
    assert fleet.server.wait(60) == 0, fleet.server.log()


def test_a_reply_of_another_kind_under_the_commands_request_id_exits_2_naming_it(tmp_path: Path) -> None:
    """A peer that answers ``drain`` with something else (a buggy or foreign server) is no answer: exit 2, no crash."""
    operator = tmp_path / "operator"
    operator.write_text(OPERATOR)
    operator.chmod(0o600)
    context = zmq.Context.instance()
    server = context.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    port = server.bind_to_random_port("tcp://127.0.0.1")

    def answer_wrongly() -> None:
        if server.poll(60_000):
            who, data = server.recv_multipart()
            asked = protocol.decode(data, "client", max_bytes=1 << 20)
            server.send_multipart([who, protocol.encode(protocol.Accepted(req=asked.req, session="s", index=0))])

    thread = threading.Thread(target=answer_wrongly, daemon=True)
    thread.start()
    try:
        code = ctl.main(["drain", "--endpoint", f"tcp://127.0.0.1:{port}", "--operator-token-file", str(operator),
                         "--timeout", "60"])
    finally:
        thread.join(timeout=60)
        server.close()
    assert code == ctl.UNREACHABLE
