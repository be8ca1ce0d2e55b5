"""A newer server's messages are read the slow tolerant way once per connection, then the lenient way first
(``ipc.newer_peer``), with exactly ``tolerant.decode``'s answers. Counted, not timed: the measured cost (2.30 ->
4.95 ms per 18 MiB chunk before, as a strict read after) is a benchmark's, not the suite's."""

from __future__ import annotations

import queue
from concurrent.futures import Future
from typing import Any

import msgspec
import pytest

from ipc import protocol as p
from ipc import tolerant
from ipc.client import ClientCore, ServerError
from ipc.newer_peer import PeerReader
from tests.router_fleet import chunk

SID = "0000000000aa"


def newer(message: Any, **extra: Any) -> bytes:
    """``message`` as a newer server sends it: a field this version lacks at the top and in its facts."""
    raw = msgspec.msgpack.decode(p.encode(message))
    raw.update(extra or {"newer_field": "x"})
    if isinstance(raw.get("facts"), dict):
        raw["facts"]["newer_fact"] = [1.5, {"deep": 1}]
    return msgspec.msgpack.encode(raw)


def test_a_newer_servers_chunks_take_the_slow_tolerant_read_once_per_connection() -> None:
    errors: list[ServerError] = []
    core: ClientCore[queue.Queue[Any], Future[Any]] = ClientCore(queue.Queue, errors.append, clock=lambda: 0.0)
    for i in range(20):
        core.route(newer(chunk(SID, i)))
    events = core.session(SID).events
    assert [events.get_nowait().index for _ in range(20)] == list(range(20)) and not errors
    assert core._reader.slow == 1 and core._reader.newer


def test_the_fast_read_answers_exactly_as_the_tolerant_one_for_every_kind_of_message() -> None:
    reader = PeerReader("server", max_bytes=1 << 31)
    assert reader.decode(newer(chunk(SID, 0))) == chunk(SID, 0) and reader.newer
    bad_field = msgspec.msgpack.decode(newer(chunk(SID, 1)))
    bad_field["facts"]["index"] = "one"
    wrong_version = msgspec.msgpack.decode(newer(p.Closed(session=SID, reason="client")))
    wrong_version["v"] = 99
    corpus = [
        p.encode(chunk(SID, 2)),  # an older message: the same struct
        newer(p.Closed(session=SID, reason="client")),
        newer(p.Error(code="failed", message="why")),
        msgspec.msgpack.encode({"v": p.PROTOCOL_VERSION, "type": "a_newer_kind", "x": 1}),  # Unknown
        msgspec.msgpack.encode(bad_field),
        msgspec.msgpack.encode(wrong_version),
        b"\xc1not msgpack",
        msgspec.msgpack.encode([1, 2, 3]),
    ]
    for data in corpus:
        try:
            expected: Any = tolerant.decode(data, "server", max_bytes=1 << 31)
        except p.ProtocolViolation as error:
            with pytest.raises(p.ProtocolViolation) as got:
                reader.decode(data)
            assert str(got.value) == str(error)
        else:
            assert reader.decode(data) == expected
    assert reader.newer  # a bad message does not make it forget that its peer is newer


def test_an_older_or_same_version_peer_is_read_strictly_and_never_counted_slow() -> None:
    reader = PeerReader("server", max_bytes=1 << 31)
    for i in range(5):
        assert reader.decode(p.encode(chunk(SID, i))).facts.index == i
    assert reader.slow == 0 and not reader.newer
