"""Readers of a newer peer (issue 21, point 10): what a server, a replica or a router adds to the protocol later is
skipped by older SDKs, routers and replicas, never an error; what clients send is still validated strictly."""

from __future__ import annotations

import msgspec
import pytest

from ipc import protocol as p
from ipc import tolerant
from ipc.client import Client
from scripts.local_router import LocalRouter
from tests.fake_replica import FakeReplica
from tests.router_fleet import chunk
from tests.test_router import wait_for

NEWER = {"hint": "from a newer version", "budget": {"ms": 3}}


def newer(message: p._Msg, where: tuple[str, ...] = ()) -> bytes:
    raw = msgspec.msgpack.decode(p.encode(message))
    raw.update(NEWER)
    part = raw
    for key in where:
        part = part[key]
        part.update(NEWER)
    return msgspec.msgpack.encode(raw)


def test_fields_a_newer_server_adds_are_skipped_at_every_level() -> None:
    message = chunk("0123456789ab", 3)
    raw = msgspec.msgpack.decode(newer(message, ("facts", "times")))
    raw["facts"]["control"]["zoom"] = 2
    raw["facts"]["spans"] = [[*s, "newer"] for s in [["decode", 1, "decode", 0.0, 0.5, 1.0]]]
    decoded = tolerant.decode(msgspec.msgpack.encode(raw), "server")
    assert decoded == msgspec.structs.replace(message, facts=msgspec.structs.replace(
        message.facts, spans=(p.Span("decode", 1, "decode", 0.0, 0.5, 1.0),)))
    for reply in (p.HeartbeatAck(req=1, server="s"), p.Error(code="busy", message="full", retry_after_s=1.0),
                  p.Closed(session="x", reason="client")):
        assert tolerant.decode(newer(reply), "server") == reply
    assert tolerant.decode(newer(p.Registered(ok=True)), "router") == p.Registered(ok=True)
    assert tolerant.decode(msgspec.msgpack.encode({"v": 2, "type": "teleport", "to": 1}), "server") == \
        tolerant.Unknown("teleport")


def test_what_is_wrong_beyond_unknown_fields_is_still_a_violation_and_clients_stay_strict() -> None:
    for bad in (msgspec.msgpack.encode({"v": 2, "type": "error", "code": 7, "message": "x"}),
                msgspec.msgpack.encode({"v": 9, "type": "heartbeat_ack", "req": 1}),
                b"\x91" + b"\x91" * 40 + b"\x01", b"\xc1"):
        with pytest.raises(p.ProtocolViolation):
            tolerant.decode(bad, "server")
    with pytest.raises(p.ProtocolViolation, match="unknown field"):
        p.decode(newer(p.Stats(req=1)), "client")  # a server validates what clients send as before


@pytest.mark.multiprocess
def test_the_sdk_and_the_router_serve_a_newer_replica_whose_replies_carry_fields_they_do_not_know() -> None:
    replica = FakeReplica("server-new", extra=NEWER)
    try:
        with Client(replica.endpoint, timeout_s=10) as client:  # the SDK straight at the (newer) server
            info = client.open(b"png", num_chunks=2)
            client.control(info.id, 0, keys="w")
            assert client.next_chunk(info.id, timeout_s=10).index == 0 and client.error() is None
        with LocalRouter([("a", replica.endpoint, 2)], ["--router.heartbeat_s=0.1"]) as router, \
                Client(router.endpoint, timeout_s=10) as client:  # the router reading it
            wait_for("a up", lambda: client.stats().replicas["a"].state == "up", 10)
            info = client.open(b"png", num_chunks=2)
            client.control(info.id, 0, keys="w")
            assert client.next_chunk(info.id, timeout_s=10).index == 0 and client.error() is None
    finally:
        replica.stop()
