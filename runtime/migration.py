"""A migrated session's messages under the id its client knows (``runtime.router``).

A session restored on another replica after its own went down has a new id there; its client keeps the old one.
The router's small messages are decoded anyway and are re-encoded with the client's id; a chunk is not: only its
``session`` string, near the start of the msgpack map, is replaced (``renamed``). A chunk's frames travel as a part
of their own (protocol version 4): only its map is copied, its frames go on as received; a chunk with its frames inside
its map (a replica before version 4) is copied whole, for migrated sessions only. Frames are never decoded or
re-encoded.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ipc import protocol

HEAD_BYTES = 256  # the session field of a chunk is among its first keys (type, v, session): well inside this
_KEY = msgspec.msgpack.encode("session")


def renamed(raw: Any, old: str, new: str) -> Any:
    """The message ``raw`` (bytes or any buffer, e.g. a ``zmq.Frame``; or the tuple of its ZeroMQ parts, its map
    first) with its session ``old`` named ``new``, in the same form. ``ProtocolViolation`` when its head does not hold
    ``session: old`` (never forwarded under a wrong id)."""
    if isinstance(raw, tuple):
        return (renamed(raw[0], old, new), *raw[1:])
    data = memoryview(raw).cast("B")
    field = _KEY + msgspec.msgpack.encode(old)
    at = bytes(data[:HEAD_BYTES]).find(field)
    if at < 0:
        raise protocol.ProtocolViolation(f"no session {old!r} in the head of the message")
    return b"".join((data[:at], _KEY, msgspec.msgpack.encode(new), data[at + len(field):]))
