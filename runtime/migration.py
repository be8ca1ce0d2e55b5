"""A migrated session's messages under the id its client knows (``runtime.router``).

A session restored on another replica after its own went down has a new id there; its client keeps the old one.
The router's small messages are decoded anyway and are re-encoded with the client's id; a chunk is not: only its
``session`` string, near the start of the msgpack map, is replaced (``renamed``). That costs one copy of the chunk,
for migrated sessions only; its frames are never decoded or re-encoded.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ipc import protocol

HEAD_BYTES = 256  # the session field of a chunk is among its first keys (type, v, session): well inside this
_KEY = msgspec.msgpack.encode("session")


def renamed(raw: Any, old: str, new: str) -> bytes:
    """The message ``raw`` (bytes or any buffer, e.g. a ``zmq.Frame``) with its session ``old`` named ``new``.
    ``ProtocolViolation`` when its head does not hold ``session: old`` (never forwarded under a wrong id)."""
    data = memoryview(raw).cast("B")
    field = _KEY + msgspec.msgpack.encode(old)
    at = bytes(data[:HEAD_BYTES]).find(field)
    if at < 0:
        raise protocol.ProtocolViolation(f"no session {old!r} in the head of the message")
    return b"".join((data[:at], _KEY, msgspec.msgpack.encode(new), data[at + len(field):]))
