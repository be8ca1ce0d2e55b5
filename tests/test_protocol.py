"""The wire schema: round trips, and every malformed message rejected with a message naming the problem."""

from __future__ import annotations

import math

import msgspec
import pytest

from ipc import protocol as p


def test_client_messages_round_trip() -> None:
    for message in (p.Open(req=1, image=b"png", prompt="a", seed=3, num_chunks=4),
                    p.Control(req=2, session="s", index=0,
                              control=p.ChunkControl(keys=frozenset("w"), mouse=(1.0, 2.0))),
                    p.ControlState(req=3, session="s", keys=["a"], taps=["w"], revision=5),
                    p.Close(req=4, session="s"), p.Stats(req=5), p.Heartbeat()):
        assert p.decode(p.encode(message), "client") == message


V = p.PROTOCOL_VERSION


def _raw(**fields: object) -> bytes:
    return msgspec.msgpack.encode(fields)


@pytest.mark.parametrize(("data", "expected"), [
    (b"\xc1\xc1 not msgpack", "not a msgpack message"),
    (msgspec.msgpack.encode([1, 2]), "must be a msgpack map"),
    (_raw(v=V, type="teleport", req=1), "unknown message type 'teleport'"),
    (_raw(v=9, type="open", req=1, image=b""), "protocol version 9 is not supported"),
    (_raw(v=V, type="open", image=b""), "missing required field `req`"),
    (_raw(v=V, type="control", req=1, session="s", index="zero"), "Expected `int`, got `str` - at `$.index`"),
    (_raw(v=V, type="close", req=1, session="s", extra=1), "unknown field `extra`"),
    (_raw(v=V, req=1), "no 'type' field"),
])
def test_malformed_messages_raise_a_protocol_violation_naming_the_problem(data: bytes, expected: str) -> None:
    with pytest.raises(p.ProtocolViolation, match=expected.replace("$", r"\$").replace("(", r"\(")):
        p.decode(data, "client")


def test_oversized_message_is_rejected_before_decoding() -> None:
    with pytest.raises(p.ProtocolViolation, match="exceeds the limit of 1000 bytes"):
        p.decode(b"\x00" * 1001, "client", max_bytes=1000)


FACTS = p.ChunkFacts(3, 12, p.ChunkControl(keys=frozenset("wd"), mouse=(1.5, 0.0), revision=7),
                     p.ChunkTimes(1.0, 0.5, 0.9, 1.1, 1.3, 1.35, 1.45, 1.5, condition_start=0.6),
                     (p.Span("denoise", 2, "denoise", 1.05, 1.1, 1.3), p.Span("transfer:frames", 0, "frames", 1.4,
                                                                                1.44, 1.45)))


def test_a_server_message_is_not_accepted_from_a_client() -> None:
    with pytest.raises(p.ProtocolViolation, match="unknown message type 'chunk'"):
        p.decode(p.encode(p.Chunk(session="s", frames=b"", shape=(0, 0, 0, 3), facts=FACTS)), "client")


def test_a_chunk_carries_its_facts_to_the_client_in_one_typed_shape() -> None:
    chunk = p.Chunk(session="s", frames=b"\0" * 3, shape=(1, 1, 1, 3), facts=FACTS)
    got = p.decode(p.encode(chunk), "server")
    assert got == chunk and got.facts.control.keys == frozenset("wd") and got.facts.times.control_to_output == 0.5
    assert p.to_builtins(got.facts)["control"] == {"keys": ["d", "w"], "mouse": (1.5, 0.0), "poses": None,
                                                   "revision": 7}


def test_a_control_is_lower_cased_and_checked_where_it_is_made() -> None:
    assert p.ChunkControl(keys=frozenset("WD")).keys == frozenset("wd")
    for bad in ({"keys": frozenset("q")}, {"mouse": (math.nan, 0.0)}, {"mouse": (400.0, 0.0)},
                {"poses": ((0.0,) * 15,)}, {"poses": ((math.inf,) * 16,)}):
        with pytest.raises(ValueError):
            p.ChunkControl(**bad)  # type: ignore[arg-type]


def test_a_bad_control_on_the_wire_is_refused_naming_the_problem_and_its_request() -> None:
    data = _raw(v=V, type="control", req=7, session="s", index=0, control={"keys": ["w", "q"]})
    with pytest.raises(p.ProtocolViolation, match=r"unknown keys \['q'\].*\$\.control") as error:
        p.decode(data, "client")
    assert error.value.req == 7
    ok = _raw(v=V, type="control", req=8, session="s", index=0, control={"keys": ["W"]})
    assert p.decode(ok, "client").control == p.ChunkControl(keys=frozenset("w"))


@pytest.mark.parametrize("message", [
    p.InitCondition(session="s", seed=1, prompt="p", image=b"\1" * 12, image_height=2, image_width=2, height=16,
                    width=32),
    p.DenoiseChunk(session="s", index=4, control=p.ChunkControl(keys=frozenset("w")),
                   latent=p.TensorSpec(shape=(16, 3, 2, 4), dtype="float32")),
    p.ReceiveFrames(session="s", index=4, tensor=p.TensorSpec(shape=(12, 16, 32, 3), dtype="uint8")),
    p.Release(session="s"), p.Shutdown(), p.Ping(seq=1, sent=2.0),
])
def test_every_worker_task_round_trips_as_its_own_type(message: object) -> None:
    assert p.decode(p.encode(message), "coordinator") == message  # type: ignore[arg-type]


def test_completions_name_their_stage_or_edge_and_failures_say_whether_the_rank_can_go_on() -> None:
    spans = (p.WorkerSpan("decode", 1.0, 2.0),)
    for message in (p.ChunkDone(rank=1, role="decode", session="s", spans=spans, stage=p.Stage.DECODE, index=2),
                    p.TransferDone(rank=0, role="frames", session="s", edge=p.Edge.FRAMES, index=2),
                    p.TaskFailed(rank=3, role="denoise", session="s", phase=p.Phase.CHUNK, stage=p.Stage.DENOISE,
                                 index=2, error="boom", fatal=True)):
        assert p.decode(p.encode(message), "worker") == message
    assert p.DenoiseChunk.phase is p.Phase.CHUNK and p.ReceiveLatent.edge is p.Edge.LATENT


# ------------------------------------------------------------------------------------------------ hostile input


def _nested(depth: int) -> bytes:
    """A map whose ``x`` holds lists nested ``depth`` deep, built by hand (msgpack's encoder would recurse)."""
    return b"\x83\xa1v" + bytes([V]) + b"\xa4type\xa4open\xa1x" + b"\x91" * depth + b"\xc0"


@pytest.mark.parametrize("direction", ["client", "server", "worker", "coordinator"])
def test_a_message_nested_thousands_deep_is_refused_in_every_direction_before_it_is_built(direction: str) -> None:
    with pytest.raises(p.ProtocolViolation, match=f"nests deeper than {p.MAX_DEPTH} levels"):
        p.decode(_nested(100_000), direction)


def test_the_scan_allows_the_deepest_legitimate_message_and_counts_items() -> None:
    poses = [tuple(float(v) for v in (1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1))] * 256
    deepest = p.encode(p.Control(req=1, session="s", index=0, control=p.ChunkControl(poses=poses)))
    assert {"v", "type", "req", "session", "index", "control"} <= p.scan(deepest)
    with pytest.raises(p.ProtocolViolation, match=f"more than {p.MAX_ITEMS} items"):
        p.decode(_raw(v=V, type="stats", req=1, x=[0] * p.MAX_ITEMS), "client")


def test_a_zero_copy_frame_buffer_decodes_like_bytes() -> None:
    """ZeroMQ frames read with ``copy=False`` hand out memoryviews; the pre-scan must read them as bytes."""
    message = p.Open(req=3, image=b"\x89PNG" * 10, prompt="a" * 40, seed=2)  # str8 keys and values
    data = p.encode(message)
    assert p.decode(memoryview(data), "client") == p.decode(data, "client") == message
    assert p.scan(memoryview(data)) == p.scan(data)


@pytest.mark.parametrize(("data", "expected"), [
    (msgspec.msgpack.encode(7), "must be a msgpack map, got a scalar"),
    (msgspec.msgpack.encode({"v": V, "type": "stats", "req": 1}) + b"\x00", "bytes after the message"),
    (msgspec.msgpack.encode({"v": V, "type": "stats", "req": 1})[:-1], "truncated"),
    (b"\xdd\xff\xff\xff\xff", "must be a msgpack map, got an array"),
])
def test_a_message_that_is_not_exactly_one_map_is_refused(data: bytes, expected: str) -> None:
    with pytest.raises(p.ProtocolViolation, match=expected):
        p.decode(data, "client")


def test_a_message_without_a_version_is_refused_with_its_request_id() -> None:
    with pytest.raises(p.ProtocolViolation, match="no protocol version field 'v'") as refused:
        p.decode(msgspec.msgpack.encode({"type": "stats", "req": 42}), "client")
    assert refused.value.req == 42


def test_a_version_2_client_is_still_read_and_other_versions_are_refused_by_number() -> None:
    old = p.decode(_raw(v=2, type="stats", req=1), "client")  # a v2 request uses no later field
    assert isinstance(old, p.Stats) and old.v == 2
    for kind, fields in (("open", {"image": b"png"}), ("watch", {"session": "s", "token": "t"})):
        for version in (2, 3):  # it could not read the stream: refused in its own version, which it reads
            with pytest.raises(p.ProtocolViolation, match="upgrade the SDK") as refused:
                p.decode(_raw(v=version, type=kind, req=1, **fields), "client")
            assert (refused.value.req, refused.value.answer_v) == (1, version)
    for version in (1, p.PROTOCOL_VERSION + 1):
        with pytest.raises(p.ProtocolViolation, match=f"protocol version {version} is not supported"):
            p.decode(_raw(v=version, type="stats", req=1), "client")


def test_error_texts_are_clipped_and_never_echo_unbounded_input() -> None:
    with pytest.raises(p.ProtocolViolation) as refused:
        p.decode(_raw(v=V, type="close", req=1, session="s" * 10_000), "client")
    assert len(str(refused.value)) <= p.MAX_ERROR_CHARS
    assert p.clip("x" * 1000).endswith("(clipped)") and len(p.clip("x" * 1000)) == p.MAX_ERROR_CHARS
    assert p.clip("short") == "short"


IDENTITY = (1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0)


@pytest.mark.parametrize(("pose", "expected"), [
    (IDENTITY, None),
    ((0.0, -1.0, 0.0, 5.0, 1.0, 0.0, 0.0, -3.0, 0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 0.0, 1.0), None),  # a turn, moved
    (IDENTITY[:15], "16 floats"),
    ((*IDENTITY[:3], float("nan"), *IDENTITY[4:]), "finite"),
    ((2.0, *IDENTITY[1:]), "rotation"),  # a scale is not rigid
    ((-1.0, *IDENTITY[1:5], 1.0, *IDENTITY[6:]), "rotation"),  # a mirror (determinant -1)
    ((*IDENTITY[:12], 0.0, 0.0, 1.0, 1.0), "last row"),
    ((*IDENTITY[:3], 2e6, *IDENTITY[4:]), "translation"),
])
def test_a_pose_must_be_a_rigid_camera_to_world_transform_near_the_origin(pose: tuple[float, ...],
                                                                         expected: str | None) -> None:
    problem = p.pose_problem(pose)
    assert problem is None if expected is None else expected in (problem or ""), problem


def test_an_open_carries_a_camera_and_a_bad_one_is_refused_naming_the_problem_and_its_request() -> None:
    camera = (415.5, 415.7, 415.8, 239.8)
    opened = p.Open(req=1, image=b"png", intrinsics=camera)
    assert p.decode(p.encode(opened), "client").intrinsics == camera
    assert p.decode(p.encode(p.Open(req=1, image=b"png")), "client").intrinsics is None  # the server's camera
    ok = _raw(v=V, type="open", req=2, image=b"png", intrinsics=[500, 500, 416, 240])  # integers are pixels too
    assert p.decode(ok, "client").intrinsics == (500.0, 500.0, 416.0, 240.0)
    for bad, why in (([math.nan, 1.0, 1.0, 1.0], "must be finite"), ([0.0, 415.0, 416.0, 240.0], "must be positive"),
                     ([415.0, -1.0, 416.0, 240.0], "must be positive"), ([415.0, 415.0, 900.0, 240.0], "inside the"),
                     ([415.0, 415.0, 416.0, -0.5], "inside the"), ([1e9, 415.0, 416.0, 240.0], "at most"),
                     ([415.0, 415.0, 416.0], "length 4")):
        with pytest.raises(p.ProtocolViolation, match=why) as error:
            p.decode(_raw(v=V, type="open", req=7, image=b"png", intrinsics=bad), "client")
        assert error.value.req == 7
    reply = p.Opened(req=1, session="s", height=240, width=416, fps=16.0, frames_first_chunk=9, frames_per_chunk=12,
                     num_chunks=None, intrinsics=(207.75, 207.85, 207.9, 119.9))
    assert p.decode(p.encode(reply), "server") == reply
    init = p.InitDenoise(session="s", seed=1, prompt="", height=240, width=416, intrinsics=camera)
    assert p.decode(p.encode(init), "coordinator") == init


def test_steps_are_a_quality_preset_and_a_floor_above_them_is_refused_while_decoding() -> None:
    ok = p.decode(p.encode(p.Open(req=1, image=b"x", steps=2, min_steps=1)), "client")
    assert (ok.steps, ok.min_steps) == (2, 1) and p.decode(p.encode(p.Open(req=1, image=b"x")), "client").steps is None
    refused = (({"steps": 3}, "steps must be one of 4, 2, 1"), ({"steps": 2, "min_steps": 4}, "must not exceed"),
               ({"min_steps": 0}, ">= 1"))
    for fields, why in refused:
        with pytest.raises(p.ProtocolViolation, match=why):
            p.decode(msgspec.msgpack.encode({"v": 2, "type": "open", "req": 1, "image": b"x", **fields}), "client")
    for kind in ("control", "control_state"):
        with pytest.raises(p.ProtocolViolation, match="steps must be one of"):
            p.decode(msgspec.msgpack.encode({"v": 2, "type": kind, "req": 1, "session": "s", "index": 0, "steps": 3}
                                            if kind == "control" else
                                            {"v": 2, "type": kind, "req": 1, "session": "s", "steps": 3}), "client")
