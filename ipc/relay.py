"""What the router reads of a message it forwards from a replica: its type and session, nothing more.

A ``chunk`` carries megabytes of frames; the router routes it by its session and forwards the very bytes it
received. msgspec decodes the two fields it is asked for and skips the rest without copying it (a ``bin`` is
skipped by its length), so peeking costs the same for a 1 MB and a 100 MB chunk. Everything else a replica sends
is small and is decoded in full (``protocol.decode``), because the router acts on it.

The other way, what the router sends a replica carries the replicas' token (``upstream``), never its client's.
"""

from __future__ import annotations

from typing import Any

import msgspec
import zmq

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


def upstream(message: Any, token: str | None, rewrite: bool, max_bytes: int) -> Any:
    """What the router sends a replica for ``message`` (typed, or a client's bytes as received): with ``token`` as
    its ``auth`` (None: none). A client's bytes go as they are unless ``rewrite`` (a token is in use on either side:
    the client's own, a secret of the router's clients, must not reach a replica; the replica's must be added), then
    they are decoded and encoded again."""
    if isinstance(message, bytes | zmq.Frame):
        if not rewrite:
            return message
        message = protocol.decode(message.buffer if isinstance(message, zmq.Frame) else message, "client", max_bytes)
    if token is not None or message.auth is not msgspec.UNSET:
        message = msgspec.structs.replace(message, auth=msgspec.UNSET if token is None else token)
    return protocol.encode(message)
