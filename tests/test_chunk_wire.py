"""A chunk's frames as a ZeroMQ part of their own (``ipc.chunk_wire``, protocol 4): what rank 0 sends, what the SDK
reads (real sockets on loopback, the SDK's own ``route``), what the router forwards or refuses, and every malformed
arrangement of parts answered as any other malformed message is, never harming another session's chunks."""

from __future__ import annotations

import hashlib
import queue
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq

from ipc import chunk_wire, protocol
from ipc.client import ChunkResult, ServerError
from ipc.client_core import ClientCore
from ipc.transport import client_router, send_or_why
from runtime.migration import renamed

TIMES = protocol.ChunkTimes(control_accepted=1.0, condition_submitted=0.5, condition_ready=0.6, denoise_start=1.0,
                            denoise_end=1.2, decode_start=1.2, decode_end=1.3, emitted=1.3)


def facts(index: int = 0, frames: int = 2) -> protocol.ChunkFacts:
    return protocol.ChunkFacts(index=index, frames=frames, control=protocol.ChunkControl(keys=frozenset("w")),
                               times=TIMES)


def frames(n: int = 2, side: int = 8, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, side, side + 2, 3), dtype=torch.uint8, generator=generator)


def sdk() -> tuple[ClientCore[Any, Any], list[ServerError]]:
    errors: list[ServerError] = []
    return ClientCore(queue.SimpleQueue, errors.append), errors


def received(core: ClientCore[Any, Any], session: str) -> ChunkResult | None:
    events = core.session(session).events
    return None if events.empty() else events.get_nowait()


def test_a_chunk_crosses_real_sockets_as_the_tensors_own_buffer_and_the_sdk_reads_it_without_a_copy() -> None:
    context = zmq.Context.instance()
    router, port = client_router(context, "127.0.0.1", 0, send_hwm=4, max_message_bytes=1 << 20)
    dealer = context.socket(zmq.DEALER)
    try:
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(b"hello")
        who, _ = router.recv_multipart()
        tensor = frames()
        digest = hashlib.sha256(tensor.numpy().tobytes()).hexdigest()
        parts = chunk_wire.chunk_parts("s", tensor, facts())
        assert np.shares_memory(np.frombuffer(parts[1], np.uint8), tensor.numpy())  # the tensor's buffer, no copy
        assert send_or_why(router, who, parts, copy=False) is None  # as rank 0 sends it (to the player and watchers)
        assert dealer.poll(10_000)
        got = dealer.recv_multipart(copy=False)  # as both SDK transports receive
        core, errors = sdk()
        core.route(got)
        chunk = received(core, "s")
        assert not errors and chunk is not None
        assert (chunk.index, chunk.frames.shape) == (0, tuple(tensor.shape))
        assert hashlib.sha256(chunk.frames.tobytes()).hexdigest() == digest
        assert not chunk.frames.flags.writeable and not chunk.frames.flags.owndata  # a view on the received part
        head = msgspec.msgpack.decode(got[0].bytes)
        assert (head["v"], head["frames_part"], head["frames"], head["shape"]) == (4, 1, b"", [2, 8, 10, 3])
        assert len(got[0].bytes) < 1024  # the map holds the facts, never the frames
    finally:
        dealer.close(0)
        router.close(0)


def test_a_chunk_of_a_server_before_version_4_with_its_frames_inside_its_map_reads_as_before() -> None:
    tensor = frames()
    inline = protocol.Chunk(session="s", frames=tensor.numpy().tobytes(), shape=tuple(tensor.shape), facts=facts(),
                            v=3)
    core, errors = sdk()
    core.route(protocol.encode(inline))
    chunk = received(core, "s")
    assert not errors and chunk is not None and np.array_equal(chunk.frames, tensor.numpy())


def v4(session: str, index: int = 0, n: int = 2) -> list[bytes]:
    head, body = chunk_wire.chunk_parts(session, frames(n, seed=index), facts(index, n))
    return [head, bytes(body)]


def map_only(session: str, frames_part: int, frames_inside: bytes = b"", **fields: object) -> bytes:
    """A chunk map as a broken or hostile server may write it (``frames_part`` and ``fields`` unchecked)."""
    raw = msgspec.msgpack.decode(v4(session)[0])
    return msgspec.msgpack.encode({**raw, "frames_part": frames_part, "frames": frames_inside, **fields})


def inline_map(**fields: object) -> bytes:
    """A chunk of a server before version 4 (its 480 bytes of frames inside its map), ``fields`` unchecked."""
    raw = msgspec.msgpack.decode(protocol.encode(protocol.Chunk(session="bad", frames=bytes(480), shape=(2, 8, 10, 3),
                                                                facts=facts(), v=3)))
    return msgspec.msgpack.encode({**raw, **fields})


MALFORMED: dict[str, tuple[list[bytes], str]] = {
    "the frames part missing": ([v4("bad")[0]], "a chunk with its frames in ZeroMQ part 1 is 2 ZeroMQ frames, got 1"),
    "a part too many": ([*v4("bad"), b"more"], "is 2 ZeroMQ frames, got 3"),
    "a frames part larger than its shape": ([v4("bad")[0], v4("bad")[1] + b"\0" * 64],
                                            "frames part of 544 bytes does not match its shape (2, 8, 10, 3)"),
    "a frames part shorter than its shape": ([v4("bad")[0], v4("bad")[1][:-1]],
                                             "frames part of 479 bytes does not match its shape"),
    "frames inside the map and apart": ([map_only("bad", 1, b"\0" * 480), v4("bad")[1]], "do not match"),
    "the frames in a part that is not there": ([map_only("bad", 2), v4("bad")[1]], "cannot be in ZeroMQ part 2"),
    "inline frames and a part besides": ([protocol.encode(protocol.Chunk(session="bad", frames=bytes(480),
                                                                         shape=(2, 8, 10, 3), facts=facts())),
                                          b"extra"], "a chunk with its frames inside its map is 1 ZeroMQ frames"),
    "a zero side and a huge one with an empty frames part": ([map_only("bad", 1, shape=[0, 2**63 - 1, 1, 3]), b""],
                                                             "frames part of 0 bytes does not match its shape"),
    "inline frames under a shape with a side to be worked out": (
        [inline_map(shape=[-1, 8, 10, 3])],
        "shape (-1, 8, 10, 3)"),  # numpy's reshape would work the -1 out: refused by the SDK and the router
    "inline frames of four channels": (
        [inline_map(shape=[2, 6, 10, 4])],
        "shape (2, 6, 10, 4)"),
    "a reply in two parts": ([protocol.encode(protocol.Accepted(req=3, session="bad", index=0)), b"x"],
                             "a accepted message is one ZeroMQ frame, got 2"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_arrangement_of_parts_is_a_named_bad_reply_and_the_next_chunk_of_another_session_arrives(
        case: str) -> None:
    parts, says = MALFORMED[case]
    core, errors = sdk()
    core.route(parts)
    assert received(core, "bad") is None
    assert [e.code for e in errors] == ["bad_reply"] and says in str(errors[0]), errors
    core.route(v4("good", 0))
    chunk = received(core, "good")
    assert chunk is not None and np.array_equal(chunk.frames, frames(seed=0).numpy()) and len(errors) == 1


@pytest.mark.parametrize("case", sorted(set(MALFORMED) - {"a reply in two parts"}))
def test_the_router_refuses_to_forward_a_chunk_whose_parts_are_not_what_its_map_says(case: str) -> None:
    parts, says = MALFORMED[case]
    with pytest.raises(protocol.ProtocolViolation, match=says.split("(")[0]):
        chunk_wire.peek_chunk(parts)
    head = chunk_wire.peek_chunk(v4("good"))
    assert (head.session, head.shape, head.frames_part) == ("good", (2, 8, 10, 3), 1)


def test_the_router_refuses_a_frames_part_whose_map_has_no_shape() -> None:
    """The router reads a chunk's head only (the SDK's schema refuses such a map too): none goes on unmeasured."""
    with pytest.raises(protocol.ProtocolViolation, match="has no shape"):
        chunk_wire.peek_chunk([map_only("bad", 1, shape=None), v4("bad")[1]])


def test_a_migrated_chunk_is_renamed_in_its_map_alone_and_its_frames_part_goes_on_as_it_is() -> None:
    parts = tuple(v4("0000000000aa"))
    moved = renamed(parts, "0000000000aa", "0000000000bb")
    assert moved[1] is parts[1]
    core, errors = sdk()
    core.route(list(moved))
    chunk = received(core, "0000000000bb")
    assert not errors and chunk is not None and chunk.frames.tobytes() == parts[1]
