"""A chunk on the wire: its map, and its frames as a ZeroMQ frame of their own (protocol version 4).

A chunk's frames are 14 MB at 480x832. Copied into the encoded map (``tobytes`` and then the encoder), they cost rank
0's loop two copies per chunk, and every reader a third. Since version 4 the map carries the facts, the shape and
``frames_part`` (1: the frames are the ZeroMQ frame right after the map), and the frames travel as that second part:
rank 0 hands ZeroMQ the tensor's own buffer (sent without a copy, shared by the player and every watcher), the router
forwards both parts as it received them, and the SDK reads the frames with ``np.frombuffer`` on the received part.
A chunk from a server before version 4 (its frames inside the map, one part) reads as before.

What a reader takes is exactly one map and, when the map says so, one frames part whose length is the shape's:
anything else (a part missing, one too many, one longer or shorter than its shape) is a ``ProtocolViolation`` that
names it, as any other malformed message is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from ipc import protocol

FRAMES_PART = 1  # where a version-4 chunk's frames are: the ZeroMQ frame right after its map


class ChunkHead(protocol.Head, frozen=True):
    """What the router checks of a chunk before it forwards it (the facts are skipped unread)."""

    session: str | None = None
    shape: tuple[int, int, int, int] | None = None
    frames_part: int = 0
    frames: msgspec.Raw = msgspec.Raw()  # as encoded, never copied out: an empty bin when they are a part of their own


_chunk_head = msgspec.msgpack.Decoder(ChunkHead)
MAX_SIDE = 1 << 16  # a chunk's frames, rows, columns: far above any served geometry; 0 (an empty chunk) is none
_EMPTY = msgspec.msgpack.encode(b"")


def chunk_parts(session: str, frames: Any, facts: protocol.ChunkFacts) -> tuple[bytes, memoryview]:
    """A chunk's two ZeroMQ parts: its map, and ``frames`` (uint8 [n, H, W, 3], a CPU tensor or an array) as its
    own buffer, no copy (the caller hands the tensor over: nobody writes it again)."""
    array = frames.numpy() if hasattr(frames, "numpy") else np.asarray(frames)
    array = np.ascontiguousarray(array)  # a tensor from the mailbox is contiguous already: no copy then
    head = protocol.encode(protocol.Chunk(session=session, frames=b"", shape=tuple(array.shape), facts=facts,
                                          frames_part=FRAMES_PART))
    return head, memoryview(array).cast("B")


def frames_of(message: protocol.Chunk, parts: Sequence[Any]) -> np.ndarray:
    """The chunk's frames (uint8 [n, H, W, 3], read-only) from ``parts`` (the message's ZeroMQ parts, its map
    first): a view on the received frames part, or on the map's own bytes from a server before version 4."""
    check_parts(message.frames_part, message.shape, parts)
    data = message.frames if message.frames_part == 0 else parts[FRAMES_PART]
    try:  # a server before version 4: its map's bytes, checked against the shape here
        frames = np.frombuffer(data, dtype=np.uint8).reshape(message.shape)
    except (TypeError, ValueError) as error:
        raise protocol.ProtocolViolation(f"a chunk's frames do not match its shape {message.shape}: {error}") from None
    frames.flags.writeable = False  # as they always read (from bytes): a reader never writes into the message
    return frames


def check_parts(frames_part: int, shape: tuple[int, int, int, int] | None, parts: Sequence[Any]) -> None:
    """``ProtocolViolation`` unless ``parts`` are exactly what a chunk's map says (one part, or its map and a frames
    part of the shape's length)."""
    want = 1 if frames_part == 0 else FRAMES_PART + 1
    if len(parts) != want:
        where = "inside its map" if frames_part == 0 else f"in ZeroMQ part {frames_part}"
        raise protocol.ProtocolViolation(f"a chunk with its frames {where} is {want} ZeroMQ frames, got {len(parts)}")
    if frames_part == 0:  # frames inside the map (before version 4): their length is checked against the shape later
        if shape is not None and (shape[3] != 3 or not all(0 <= side <= MAX_SIDE for side in shape)):  # no -1 there
            raise protocol.ProtocolViolation(f"a chunk's shape {shape} is no [n, height, width, 3] of frames")
        return
    if shape is None:
        raise protocol.ProtocolViolation("a chunk with its frames in a ZeroMQ part of their own has no shape")
    n, height, width, channels = shape
    size = memoryview(parts[FRAMES_PART]).nbytes
    if not all(0 < side <= MAX_SIDE for side in shape) or channels != 3 or n * height * width * channels != size:
        raise protocol.ProtocolViolation(f"a chunk's frames part of {size} bytes does not match its shape {shape}")


def peek_chunk(parts: Sequence[Any]) -> ChunkHead:
    """The head of a replica's chunk (its type, session, shape and frames part; the facts skipped unread), its parts
    checked as ``check_parts`` does. ``ProtocolViolation`` when it is not one."""
    head: ChunkHead = protocol.read_as(_chunk_head, parts[0], "message head")
    if head.frames_part not in (0, FRAMES_PART):
        raise protocol.ProtocolViolation(f"a chunk's frames cannot be in ZeroMQ part {head.frames_part}")
    inside = memoryview(head.frames)
    if head.frames_part and inside.nbytes and (inside.nbytes != len(_EMPTY) or inside.tobytes() != _EMPTY):
        raise protocol.ProtocolViolation(f"a chunk's frames are in ZeroMQ part {head.frames_part}: frames in its map "
                                         "besides do not match")
    check_parts(head.frames_part, head.shape, parts)
    return head


def one_message(parts: Sequence[Any], what: str) -> Any:
    """The only part of a message that is no chunk: ``ProtocolViolation`` for one with more parts."""
    if len(parts) != 1:
        raise protocol.ProtocolViolation(f"a {what} message is one ZeroMQ frame, got {len(parts)}")
    return parts[0]
