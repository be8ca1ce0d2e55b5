"""A session's end is one loop over its parts (``runtime.parts``): after a close and after a drop (a session that
could not even close cleanly) no part of the coordinator core holds anything of the session, and every part the
core has is in that loop; every client message type has its route. Pure: the core played by
``tests.core_job.Job``."""

from __future__ import annotations

import logging
import typing
from collections.abc import Iterator
from typing import Any

import pytest

from ipc import protocol as p
from runtime.core import CoordinatorCore
from runtime.core_types import DropTensors, EndWatch
from runtime.parts import Part
from tests.core_job import A, B, Job, control

W = b"watcher"


def parts_of(core: CoordinatorCore) -> list[Part]:
    """Every part the core keeps as an attribute, whether or not it is in ``core.parts``."""
    return [value for value in vars(core).values() if isinstance(value, Part)]


def found(value: Any, sid: str, seen: set[int], depth: int = 0) -> Iterator[str]:
    """Where ``sid`` appears in ``value``'s state (keys, values, members, attributes), as paths."""
    if depth > 8 or id(value) in seen or isinstance(value, int | float | bytes | bool | type(None)):
        return
    if isinstance(value, str):
        if value == sid:
            yield ""
        return
    seen.add(id(value))
    if isinstance(value, dict):
        children: list[tuple[str, Any]] = [(f"[{k!r}]", k) for k in value] + [(f"[{k!r}]", v)
                                                                              for k, v in value.items()]
    elif isinstance(value, list | tuple | set | frozenset) or type(value).__name__ == "deque":
        children = [(f"[{i}]", item) for i, item in enumerate(value)]
    elif hasattr(value, "__dict__") or hasattr(value, "__slots__"):
        names = list(getattr(value, "__dict__", {})) or list(getattr(value, "__slots__", ()))
        children = [(f".{name}", getattr(value, name)) for name in names if hasattr(value, name)]
    else:
        return
    for where, child in children:
        for rest in found(child, sid, seen, depth + 1):
            yield where + rest


def holders(core: CoordinatorCore, sid: str) -> dict[str, list[str]]:
    """Each part of the core that still holds ``sid``, with where."""
    out = {}
    for part in parts_of(core):
        paths = list(found(part, sid, set()))
        if paths:
            out[type(part).__name__] = paths
    return out


def running(job: Job) -> str:
    """A session with a watcher and a chunk out: something of it in every part."""
    sid = job.open(A, num_chunks=None)
    (opened,) = job.to(A, p.Opened)
    job.send(W, p.Watch(req=next(job.req), session=sid, token=opened.watch_token))
    control(job, sid, 0)
    job.chunk(sid, 0)
    return sid


def test_every_client_message_type_has_exactly_one_route() -> None:
    assert set(Job().core.routes) == set(typing.get_args(p.ClientMessage))


def test_every_part_of_the_core_answers_a_sessions_end() -> None:
    core = Job().core
    assert {id(part) for part in parts_of(core)} == {id(part) for part in core.parts}
    assert len(core.parts) >= 5  # metrics, saves, admission, clients, watchers


def test_a_running_session_is_held_by_every_part() -> None:
    job = Job()
    sid = running(job)
    assert set(holders(job.core, sid)) == {"Observers", "Saves", "Admission", "Clients", "Watchers"}


def test_after_a_close_no_part_holds_the_session() -> None:
    job = Job()
    sid = running(job)
    other = job.open(B)
    job.send(A, p.Close(req=next(job.req), session=sid))
    job.play({}, 0)  # it drains (its chunks in flight), then releases its caches
    assert [c.reason for c in job.to(A, p.Closed)] == ["client"]
    assert [(e.identity, e.keep) for e in job.log if isinstance(e, EndWatch)] == [(W, True)]
    assert holders(job.core, sid) == {}
    assert set(holders(job.core, other)) >= {"Observers", "Admission", "Clients"}  # the other session is kept


def test_after_a_drop_no_part_holds_the_session(caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    job = Job()
    sid = running(job)
    other = job.open(B)
    job.core.sessions[sid].controls = None  # type: ignore[assignment]  # a bug in the core: the request fails

    def close(*_: Any) -> None:
        raise RuntimeError("a bug in the close")  # and so does the close that follows: the session is dropped

    monkeypatch.setattr(job.core.scheduler, "close", close)
    with caplog.at_level(logging.ERROR, logger="runtime.core"):
        out = control(job, sid, 1)
    assert [e.code for e in job.to(A, p.Error, out)] == ["internal", "failed"]
    assert any("could not be closed; dropping it" in r.message for r in caplog.records)
    assert DropTensors(sid) in job.log
    assert [(e.identity, e.closed.reason, e.keep) for e in job.log if isinstance(e, EndWatch)] == [
        (W, "failed", False)]
    assert holders(job.core, sid) == {}
    assert set(holders(job.core, other)) >= {"Observers", "Admission", "Clients"}
    assert job.to(B, p.Accepted, control(job, other, 0, who=B))  # the server keeps serving
