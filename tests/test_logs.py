"""The one log format (``runtime.logs``): text lines with who and where, or one JSON object a line; the readiness
rules the probes answer from (``runtime.probes``)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from runtime import logs
from runtime.probes import rank0_snapshot, router_snapshot
from scripts.local_server import ROOT

SID = "3f2a9c1b7d4e"


def logged(fmt: str, role: str, rank: int | None, *lines: str) -> list[str]:
    """What a fresh process configured by ``logs.configure`` writes for ``lines`` (logged at INFO), one per line."""
    code = (f"import logging; from runtime import logs; logs.configure({role!r}, 'INFO', {fmt!r}, rank={rank!r}, "
            f"replica='a', job='812')\n"
            f"for line in {list(lines)!r}: logging.getLogger('worldstream.core').info(line)\n"
            "try:\n    1 / 0\nexcept ZeroDivisionError:\n    logging.getLogger('x').exception('boom')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=True)
    return done.stderr.splitlines()


def test_json_lines_each_parse_and_carry_rank_role_job_replica_and_the_session_named() -> None:
    out = logged("json", "rank", 3, f"session {SID} closed (client)", "serving on tcp://127.0.0.1:5555")
    parsed = [json.loads(line) for line in out if line.startswith("{")]
    assert len(parsed) == 3  # the traceback is inside its line, not lines of its own
    closed, serving, boom = parsed
    assert closed["role"] == "rank" and closed["rank"] == 3 and closed["job"] == "812" and closed["replica"] == "a"
    assert closed["session"] == SID and closed["level"] == "INFO" and closed["logger"] == "worldstream.core"
    assert "session" not in serving and serving["message"] == "serving on tcp://127.0.0.1:5555"
    assert boom["level"] == "ERROR" and "ZeroDivisionError" in boom["exception"]
    assert all(line.startswith("{") for line in out)


def test_text_lines_name_who_then_job_replica_and_session() -> None:
    out = logged("text", "router", None, f"session {SID}: replica a is down", "a 160x256 session costs 2 GiB")
    assert f" router INFO job=812 replica=a session={SID} worldstream.core: session {SID}: replica a" in out[0]
    assert " router INFO job=812 replica=a worldstream.core: a 160x256 session costs" in out[1]  # not a session id


def test_a_session_passed_with_the_record_wins_over_the_message() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "no id here", (), None)
    record.session = "given"
    assert logs.session_of(record) == "given"


def test_an_unknown_format_is_refused_naming_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="text, json"):
        logs.configure("rank", fmt="yaml")


def test_rank0_is_ready_only_with_every_rank_in_warm_serving_and_not_draining() -> None:
    def ready(**changes: object) -> tuple[bool, tuple[str, ...]]:
        facts: dict = {"world_size": 2, "ranks_in": 2, "warm": True, "serving": True, **changes}
        snapshot = rank0_snapshot(**facts)
        return snapshot.ready, snapshot.why_not

    assert ready() == (True, ())
    assert ready(ranks_in=1, warm=False, serving=False) == (False, ("1 of 2 ranks reported in (warming up)",))
    assert ready(warm=False)[1] == ("not warm: some stage could not warm a served size (stats: warm_up)",)
    assert ready(serving=False)[1] == ("not serving yet",)
    assert ready(draining=True)[1] == ("draining",) and ready(stopping=True)[1] == ("stopping",)


def test_the_router_is_ready_with_one_replica_up_of_several() -> None:
    counts = {"placements": 0, "migrations": 0, "open_sessions": 0, "chunks_forwarded": 0, "forwarded_bytes": 0}
    assert router_snapshot(replicas={"a": False, "b": True}, **counts).ready
    down = router_snapshot(replicas={"a": False}, **counts)
    assert not down.ready and down.why_not == ("no replica up (of 1 known)",)
    assert not router_snapshot(replicas={"a": True}, stopping=True, **counts).ready
