"""Every message on the control plane: client <-> coordinator and coordinator <-> role workers.

Messages are msgpack maps with a protocol version ``v`` and a ``type`` tag, typed as frozen msgspec structs.
``decode`` validates everything (size, msgpack, version, type, every field's presence, type and value) before
any handler runs and raises one ``ProtocolViolation`` whose message names the problem. No pickle anywhere.
Fields are appended with defaults, never reordered; each carries a comment saying why it exists.
Tensors never travel here: a task on this plane announces each one (session, chunk, shape, dtype), the tensor
plane moves it.

The values that travel inside messages keep one shape from end to end: a ``ChunkControl`` is built by the SDK (or
cut by the live control service) and is what the DiT stage receives; a ``ChunkFacts`` is built on rank 0 and is
what a client stores in its trace file. The three stages of a session share one vocabulary, ``Stage``: the
condition stage (text + VAE encode of the condition chunks), the denoise stage (the DiT group), the decode stage.

The schemas live in ``ipc.schemas`` and the values in ``ipc.values`` (below ``ipc.metrics_types``); this module is the
codec, and re-exports every name of both so ``from ipc.protocol import X`` and ``protocol.X`` read as before.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ipc.error_codes import ErrorCode as ErrorCode
from ipc.metrics_types import ServerStats as ServerStats
from ipc.metrics_types import SessionSummary as SessionSummary
from ipc.schemas import Accepted as Accepted
from ipc.schemas import Beat as Beat
from ipc.schemas import BroadcastCondition as BroadcastCondition
from ipc.schemas import BroadcastContext as BroadcastContext
from ipc.schemas import Chunk as Chunk
from ipc.schemas import ChunkDone as ChunkDone
from ipc.schemas import ClientMessage as ClientMessage
from ipc.schemas import Close as Close
from ipc.schemas import Closed as Closed
from ipc.schemas import Completion as Completion
from ipc.schemas import ConditionChunk as ConditionChunk
from ipc.schemas import Control as Control
from ipc.schemas import ControlState as ControlState
from ipc.schemas import CoordinatorMessage as CoordinatorMessage
from ipc.schemas import DecodeChunk as DecodeChunk
from ipc.schemas import DenoiseChunk as DenoiseChunk
from ipc.schemas import Drain as Drain
from ipc.schemas import Draining as Draining
from ipc.schemas import EncodePrompt as EncodePrompt
from ipc.schemas import Error as Error
from ipc.schemas import Heartbeat as Heartbeat
from ipc.schemas import HeartbeatAck as HeartbeatAck
from ipc.schemas import Hello as Hello
from ipc.schemas import InitCondition as InitCondition
from ipc.schemas import InitDecode as InitDecode
from ipc.schemas import InitDenoise as InitDenoise
from ipc.schemas import InitDone as InitDone
from ipc.schemas import Migrated as Migrated
from ipc.schemas import Missed as Missed
from ipc.schemas import Open as Open
from ipc.schemas import Opened as Opened
from ipc.schemas import Phase as Phase
from ipc.schemas import Ping as Ping
from ipc.schemas import PromptScheduled as PromptScheduled
from ipc.schemas import ReceiveFrames as ReceiveFrames
from ipc.schemas import ReceiveLatent as ReceiveLatent
from ipc.schemas import Register as Register
from ipc.schemas import Registered as Registered
from ipc.schemas import Release as Release
from ipc.schemas import ReleaseDone as ReleaseDone
from ipc.schemas import Save as Save
from ipc.schemas import SaveCaptured as SaveCaptured
from ipc.schemas import Saved as Saved
from ipc.schemas import SaveState as SaveState
from ipc.schemas import SaveWritten as SaveWritten
from ipc.schemas import ServerMessage as ServerMessage
from ipc.schemas import SetPrompt as SetPrompt
from ipc.schemas import Shutdown as Shutdown
from ipc.schemas import ShutdownDone as ShutdownDone
from ipc.schemas import Stats as Stats
from ipc.schemas import StatsReply as StatsReply
from ipc.schemas import StreamHeader as StreamHeader
from ipc.schemas import TaskFailed as TaskFailed
from ipc.schemas import TensorSpec as TensorSpec
from ipc.schemas import TransferDone as TransferDone
from ipc.schemas import Unwatch as Unwatch
from ipc.schemas import WarmUp as WarmUp
from ipc.schemas import Watch as Watch
from ipc.schemas import Watching as Watching
from ipc.schemas import WorkerMessage as WorkerMessage
from ipc.schemas import WorkerSpan as WorkerSpan
from ipc.schemas import WorkerTask as WorkerTask
from ipc.schemas import _Done as _Done
from ipc.schemas import _Stream as _Stream
from ipc.schemas import _Task as _Task
from ipc.schemas import _Transfer as _Transfer
from ipc.schemas import context_index as context_index
from ipc.schemas import header_fields as header_fields
from ipc.schemas import revision_of as revision_of
from ipc.schemas import steps_problem as steps_problem
from ipc.values import CHUNK_PARTS_VERSION as CHUNK_PARTS_VERSION
from ipc.values import DEFAULT_MAX_BYTES as DEFAULT_MAX_BYTES
from ipc.values import INTRINSICS_HEIGHT as INTRINSICS_HEIGHT
from ipc.values import INTRINSICS_WIDTH as INTRINSICS_WIDTH
from ipc.values import KEYS as KEYS
from ipc.values import MAX_DEPTH as MAX_DEPTH
from ipc.values import MAX_ERROR_CHARS as MAX_ERROR_CHARS
from ipc.values import MAX_FOCAL_PIXELS as MAX_FOCAL_PIXELS
from ipc.values import MAX_INTERNAL_ITEMS as MAX_INTERNAL_ITEMS
from ipc.values import MAX_ITEMS as MAX_ITEMS
from ipc.values import MAX_MOUSE_DEGREES as MAX_MOUSE_DEGREES
from ipc.values import MAX_POSE_TRANSLATION as MAX_POSE_TRANSLATION
from ipc.values import MAX_REVISION as MAX_REVISION
from ipc.values import POSE_ORTHONORMAL_TOLERANCE as POSE_ORTHONORMAL_TOLERANCE
from ipc.values import PROTOCOL_VERSION as PROTOCOL_VERSION
from ipc.values import QUALITY_STEPS as QUALITY_STEPS
from ipc.values import SUPPORTED_VERSIONS as SUPPORTED_VERSIONS
from ipc.values import ChunkControl as ChunkControl
from ipc.values import ChunkFacts as ChunkFacts
from ipc.values import ChunkTimes as ChunkTimes
from ipc.values import Edge as Edge
from ipc.values import InputState as InputState
from ipc.values import InputStateError as InputStateError
from ipc.values import Key as Key
from ipc.values import KeyList as KeyList
from ipc.values import ProtocolViolation as ProtocolViolation
from ipc.values import SessionId as SessionId
from ipc.values import Span as Span
from ipc.values import Stage as Stage
from ipc.values import Steps as Steps
from ipc.values import _Msg as _Msg
from ipc.values import _Value as _Value
from ipc.values import check_input_state as check_input_state
from ipc.values import clip as clip
from ipc.values import intrinsics_problem as intrinsics_problem
from ipc.values import pose_problem as pose_problem

_encoder = msgspec.msgpack.Encoder()  # maps keep their order (a summary lists releases in the order they happened)
_decoders = {
    "client": msgspec.msgpack.Decoder(ClientMessage),
    "server": msgspec.msgpack.Decoder(ServerMessage),
    "worker": msgspec.msgpack.Decoder(WorkerMessage),
    "coordinator": msgspec.msgpack.Decoder(CoordinatorMessage),
    "replica": msgspec.msgpack.Decoder(Register),  # what a replica sends its router
    "router": msgspec.msgpack.Decoder(Registered),  # what a router answers a replica
}


def encode(message: _Msg | ControlState) -> bytes:
    return _encoder.encode(message)


def to_builtins(value: Any) -> Any:
    """A message or value as JSON-able builtins, e.g. a chunk's facts for a JSON file. Sets (a control's keys)
    become sorted lists, so the same facts always read the same."""
    return msgspec.to_builtins(value, order="deterministic")


class Head(msgspec.Struct, frozen=True):
    """The fields every message is read by before its body, each type-checked (unknown fields are skipped here and
    judged by the body's own read): a value of another type is a ``ProtocolViolation``, never a crash in the code
    that looks at it (an array for ``v`` once ended the job: it is unhashable)."""

    type: str | None = None
    v: int = PROTOCOL_VERSION
    req: int | None = None


_head = msgspec.msgpack.Decoder(Head)


def read_as(decoder: msgspec.msgpack.Decoder[Any], data: Any, what: str) -> Any:
    """``data`` read by ``decoder`` (a struct with an int ``v`` field: a message's head, a stats reply read raw) in a
    version this side speaks, or ``ProtocolViolation`` naming ``what`` could not be read."""
    try:
        value = decoder.decode(data)
    except msgspec.DecodeError as error:
        raise ProtocolViolation(f"unreadable {what}: {error}") from None
    except (RecursionError, MemoryError, OverflowError, ValueError, TypeError) as error:
        raise ProtocolViolation(f"unreadable {what} ({type(error).__name__})") from None
    if value.v not in SUPPORTED_VERSIONS:
        raise ProtocolViolation(f"protocol version {value.v} is not supported (this side speaks {PROTOCOL_VERSION})",
                                getattr(value, "req", None))
    return value


def read_head(data: Any) -> Head:
    """The head of one message, typed (bounded first by ``scan`` where the bytes come from outside)."""
    head: Head = read_as(_head, data, "message head")
    return head


def decode(data: bytes | memoryview, direction: str, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """Decode one message read by ``direction`` ("client": what a client sends, "server": what it receives,
    "worker"/"coordinator" likewise inside the job). Raises ``ProtocolViolation`` naming the problem, and nothing
    else: the size, the nesting depth and item count (a list nested 2000 deep is a few kilobytes and would exhaust
    the decoder's recursion), and that it is one msgpack map are checked before it is decoded; then its head (type,
    version, request id, session: ``Head``) is read typed, and only then its body, so no field of any type reaches
    code that assumes another."""
    if len(data) > max_bytes:
        raise ProtocolViolation(f"message of {len(data)} bytes exceeds the limit of {max_bytes} bytes")
    keys = scan(data, max_items=MAX_ITEMS if direction == "client" else MAX_INTERNAL_ITEMS)
    head = read_head(data)
    if direction == "client" and "v" not in keys:
        raise ProtocolViolation("message has no protocol version field 'v'", head.req)
    try:
        message = _decoders[direction].decode(data)
    except msgspec.DecodeError as error:
        raise _explain(head, error) from None
    except (RecursionError, MemoryError, OverflowError, ValueError, TypeError) as error:  # never out of decode
        raise ProtocolViolation(f"message could not be decoded ({type(error).__name__})", head.req) from None
    if direction == "client" and isinstance(message, Open | Watch) and message.v < CHUNK_PARTS_VERSION:
        raise ProtocolViolation(f"protocol version {message.v} reads a chunk's frames inside its map; this server "
                                f"sends them as a ZeroMQ frame of their own (version {CHUNK_PARTS_VERSION}): upgrade "
                                "the SDK to stream", message.req, answer_v=message.v)
    return message


_FIXED = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2,
          0xD2: 4, 0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}  # type byte -> payload bytes
_SIZED = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC7: 1, 0xC8: 2, 0xC9: 4}  # length-prefix bytes
_CONTAINERS = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}  # length bytes, items per entry


def scan(data: bytes | memoryview, max_depth: int = MAX_DEPTH, max_items: int = MAX_ITEMS) -> set[str]:
    """Walk a msgpack message's structure without building it (iteratively: bounded work, no recursion) and
    return the string keys of its top-level map. ``ProtocolViolation`` when it is not exactly one map, nests
    deeper than ``max_depth``, holds more than ``max_items`` items, or is truncated."""
    pos, items, keys = 0, 0, set()
    pending: list[int] = []  # items still to read in each open container, innermost last
    top_map = False
    end = len(data)
    while True:
        if pending and pending[-1] == 0:
            pending.pop()
            if not pending:
                break
            continue
        if pos >= end:
            raise ProtocolViolation("not a msgpack message (truncated)")
        is_key = top_map and len(pending) == 1 and pending[0] % 2 == 0
        if pending:
            pending[-1] -= 1
        items += 1
        if items > max_items:
            raise ProtocolViolation(f"message holds more than {max_items} items")
        head = data[pos]
        pos += 1
        children = 0
        if head <= 0x7F or head >= 0xE0:
            pass
        elif 0x80 <= head <= 0x8F:
            children = 2 * (head & 0x0F)
        elif 0x90 <= head <= 0x9F:
            children = head & 0x0F
        elif 0xA0 <= head <= 0xBF:
            size = head & 0x1F
            if is_key:
                keys.add(str(data[pos : pos + size], "utf-8", "replace"))
            pos += size
        elif head in _FIXED:
            pos += _FIXED[head]
        elif head in _SIZED:
            width = _SIZED[head]
            size = int.from_bytes(data[pos : pos + width], "big")
            if is_key and head in (0xD9, 0xDA, 0xDB):
                keys.add(str(data[pos + width : pos + width + size], "utf-8", "replace"))
            pos += width + size + (1 if head in (0xC7, 0xC8, 0xC9) else 0)  # ext: one type byte
        elif head in _CONTAINERS:
            width, per_entry = _CONTAINERS[head]
            children = per_entry * int.from_bytes(data[pos : pos + width], "big")
            pos += width
        else:
            raise ProtocolViolation("not a msgpack message")
        if children:
            if not pending:
                top_map = 0x80 <= head <= 0x8F or head == 0xDE or head == 0xDF
                if not top_map:
                    raise ProtocolViolation("a message must be a msgpack map, got an array")
            if len(pending) >= max_depth:
                raise ProtocolViolation(f"message nests deeper than {max_depth} levels")
            if items + children // 2 > max_items:
                raise ProtocolViolation(f"message holds more than {max_items} items")
            pending.append(children)
        elif not pending:
            if 0x80 <= head <= 0x8F or head in (0xDE, 0xDF):
                break  # an empty map
            if pos != end:
                raise ProtocolViolation("not a msgpack message")
            raise ProtocolViolation("a message must be a msgpack map, got " +
                                    ("an array" if 0x90 <= head <= 0x9F or head in (0xDC, 0xDD) else "a scalar"))
    if pos > end:
        raise ProtocolViolation("not a msgpack message (truncated)")
    if pos < end:
        raise ProtocolViolation("not a msgpack message (bytes after the message)")
    return keys


def _explain(head: Head, error: msgspec.DecodeError) -> ProtocolViolation:
    """The body's decode error in words, with the request id the (already checked) head carries."""
    if head.type is None:
        return ProtocolViolation("message has no 'type' field", head.req)
    if "UTF-8" in str(error):  # a prompt, say: the head was read past it, so its request id is known
        return ProtocolViolation("a string in the message is not valid UTF-8", head.req)
    text = str(error)
    if "Invalid value" in text and "$.type" in text:
        return ProtocolViolation(f"unknown message type {head.type!r}", head.req)
    return ProtocolViolation(f"invalid {head.type!r} message: {text}", head.req)
