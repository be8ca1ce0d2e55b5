"""One 7-rank CPU server for the whole session, shared by the multi-process test modules whose servers differed
only in flags (a 7-rank start costs seconds on two cores). Its flags are the union of theirs: fast synthetic
stages, the failure-injecting test backend (inert unless a prompt asks for a failure), a Prometheus port, a short
client timeout, small limits and a small send queue. Tests on it never assume they are alone: they count their
own sessions, compare counters before and after, and read the server log for what another client cannot see.
Tests that hurt a rank or stop the server start their own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from scripts.local_server import LocalServer
from tests.shared import shared_flags


@pytest.fixture(scope="session")
def shared_server() -> Iterator[LocalServer]:
    with LocalServer("cpu-tiny", shared_flags()) as server:
        yield server
    assert server.process is not None
    code = server.process.returncode
    assert code == 0, f"the shared server exited with {code}:\n{server.log()}"
