"""Decoding what a newer peer may say: unknown fields ignored, never an error.

The protocol's structs forbid unknown fields, so a server validates strictly what clients send. Read the other way
(an SDK reading its server, the router reading its replicas, a replica reading its router), the same strictness
would make every later protocol addition (a field appended with a default) break every older reader. ``decode``
reads the message strictly first (the common case, and no extra cost); only when that fails does it look again
with the fields this version does not know dropped, at every level of the message (a chunk's facts, spans and
control included), and take the message if that is all that was wrong. A type this version does not know at all
is ``Unknown`` (the caller skips it). Anything else is the strict ``ProtocolViolation``.
"""

from __future__ import annotations

from functools import cache
from typing import Any, TypeVar

import msgspec
from msgspec import inspect as mi

from ipc import protocol

_raw = msgspec.msgpack.Decoder()
T = TypeVar("T")
READERS: dict[str, Any] = {"server": protocol.ServerMessage, "router": protocol.Registered}  # direction -> type


class Unknown(msgspec.Struct, frozen=True):
    """A message of a type this version does not know (from a newer peer): to be skipped."""

    type: str


def decode(data: bytes | memoryview, direction: str, max_bytes: int = protocol.DEFAULT_MAX_BYTES) -> Any:
    """``protocol.decode`` for messages from a possibly newer peer (``direction`` "server" or "router")."""
    try:
        return protocol.decode(data, direction, max_bytes=max_bytes)
    except protocol.ProtocolViolation as strict:
        if len(data) > max_bytes:
            raise
        try:
            protocol.scan(data, max_items=protocol.MAX_INTERNAL_ITEMS)  # bounded before the raw decode below
            head = protocol.read_head(data)  # typed: a version or type of the wrong type is the strict error
            raw = _raw.decode(data)
        except (protocol.ProtocolViolation, msgspec.DecodeError):
            raise strict from None
        if head.type is not None and head.type not in _tags(direction):
            return Unknown(head.type)
        try:
            return msgspec.convert(_prune(raw, _schema(direction)), READERS[direction])
        except (msgspec.ValidationError, RecursionError, MemoryError, OverflowError, ValueError, TypeError):
            raise strict from None


def convert(value: Any, kind: type[T]) -> T:
    """``value`` (msgpack builtins from a possibly newer peer) as ``kind``, the map keys and trailing array items
    ``kind`` has no field for dropped first (at every depth); raises ``msgspec.ValidationError`` on a wrong type."""
    return msgspec.convert(_prune(value, _type_info(kind)), kind)


@cache
def _type_info(kind: type) -> mi.Type:
    return mi.type_info(kind)


@cache
def _tags(direction: str) -> frozenset[Any]:
    return frozenset(t.tag for t in struct_types(_schema(direction)))


@cache
def _schema(direction: str) -> mi.Type:
    return mi.type_info(READERS[direction])


def struct_types(t: mi.Type) -> list[mi.StructType]:
    t = bare_type(t)
    if isinstance(t, mi.StructType):
        return [t]
    if isinstance(t, mi.UnionType):
        return [s for member in t.types for s in struct_types(member)]
    return []


def bare_type(t: mi.Type) -> mi.Type:
    while isinstance(t, mi.Metadata):
        t = t.type
    return t


def _prune(value: Any, t: mi.Type) -> Any:
    """``value`` (msgpack builtins) without the map keys and trailing array items ``t`` has no field for."""
    t = bare_type(t)
    if isinstance(t, mi.UnionType):
        structs = struct_types(t)
        if isinstance(value, dict) and structs:
            match = [s for s in structs if s.tag_field is None or value.get(s.tag_field) == s.tag]
            return _prune(value, match[0]) if len(match) == 1 else value
        for member in t.types:
            member = bare_type(member)
            if isinstance(value, list) and isinstance(member, mi.StructType | mi.ListType | mi.TupleType
                                                      | mi.VarTupleType | mi.SetType | mi.FrozenSetType):
                return _prune(value, member)
            if isinstance(value, dict) and isinstance(member, mi.DictType):
                return _prune(value, member)
        return value
    if isinstance(t, mi.StructType):
        if t.array_like and isinstance(value, list):
            return [_prune(v, f.type) for v, f in zip(value[: len(t.fields)], t.fields)]
        if isinstance(value, dict):
            fields = {f.encode_name: f for f in t.fields}
            return {k: _prune(v, fields[k].type) if k in fields else v for k, v in value.items()
                    if k in fields or k == t.tag_field}
        return value
    if isinstance(t, mi.ListType | mi.VarTupleType | mi.SetType | mi.FrozenSetType) and isinstance(value, list):
        return [_prune(v, t.item_type) for v in value]
    if isinstance(t, mi.TupleType) and isinstance(value, list):
        return [_prune(v, item) for v, item in zip(value, t.item_types)] + value[len(t.item_types):]
    if isinstance(t, mi.DictType) and isinstance(value, dict):
        return {k: _prune(v, t.value_type) for k, v in value.items()}
    return value
