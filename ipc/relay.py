"""What the router reads of a message it forwards from a replica: its type and session, nothing more.

A ``chunk`` carries megabytes of frames; the router routes it by its session and forwards the very bytes it
received. msgspec decodes the two fields it is asked for and skips the rest without copying it (a ``bin`` is
skipped by its length), so peeking costs the same for a 1 MB and a 100 MB chunk. Everything else a replica sends
is small and is decoded in full (``protocol.decode``), because the router acts on it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ipc import protocol


class Head(protocol.Head, frozen=True):
    """A message's head and its session: what the router routes by (typed like every head)."""

    session: str | None = None


_head = msgspec.msgpack.Decoder(Head)


def peek(data: Any) -> Head:
    """The head of one message (``data``: bytes or any buffer). Raises ``ProtocolViolation`` when it is not a
    msgpack map with a string ``type``, a string or nil ``session`` and this protocol's version."""
    head: Head = protocol.read_as(_head, data, "message head")
    return head
