"""Every field of every message, with a value of every msgpack type: the hostile inputs of
``tests/test_hostile_fields.py``.

For each message type a direction reads (``protocol.decode``'s unions), a base map is built from the schema (each
field a plausible value of its own type), then each field in turn (``v`` and ``type`` included) is replaced by each
value of ``VALUES``: nil, booleans, integers at the edges of int64/uint64, floats that are not numbers, strings,
binaries, arrays and maps (nested, empty, with a non-string key) and an extension. A field missing altogether is one
more case. The receiver must answer each with a clear error (or act on it, when it is valid) and stay alive.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgspec
from msgspec import inspect as mi

from ipc import protocol
from ipc.tolerant import bare_type, struct_types

VALUES: list[tuple[str, Any]] = [
    ("nil", None), ("true", True), ("false", False), ("zero", 0), ("minus one", -1),
    ("int64 max", 2**63 - 1), ("int64 min", -(2**63)), ("uint64 max", 2**64 - 1),
    ("float", 1.5), ("nan", float("nan")), ("inf", float("inf")), ("-inf", float("-inf")),
    ("empty str", ""), ("long str", "x" * 5000), ("non-ascii str", "\u00e9\u4e2d\U0001f600"),
    ("bin", b"\x00\xff" * 8), ("empty array", []), ("array", [1, "a", None]), ("nested array", [[[]]]),
    ("empty map", {}), ("map", {"a": 1}), ("int-keyed map", {1: 2}), ("array-keyed map", {(1, 2): 3}),
    ("ext", msgspec.msgpack.Ext(5, b"ext")),
]
MISSING = object()

DIRECTIONS: dict[str, Any] = {  # what each receiver reads: client -> server/router, server -> SDK, registrations
    "client": protocol.ClientMessage,
    "server": protocol.ServerMessage,
    "replica": protocol.Register,
    "router": protocol.Registered,
}


@dataclass(frozen=True)
class Case:
    message: str  # its type tag
    field: str
    value_name: str
    data: bytes

    @property
    def name(self) -> str:
        return f"{self.message}.{self.field}={self.value_name}"


def structs(direction: str) -> list[mi.StructType]:
    return struct_types(mi.type_info(DIRECTIONS[direction]))


def plausible(t: mi.Type) -> Any:
    """A value of type ``t`` as msgpack builtins (within its bounds where it has them)."""
    t = bare_type(t)
    match t:
        case mi.BoolType():
            return False
        case mi.IntType():
            return max(1, t.ge or 0) if t.le is None or t.le >= 1 else t.le
        case mi.FloatType():
            return 1.0
        case mi.StrType():
            return "s"
        case mi.BytesType() | mi.ByteArrayType() | mi.MemoryViewType():
            return b"x"
        case mi.ListType() | mi.SetType() | mi.FrozenSetType() | mi.VarTupleType():
            return []
        case mi.TupleType():
            return [plausible(item) for item in t.item_types]
        case mi.DictType():
            return {}
        case mi.EnumType():
            member = next(iter(t.cls))
            return member.value if isinstance(member, Enum) else member
        case mi.LiteralType():
            return t.values[0]
        case mi.StructType():
            fields = {f.encode_name: plausible(f.type) for f in t.fields}
            if t.tag_field is not None:
                fields[t.tag_field] = t.tag
            return list(fields.values()) if t.array_like else fields
        case mi.UnionType():
            members = [m for m in t.types if not isinstance(bare_type(m), mi.NoneType)]
            return plausible(members[0]) if members else None
        case _:
            return None


def base(struct: mi.StructType) -> dict[str, Any]:
    """A map of ``struct``'s message with each field present (optional ones too, so each can be replaced)."""
    data: dict[str, Any] = {"type": struct.tag, "v": protocol.PROTOCOL_VERSION}
    for f in struct.fields:
        if f.encode_name != "v":
            data[f.encode_name] = plausible(f.type)
    if struct.tag == "chunk":  # its frames must fill its shape
        data |= {"frames": b"\0" * 3, "shape": [1, 1, 1, 3]}
    return data


def _nested(t: mi.Type) -> mi.StructType | None:
    """The struct a field holds (itself, or the struct member of an optional), if any."""
    t = bare_type(t)
    if isinstance(t, mi.UnionType):
        found = [s for m in t.types for s in struct_types(m)]
        return found[0] if len(found) == 1 else None
    return t if isinstance(t, mi.StructType) else None


def _paths(struct: mi.StructType, value: Any, depth: int) -> Iterator[tuple[tuple[Any, ...], str]]:
    """(path, dotted name) of every field of ``value`` (a ``struct`` as builtins), nested structs included."""
    fields = list(enumerate(struct.fields)) if struct.array_like else [(f.encode_name, f) for f in struct.fields]
    for key, f in fields:
        if (isinstance(value, dict) and key not in value) or (isinstance(value, list) and key >= len(value)):
            continue
        yield (key,), f.encode_name
        inner = _nested(f.type)
        if inner is not None and depth > 0 and isinstance(value[key], dict | list):
            for path, name in _paths(inner, value[key], depth - 1):
                yield (key, *path), f"{f.encode_name}.{name}"


def _replaced(tree: Any, path: tuple[Any, ...], value: Any) -> Any:
    """``tree`` with the item at ``path`` replaced by ``value`` (left out when it is ``MISSING``)."""
    copy = dict(tree) if isinstance(tree, dict) else list(tree)
    key = path[0]
    if len(path) > 1:
        copy[key] = _replaced(tree[key], path[1:], value)
    elif value is MISSING and isinstance(copy, dict):
        del copy[key]
    elif value is MISSING:
        del copy[key:]
    else:
        copy[key] = value
    return copy


def cases(direction: str, depth: int = 3) -> Iterator[Case]:
    """Every field of every message ``direction`` reads (``v`` and ``type``, and the fields of nested values down to
    ``depth`` levels), replaced by every value of ``VALUES`` or left out."""
    for struct in structs(direction):
        message = base(struct)
        paths = [(("type",), "type"), (("v",), "v"), *((p, n) for p, n in _paths(struct, message, depth)
                                                          if p != ("v",))]
        for path, name in paths:
            for value_name, value in [*VALUES, ("missing", MISSING)]:
                data = _replaced(message, path, value)
                yield Case(str(struct.tag), name, value_name, msgspec.msgpack.encode(data))
