"""The coordinator core reads no clock and touches no file (issue 29): a whole session's life (open, chunks, a save,
a restore, stats, close) with the clock and the file system made to raise while the core steps. The test's shell
(``tests.core_job.Job``) still reads and writes the folder, between the core's steps, as ``ranks.coordinator``."""

from __future__ import annotations

import builtins
import logging
import os
import pathlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from ipc import protocol as p
from runtime.core_types import Tick
from runtime.snapshots import Budget, SnapshotStore
from tests.core_job import A, B, Job
from tests.test_snapshot_prompts import finish_save, run_chunk

FORBIDDEN: list[tuple[Any, str]] = [
    (time, "time"), (time, "time_ns"), (time, "monotonic"), (time, "monotonic_ns"), (time, "perf_counter"),
    (builtins, "open"), (os, "replace"), (os, "scandir"), (os, "listdir"), (os, "stat"), (os, "unlink"),
    (pathlib.Path, "mkdir"), (pathlib.Path, "iterdir"), (pathlib.Path, "read_bytes"), (pathlib.Path, "write_bytes"),
]


@contextmanager
def no_clock_no_files() -> Iterator[None]:
    def forbidden(name: str) -> Callable[..., Any]:
        def call(*args: object, **kwargs: object) -> Any:
            raise AssertionError(f"the core called {name}")
        return call

    saved = [(owner, name, getattr(owner, name)) for owner, name in FORBIDDEN]
    logging.disable(logging.CRITICAL)  # a log record reads the clock: the core's logging is the shell's business
    try:
        for owner, name, _ in saved:
            setattr(owner, name, forbidden(name))
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
        logging.disable(logging.NOTSET)


def guarded(job: Job) -> Job:
    """``job``'s core steps only with the clock and the files made to raise."""
    step = job.core.step

    def sans_io(events: Any, now: float) -> list[Any]:
        with no_clock_no_files():
            out = step(events, now)
        errors = [o for o in out if isinstance(getattr(o, "message", None), p.Error)
                  and o.message.code == "internal"]
        assert not errors, errors  # a forbidden call inside a guarded session would be contained, not raised
        return out

    job.core.step = sans_io  # type: ignore[method-assign]
    return job


def test_the_core_runs_a_session_save_restore_and_close_without_a_clock_or_a_file(tmp_path: Path) -> None:
    job = Job()
    job.use(SnapshotStore(tmp_path, Budget(max_count=5)))
    guarded(job)
    sid = job.open(num_chunks=8, prompt="a green valley")
    run_chunk(job, sid, 0)
    job.send(A, p.Save(req=40, session=sid))
    saved = finish_save(job, tmp_path)  # the manifest written and the folder listed by the test's shell
    assert [s.snapshot for s in job.to(A, p.Saved)] == [saved.id]
    job.step(Tick(), dt=1.0)  # pings and every deadline checked
    assert job.send(A, p.Stats(req=41))
    job.send(A, p.Close(req=42, session=sid))

    other = guarded(Job())
    other.use(SnapshotStore(tmp_path))
    other.send(B, p.Open(req=43, image=b"", restore=saved.id))
    restored = list(other.core.sessions)[-1]
    other.settle(p.InitCondition, p.InitDecode, p.BroadcastContext, p.InitDenoise)
    run_chunk(other, restored, saved.chunk)
    assert [o.session for o in other.to(B, p.Opened)] == [restored]


def test_the_forbidden_calls_do_raise_inside_the_guard() -> None:
    with no_clock_no_files(), pytest.raises(AssertionError, match="time"):
        time.time()
