"""Health, readiness and metrics over real HTTP from real processes: rank 0 of a 2-rank CPU job, the router in front
of it, and the gateway's ``/healthz`` following its server; the JSON log format of each of them.

The job warms up slowly on purpose (``synthetic.cold_s``: every stage pays it once at every served size, before its
rank reports in), so rank 0's probe server answers while the ranks still warm: that is when ``/ready`` must say no.
"""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ipc.client import Client
from scripts.local_gateway import LocalGateway
from scripts.local_router import LocalRouter
from scripts.local_server import ROOT, LocalServer
from tests.shared import FAST, free_port
from tests.test_router import wait_for

pytestmark = pytest.mark.multiprocess

IMAGE = (ROOT / "assets" / "start.png").read_bytes()
COLD_S = 3.0  # each stage's warm-up at each size takes this long: the window in which rank 0 is not ready
ROUTER = ["--router.heartbeat_s=0.25", "--router.replica_dead_s=3", "--router.stats_interval_s=0.5"]
RANK0_SERIES = {
    "worldstream_sessions_opened", "worldstream_open_sessions", "worldstream_chunks_emitted",
    "worldstream_time_to_first_frame_seconds", "worldstream_chunk_period_seconds", "worldstream_errors",
    "worldstream_rejects", "worldstream_dit_idle_seconds", "worldstream_rank_room_bytes",
    "worldstream_rank_session_bytes", "worldstream_warm", "worldstream_draining", "worldstream_sessions_restored",
    "worldstream_ranks_in", "worldstream_ready",
}
TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \S+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")
ROUTER_SERIES = {
    "worldstream_router_replicas_up", "worldstream_router_replicas_down", "worldstream_router_replica_up",
    "worldstream_router_placements", "worldstream_router_migrations", "worldstream_router_forwarded_bytes",
    "worldstream_router_chunks_forwarded", "worldstream_ready",
}


def get(url: str) -> tuple[int, Any]:
    """(status, body: JSON decoded when it is JSON, else text); status 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            status, raw, kind = reply.status, reply.read(), reply.headers.get("Content-Type", "")
    except urllib.error.HTTPError as error:
        status, raw, kind = error.code, error.read(), error.headers.get("Content-Type", "")
    except (urllib.error.URLError, ConnectionError):
        return 0, None
    return status, json.loads(raw) if kind.startswith("application/json") else raw.decode()


def metrics(url: str) -> dict[str, Any]:
    """The families of ``url``'s ``/metrics``, read with prometheus_client's own parser, by name."""
    status, text = get(f"{url}/metrics")
    assert status == 200, text
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(families: dict[str, Any], name: str, **labels: str) -> float:
    sample_name = name
    found = [s.value for f in families.values() for s in f.samples
             if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert found, f"no sample {name}{labels}"
    return found[0]


def json_lines(path: Path) -> list[dict[str, Any]]:
    """Every line of a log written by our loggers, parsed; a line in our text format fails the test (torchrun's own
    lines and printed ones do not go through our handlers)."""
    lines = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            lines.append(json.loads(line))
        else:
            assert not TEXT_LINE.match(line), f"a line of ours is not JSON: {line}"
    return lines


def why_not(url: str) -> list[str]:
    """``/ready``'s reasons; ["no answer"] while nothing answers."""
    body = get(f"{url}/ready")[1]
    return ["no answer"] if body is None else body["why_not"]


def stream_one(endpoint: str, chunks: int = 3) -> str:
    with Client(endpoint, timeout_s=30) as client:
        info = client.open(IMAGE, num_chunks=chunks)
        for index in range(chunks):
            client.control(info.id, index, keys="w")
        assert len(list(client.chunks(info.id, timeout_s=60))) == chunks
        client.wait_closed(info.id)
        client.send_raw(b"not msgpack")  # a refusal, counted by reason
        error = client.error(timeout_s=10)
        assert error is not None and error.code == "bad_message"
    return info.id


@dataclass
class Job:
    server: LocalServer
    probes: str  # rank 0's probe server, http://127.0.0.1:PORT
    health_warming: int  # /health's status when it first answered, while the ranks warmed up
    ready_warming: tuple[int, Any]  # /ready at that moment


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("probes") / "server.log"
    server = LocalServer("cpu-mini", [*FAST, f"--synthetic.cold_s={COLD_S}", f"--metrics.prometheus_port={port}",
                                      "--memory.budget_gb=1", "--log-format", "json"], log_path=log_path)
    failed: list[BaseException] = []

    def start() -> None:  # returns once rank 0 serves, after the warm-up
        try:
            server.start()
        except BaseException as error:
            failed.append(error)

    starter = threading.Thread(target=start)
    starter.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for("rank 0's probe server", lambda: get(f"{url}/health")[0] != 0 or not starter.is_alive(), 120)
        health = get(f"{url}/health")[0]
        ready = get(f"{url}/ready")
        starter.join(timeout=180)
        assert not failed, failed
        yield Job(server, url, health, ready)
    finally:
        starter.join(timeout=180)
        code = server.stop()
        assert code == 0, server.log()


def test_rank0_is_alive_but_not_ready_while_its_ranks_warm_up(job: Job) -> None:
    status, body = job.ready_warming
    assert job.health_warming == 200
    assert status == 503 and body["ready"] is False and body["ranks_in"] < body["world_size"] == 2, body
    assert any("warming up" in why for why in body["why_not"]), body


def test_rank0_is_ready_once_every_rank_reported_in_warm(job: Job) -> None:
    status, body = get(f"{job.probes}/ready")
    assert status == 200, body
    assert body["ready"] is True and body["warm"] is True and body["ranks_in"] == 2 and body["draining"] is False
    assert body["why_not"] == []
    assert get(f"{job.probes}/health") == (200, {"alive": True, "role": "rank0"})


def test_rank0_metrics_parse_and_carry_every_series_of_the_server(job: Job) -> None:
    stream_one(job.server.endpoint)
    families = metrics(job.probes)
    assert set(families) >= RANK0_SERIES, RANK0_SERIES - set(families)
    assert value(families, "worldstream_chunks_emitted_total") >= 3
    assert value(families, "worldstream_time_to_first_frame_seconds_count") >= 1
    assert value(families, "worldstream_chunk_period_seconds_count") >= 2
    assert value(families, "worldstream_rejects_total", reason="bad_message") >= 1
    assert value(families, "worldstream_warm") == 1 and value(families, "worldstream_draining") == 0
    assert value(families, "worldstream_ready") == 1 and value(families, "worldstream_ranks_in") == 2
    assert value(families, "worldstream_sessions_restored_total") == 0
    for rank in ("0", "1"):  # memory.budget_gb = 1: each rank's room is 1 GiB
        assert value(families, "worldstream_rank_room_bytes", rank=rank) == 1 << 30
        assert value(families, "worldstream_rank_session_bytes", rank=rank) >= 0


def test_router_is_ready_with_a_replica_up_and_exports_its_series(job: Job, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with LocalRouter([("a", job.server.endpoint, 4)], [*ROUTER, f"--router.metrics_port={port}", "--log-format",
                                                       "json"], log_path=tmp_path / "router.log") as router:
        wait_for("the router ready", lambda: get(f"{url}/ready")[0] == 200, 30)
        assert get(f"{url}/health") == (200, {"alive": True, "role": "router"})
        stream_one(router.endpoint)
        # the probe server answers from the snapshot the router's loop last published: wait for the third chunk
        wait_for("three chunks counted", lambda: value(
            metrics(url), "worldstream_router_chunks_forwarded_total") >= 3, 30)
        families = metrics(url)
    assert set(families) >= ROUTER_SERIES, ROUTER_SERIES - set(families)
    assert value(families, "worldstream_router_replicas_up") == 1
    assert value(families, "worldstream_router_replicas_down") == 0
    assert value(families, "worldstream_router_replica_up", replica="a") == 1
    assert value(families, "worldstream_router_placements_total") >= 1
    assert value(families, "worldstream_router_migrations_total") == 0
    assert value(families, "worldstream_router_chunks_forwarded_total") >= 3
    assert value(families, "worldstream_router_forwarded_bytes_total") > 3 * 9 * 16 * 16  # 3 chunks of frames
    lines = json_lines(tmp_path / "router.log")
    assert lines and all(line["role"] == "router" and "rank" not in line for line in lines)


def test_router_is_not_ready_without_a_replica_up(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    nowhere = f"tcp://127.0.0.1:{free_port()}"
    with LocalRouter([("gone", nowhere, 4)], [*ROUTER, f"--router.metrics_port={port}"]):
        wait_for("the router's first snapshot", lambda: not any(w.startswith(("starting", "no answer"))
                                                                for w in why_not(url)), 30)
        status, body = get(f"{url}/ready")
        families = metrics(url)
    assert status == 503 and body["replicas_up"] == 0 and body["why_not"] == ["no replica up (of 1 known)"], body
    assert value(families, "worldstream_router_replicas_down") == 1
    assert value(families, "worldstream_router_replica_up", replica="gone") == 0


def test_the_gateway_healthz_is_false_while_its_server_is_down(job: Job, tmp_path: Path) -> None:
    gateway_args = ["--check-timeout", "0", "--health-timeout", "1", "--log-format", "json"]
    with LocalRouter([("a", job.server.endpoint, 4)], ROUTER) as router, \
            LocalGateway(router.endpoint, args=gateway_args, log_path=tmp_path / "gateway.log") as gateway:
        # the router is the gateway's server here: one the test can stop
        wait_for("the gateway healthy", lambda: get(f"{gateway.url}healthz")[0] == 200, 30)
        assert get(f"{gateway.url}healthz")[1]["ok"] is True
        assert router.stop() == 0
        status, body = get(f"{gateway.url}healthz")
        assert status == 503 and body["ok"] is False and "does not answer" in body["why_not"], body
    lines = json_lines(tmp_path / "gateway.log")
    assert lines and all(line["role"] == "gateway" for line in lines)


def test_every_rank_logs_json_lines_naming_rank_role_and_session(job: Job) -> None:
    sid = stream_one(job.server.endpoint, chunks=2)
    wait_for("the close logged", lambda: f"session {sid} closed" in job.server.log_path.read_text(), 30)
    lines = json_lines(job.server.log_path)
    assert {line["rank"] for line in lines if line["role"] == "rank"} == {0, 1}
    closed = [line for line in lines if line["message"].startswith(f"session {sid} closed")]
    assert closed and closed[0]["session"] == sid and closed[0]["rank"] == 0 and closed[0]["level"] == "INFO"
    assert all({"time", "level", "role", "logger", "message"} <= set(line) for line in lines)
