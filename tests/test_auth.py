"""The client token (``ipc.auth``): a server or router bound beyond loopback refuses to start without one (unless
``insecure`` says so), answers every request that lacks it, carries another or one of another length with a bare
``unauthorized`` and changes nothing (no session, nothing counted but the refusal), and serves the right one. The
router checks its clients' token and presents its replicas' own. Real processes: one 2-rank server bound to
0.0.0.0 and one router in front of it, shared by the module; the pure rules are tested without them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from ipc import auth, protocol, relay
from ipc.client import Client
from runtime import config as config_mod
from runtime import router_config
from runtime.client_types import ClientSent, ClientUnreadable
from runtime.clients import unauthorized
from scripts.local_gateway import LocalGateway
from scripts.local_router import LocalRouter
from scripts.local_server import ROOT, LocalServer
from tests.shared import FAST, free_port

IMAGE = (ROOT / "assets" / "start.png").read_bytes()
SERVER_TOKEN = "s3cret-of-the-replicas-0123456789abcdef"
ROUTER_TOKEN = "router-clients-token-fedcba9876543210xyz"
WRONG_SAME_LENGTH = "x" * len(SERVER_TOKEN)  # differs from the right one everywhere, never by chance only at the end
STRANGERS = {"none": msgspec.UNSET, "wrong": WRONG_SAME_LENGTH, "shorter": SERVER_TOKEN[:-1],
             "longer": SERVER_TOKEN + "0"}


# ------------------------------------------------------------------------------------------------ the rules


def test_only_the_exact_token_is_accepted_and_none_is_needed_where_none_is_required() -> None:
    assert auth.accepts("abc", "abc")
    for given in ("abd", "ab", "abcd", "", msgspec.UNSET):
        assert not auth.accepts("abc", given), given
    assert auth.accepts(None, msgspec.UNSET) and auth.accepts(None, "anything")


def test_a_request_without_a_token_is_byte_for_byte_what_it_was_before_the_field() -> None:
    before = msgspec.msgpack.encode({"type": "stats", "req": 3, "v": protocol.PROTOCOL_VERSION})
    assert protocol.encode(protocol.Stats(req=3)) == before
    with_token = protocol.decode(protocol.encode(protocol.Stats(req=3, auth="t")), "client")
    assert with_token.auth == "t"


def test_the_cores_refuse_a_message_without_the_token_before_anything_and_an_unreadable_one_without_detail() -> None:
    sent = ClientSent(b"who", protocol.Open(req=4, image=b"x", auth="nope"))
    who, error, req = unauthorized("right", sent) or (None, None, None)
    assert (who, error.code, str(error), req) == (b"who", "unauthorized", "unauthorized", 4)
    assert unauthorized("right", ClientSent(b"who", protocol.Stats(req=1, auth="right"))) is None
    assert unauthorized(None, sent) is None
    refused = unauthorized("right", ClientUnreadable(b"who", "field 'x' of ... is wrong", 9))
    assert refused is not None and str(refused[1]) == "unauthorized" and refused[2] == 9


def test_the_router_sends_its_replicas_their_token_never_its_clients_and_forwards_bytes_as_they_are_without() -> None:
    raw = protocol.encode(protocol.Close(req=2, session="s", auth=ROUTER_TOKEN))
    upstream = protocol.decode(relay.upstream(raw, SERVER_TOKEN, True, 1 << 20), "client")
    assert upstream == protocol.Close(req=2, session="s", auth=SERVER_TOKEN)
    stripped = protocol.decode(relay.upstream(raw, None, True, 1 << 20), "client")
    assert stripped.auth is msgspec.UNSET
    plain = protocol.encode(protocol.Close(req=2, session="s"))
    assert relay.upstream(plain, None, False, 1 << 20) is plain
    assert protocol.decode(relay.upstream(protocol.Stats(req=-1), SERVER_TOKEN, True, 1 << 20), "client").auth == \
        SERVER_TOKEN


def test_a_client_port_beyond_loopback_needs_a_token_or_an_explicit_insecure(tmp_path: Path) -> None:
    with pytest.raises(config_mod.ConfigError, match=r"beyond loopback.*server.auth_token_file.*server.insecure"):
        config_mod.load("cpu-mini", ["--server.host=0.0.0.0"])
    config_mod.load("cpu-mini", ["--server.host=0.0.0.0", "--server.insecure=true"])
    config_mod.load("cpu-mini", ["--server.host=127.0.0.1"])  # loopback: no token needed
    token = tmp_path / "token"
    token.write_text(f"{SERVER_TOKEN}\n")
    loaded = config_mod.load("cpu-mini", ["--server.host=0.0.0.0", f"--server.auth_token_file={token}"])
    assert config_mod.client_token(loaded.server) == SERVER_TOKEN
    token.write_text("")
    with pytest.raises(config_mod.ConfigError, match="empty"):
        config_mod.load("cpu-mini", ["--server.host=0.0.0.0", f"--server.auth_token_file={token}"])
    with pytest.raises(config_mod.ConfigError, match=r"\$NO_SUCH_TOKEN_VARIABLE is empty"):
        config_mod.load("cpu-mini", ["--server.host=0.0.0.0", '--server.auth_token_env="NO_SUCH_TOKEN_VARIABLE"'])
    router = tmp_path / "router.toml"
    router.write_text('[router]\nhost = "0.0.0.0"\n\n[[replicas]]\nname = "a"\nendpoint = "tcp://127.0.0.1:1"\n'
                      "max_sessions = 1\n")
    with pytest.raises(config_mod.ConfigError, match=r"router.auth_token_file.*router.insecure"):
        router_config.load(router)
    router_config.load(router, ["--router.insecure=true"])


def test_only_addresses_of_this_host_count_as_loopback_not_names_that_look_like_one() -> None:
    assert all(auth.is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"))
    assert not any(auth.is_loopback(h) for h in ("0.0.0.0", "10.0.0.7", "127.example.net", "127.0.0.1.nip.io", "::",
                                                 "node7", ""))
    with pytest.raises(config_mod.ConfigError, match="beyond loopback"):
        config_mod.load("cpu-mini", ["--server.host=127.example.net"])


def test_a_token_file_others_can_read_is_used_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    token = tmp_path / "token"
    token.write_text(SERVER_TOKEN)
    token.chmod(0o600)
    with caplog.at_level("WARNING", logger="ipc.auth"):
        assert auth.read_token(str(token)) == SERVER_TOKEN
        assert not caplog.records
        token.chmod(0o644)
        assert auth.read_token(str(token)) == SERVER_TOKEN
    assert any("readable by others" in r.getMessage() and str(token) in r.getMessage() for r in caplog.records)


def test_a_server_bound_beyond_loopback_without_a_token_exits_2_naming_the_keys() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--config", "cpu-mini", "--server.host=0.0.0.0",
                           "--check"], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "server.auth_token_file" in done.stderr and "server.insecure" in done.stderr


def test_the_sdk_takes_its_token_from_the_argument_a_file_or_the_environment(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "token"
    file.write_text(" from-file \n")
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    monkeypatch.delenv(auth.TOKEN_FILE_ENV, raising=False)
    assert auth.client_token() is None
    assert auth.client_token("given") == "given"
    assert auth.client_token(token_file=str(file)) == "from-file"
    monkeypatch.setenv(auth.TOKEN_FILE_ENV, str(file))
    assert auth.client_token() == "from-file"
    monkeypatch.setenv(auth.TOKEN_ENV, "from-env")
    assert auth.client_token() == "from-env"


# ------------------------------------------------------------------------------------------------ real processes


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalServer, LocalRouter]]:
    folder = tmp_path_factory.mktemp("tokens")
    server_file, router_file = folder / "replicas.token", folder / "clients.token"
    server_file.write_text(SERVER_TOKEN)
    router_file.write_text(ROUTER_TOKEN)
    for file in (server_file, router_file):
        file.chmod(0o600)
    router = LocalRouter([], ["--router.host=0.0.0.0", f"--router.auth_token_file={router_file}",
                              "--router.replica_token_env=REPLICA_TOKEN_FOR_TEST"], register_port=free_port())
    # the replica registers itself: its registration thread asks its own server for its id, with the token too
    server = LocalServer("cpu-mini", [*FAST, "--server.host=0.0.0.0", f"--server.auth_token_file={server_file}",
                                      f"--replica.router={router.register_endpoint}", "--replica.name=a"])
    os.environ["REPLICA_TOKEN_FOR_TEST"] = SERVER_TOKEN  # the router's environment, read once at its start
    try:
        router.start()
    finally:
        os.environ.pop("REPLICA_TOKEN_FOR_TEST", None)
    try:
        with server:
            with Client(router.endpoint, timeout_s=60, token=ROUTER_TOKEN) as client:
                deadline = time.monotonic() + 120
                while client.stats().total.replicas_up < 1:
                    assert time.monotonic() < deadline, f"no replica up:\n{server.log()}\n{router.log()}"
                    time.sleep(0.1)
            yield server, router
    finally:
        router.__exit__(None, None, None)  # started above, while its environment held the replicas' token
    assert server.process is not None and server.process.returncode == 0, server.log()


def _requests(session: str) -> list[protocol.ClientMessage]:
    """One of every request kind, each of which would change something if it were served."""
    return [protocol.Open(req=1, image=IMAGE, num_chunks=3), protocol.Watch(req=2, session=session, token="t" * 22),
            protocol.Stats(req=3), protocol.Heartbeat(req=4, session=session),
            protocol.Control(req=5, session=session, index=0), protocol.Close(req=6, session=session),
            protocol.Save(req=7, session=session), protocol.SetPrompt(req=8, session=session, prompt="x")]


def _answers(endpoint: str, messages: list[bytes], timeout_s: float = 60.0) -> list[protocol.Error]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        for data in messages:
            sock.send(data)
        answers = []
        deadline = time.monotonic() + timeout_s
        while len(answers) < len(messages) and sock.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
            answers.append(protocol.decode(sock.recv(), "server"))
        return answers
    finally:
        sock.close()


def _strangers_are_refused_and_change_nothing(endpoint: str, token: str, session: str) -> None:
    with Client(endpoint, timeout_s=60, token=token) as client:
        before = client.stats()
    sent = [protocol.encode(msgspec.structs.replace(m, auth=value))
            for value in STRANGERS.values() for m in _requests(session)]
    sent.append(b"\x81\xa4type\xc0")  # unreadable: no token could be read from it, so no detail either
    answers = _answers(endpoint, sent)
    assert len(answers) == len(sent)
    for answer in answers:
        assert isinstance(answer, protocol.Error), answer
        assert (answer.code, answer.message, answer.session, answer.retry_after_s) == \
            ("unauthorized", "unauthorized", None, None)
    with Client(endpoint, timeout_s=60, token=token) as client:
        after = client.stats()
    assert after.sessions == before.sessions and after.open_sessions == before.open_sessions
    assert after.rejects.get("unauthorized", 0) - before.rejects.get("unauthorized", 0) == len(sent)
    assert {k: v for k, v in after.rejects.items() if k != "unauthorized"} == \
        {k: v for k, v in before.rejects.items() if k != "unauthorized"}


def _the_right_token_streams(endpoint: str, token: str) -> None:
    with Client(endpoint, timeout_s=120, token=token) as client:
        info = client.open(IMAGE, num_chunks=2)
        for index in range(2):
            client.control(info.id, index, keys="w")
        chunks = [client.next_chunk(info.id, timeout_s=120).index for _ in range(2)]
        assert chunks == [0, 1]
        client.wait_closed(info.id, timeout_s=60)


@pytest.mark.multiprocess
def test_a_server_beyond_loopback_refuses_strangers_unauthorized_and_serves_the_token(
        secured: tuple[LocalServer, LocalRouter]) -> None:
    server, _ = secured
    with Client(server.endpoint, timeout_s=120, token=SERVER_TOKEN) as owner:  # a live session strangers aim at
        info = owner.open(IMAGE)
        _strangers_are_refused_and_change_nothing(server.endpoint, SERVER_TOKEN, info.id)
        assert owner.stats().open_sessions >= 1
        owner.close(info.id)
    _the_right_token_streams(server.endpoint, SERVER_TOKEN)


@pytest.mark.multiprocess
def test_a_router_checks_its_clients_token_and_presents_the_replicas_own(
        secured: tuple[LocalServer, LocalRouter]) -> None:
    server, router = secured
    _strangers_are_refused_and_change_nothing(router.endpoint, ROUTER_TOKEN, "0123456789ab")
    refused = _answers(router.endpoint, [protocol.encode(protocol.Stats(req=1, auth=SERVER_TOKEN))])
    assert [a.code for a in refused] == ["unauthorized"]  # the replicas' token is not the router's clients'
    with Client(server.endpoint, timeout_s=60, token=SERVER_TOKEN) as client:
        refusals = client.stats().rejects.get("unauthorized", 0)
    _the_right_token_streams(router.endpoint, ROUTER_TOKEN)  # through the router, which presents the replicas'
    with Client(server.endpoint, timeout_s=60, token=SERVER_TOKEN) as client:
        assert client.stats().rejects.get("unauthorized", 0) == refusals  # the router's pings, stats, opens passed


@pytest.mark.multiprocess
def test_the_gateway_presents_the_token_from_its_file_and_will_not_start_against_a_server_that_refuses_it(
        secured: tuple[LocalServer, LocalRouter], tmp_path: Path) -> None:
    _, router = secured
    token_file = tmp_path / "client-token"
    token_file.write_text(ROUTER_TOKEN)
    with LocalGateway(router.endpoint, args=["--server-token-file", str(token_file)]) as gateway, \
            urllib.request.urlopen(f"{gateway.url}healthz", timeout=60) as answer:
        assert answer.status == 200 and json.loads(answer.read())["ok"] is True
    with pytest.raises(RuntimeError, match="refused: unauthorized"):
        LocalGateway(router.endpoint).start()
