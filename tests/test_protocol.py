"""The wire schema: round trips, and every malformed message rejected with a message naming the problem."""

from __future__ import annotations

import msgspec
import pytest

from ipc import protocol as p


def test_client_messages_round_trip() -> None:
    for message in (p.Open(req=1, image=b"png", prompt="a", seed=3, num_chunks=4),
                    p.Control(req=2, session="s", index=0, keys=["w"], mouse=(1.0, 2.0)),
                    p.ControlState(req=3, session="s", keys=["a"], taps=["w"], revision=5),
                    p.Close(req=4, session="s"), p.Stats(req=5), p.Heartbeat()):
        assert p.decode(p.encode(message), "client") == message


def _raw(**fields: object) -> bytes:
    return msgspec.msgpack.encode(fields)


@pytest.mark.parametrize(("data", "expected"), [
    (b"\xc1\xc1 not msgpack", "not a msgpack message"),
    (msgspec.msgpack.encode([1, 2]), "must be a msgpack map"),
    (_raw(v=1, type="teleport", req=1), "unknown message type 'teleport'"),
    (_raw(v=9, type="open", req=1, image=b""), "protocol version 9 is not supported"),
    (_raw(v=1, type="open", image=b""), "missing required field `req`"),
    (_raw(v=1, type="control", req=1, session="s", index="zero"), "Expected `int`, got `str` - at `$.index`"),
    (_raw(v=1, type="close", req=1, session="s", extra=1), "unknown field `extra`"),
    (_raw(v=1, req=1), "no 'type' field"),
])
def test_malformed_messages_raise_a_protocol_violation_naming_the_problem(data: bytes, expected: str) -> None:
    with pytest.raises(p.ProtocolViolation, match=expected.replace("$", r"\$").replace("(", r"\(")):
        p.decode(data, "client")


def test_oversized_message_is_rejected_before_decoding() -> None:
    with pytest.raises(p.ProtocolViolation, match="exceeds the limit of 1000 bytes"):
        p.decode(b"\x00" * 1001, "client", max_bytes=1000)


def test_a_server_message_is_not_accepted_from_a_client() -> None:
    with pytest.raises(p.ProtocolViolation, match="unknown message type 'chunk'"):
        p.decode(p.encode(p.Chunk(session="s", index=0, frames=b"", shape=(0, 0, 0, 3), control={}, facts={})),
                 "client")
