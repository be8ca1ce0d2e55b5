"""The coordinator core without processes: each test plays the clients and the ranks of the 7-rank layout by
feeding events (with their time) and checks what the core asks the shell to do, one rule per test."""

from __future__ import annotations

import pytest

from ipc import protocol as p
from runtime.clients import (
    BACKPRESSURE_RETRY_COLD_S,
    BACKPRESSURE_RETRY_MAX_S,
    BACKPRESSURE_RETRY_MIN_S,
    backpressure_retry_s,
)
from runtime.config import ServerConfig
from runtime.core_types import (
    DecodeImage,
    DropTensors,
    EmitChunk,
    ImageDecoded,
)
from tests.core_job import A, B, Job, control, errors, image

# ---- open -> caches -> conditions


def test_open_initialises_the_caches_stage_by_stage_and_replies_once_every_dit_rank_is_ready() -> None:
    job = Job()
    out = job.send(A, p.Open(req=7, image=b"png", prompt="a forest", seed=3, num_chunks=4))
    (decode,) = [o for o in out if isinstance(o, DecodeImage)]
    assert decode.data == b"png" and decode.max_pixels == ServerConfig().max_image_pixels
    out = job.step(ImageDecoded(decode.ticket, image(100, 120)))
    ((who, init),) = job.sent(p.InitCondition, out)
    assert who == b"0:condition" and (init.image_height, init.image_width, init.height, init.width) == (100, 120,
                                                                                                       160, 256)
    assert len(init.image) == 100 * 120 * 3 and (init.seed, init.prompt) == (3, "a forest")
    job.answer(p.InitCondition)
    assert [w for w, _ in job.sent(p.InitDecode)] == [b"1:decode"]
    out = job.answer(p.InitDecode)
    assert [w for w, _ in job.sent(p.BroadcastContext, out)] == [f"{r}:condition_edge".encode() for r in range(7)
                                                                 if r != 1]
    assert [w for w, _ in job.sent(p.InitDenoise, out)] == [f"{r}:denoise".encode() for r in range(2, 7)]
    job.answer(p.BroadcastContext)
    job.answer(p.InitDenoise, ranks=[2, 3, 4, 5])
    assert not job.to(A, p.Opened)  # rank 6 has not opened the session yet
    out = job.answer(p.InitDenoise, ranks=[6])
    (opened,) = job.to(A, p.Opened, out)
    assert (opened.req, opened.height, opened.width, opened.frames_first_chunk, opened.frames_per_chunk) == (
        7, 160, 256, 9, 12)
    assert [(w, t.index) for w, t in job.sent(p.ConditionChunk, out)] == [(b"0:condition", 0)]
    assert job.core.sessions[opened.session].image is None  # the condition stage holds it now


def test_a_condition_moves_to_every_dit_rank_as_soon_as_it_is_encoded() -> None:
    job = Job()
    sid = job.open()
    out = job.answer(p.ConditionChunk, sid, 0)
    moved = job.sent(p.BroadcastCondition, out)
    assert [w for w, _ in moved] == [f"{r}:condition_edge".encode() for r in (0, 2, 3, 4, 5, 6)]
    assert {t.tensor for _, t in moved} == {p.TensorSpec(shape=(3, 160, 256), dtype="float32")}
    assert [t.index for _, t in job.sent(p.ConditionChunk, out)] == [1]  # the prefetch of condition[1], no control


# ---- controls, chunks


def test_an_indexed_control_is_accepted_and_denoised_on_every_dit_rank_after_the_latent_receive() -> None:
    job = Job()
    sid = job.open()
    job.answer(p.ConditionChunk, sid, 0)
    out = control(job, sid, 0, keys=frozenset("W"))
    assert [a.index for a in job.to(A, p.Accepted, out)] == [0]
    sends = [(w, type(t).__name__) for w, t in job.sent(p.WorkerTask, out)]  # type: ignore[arg-type]
    assert sends[0] == (b"1:latent_receiver", "ReceiveLatent")
    assert sends[1:] == [(f"{r}:denoise".encode(), "DenoiseChunk") for r in range(2, 7)]
    (_, task), *_ = job.sent(p.DenoiseChunk, out)
    assert task.control == p.ChunkControl(keys=frozenset("w")) and task.latent.shape == (12, 3, 80, 128)


def test_only_the_dit_leader_moves_the_schedule_and_every_rank_adds_its_spans() -> None:
    job = Job()
    sid = job.open()
    job.answer(p.ConditionChunk, sid, 0)
    control(job, sid, 0)
    assert not job.sent(p.DecodeChunk, job.answer(p.DenoiseChunk, sid, 0, ranks=[3, 4, 5, 6]))
    out = job.answer(p.DenoiseChunk, sid, 0, ranks=[2])
    assert [(w, t.frames.shape) for w, t in job.sent(p.DecodeChunk, out)] == [(b"1:decode", (9, 160, 256, 3))]
    assert {s.rank for s in job.core.sessions[sid].spans[0] if s.name == "denoise"} == {2, 3, 4, 5, 6}


def test_a_chunk_leaves_only_once_decoded_and_its_frames_arrived_with_its_facts() -> None:
    job = Job()
    sid = job.open()
    job.answer(p.ConditionChunk, sid, 0)
    control(job, sid, 0, keys=frozenset("d"), mouse=(2.0, 0.0))
    job.answer(p.DenoiseChunk, sid, 0)
    assert not [o for o in job.answer(p.DecodeChunk, sid, 0) if isinstance(o, EmitChunk)]
    (emit,) = [o for o in job.answer(p.ReceiveFrames, sid, 0) if isinstance(o, EmitChunk)]
    facts = emit.facts
    assert (emit.to, facts.index, facts.frames) == (A, 0, 9)
    assert facts.control == p.ChunkControl(keys=frozenset("d"), mouse=(2.0, 0.0))
    assert {s.name for s in facts.spans} >= {"condition", "denoise", "decode"}
    assert facts.times.control_accepted is not None and facts.times.emitted == job.now


def test_a_session_closes_itself_after_its_last_chunk_and_releases_decode_denoise_condition() -> None:
    job = Job()
    sid = job.open(num_chunks=2)
    for index in range(2):
        control(job, sid, index)
    job.chunk(sid, 0)
    job.chunk(sid, 1)
    assert [e.facts.index for e in job.emitted(sid)] == [0, 1]
    assert [w for w, _ in job.sent(p.Release)] == [b"1:decode"]
    job.answer(p.Release, sid)
    assert [w for w, t in job.tasks if isinstance(t, p.Release)] == [f"{r}:denoise".encode() for r in range(2, 7)]
    job.answer(p.Release, sid, ranks=[6, 2, 3])
    assert not [w for w, t in job.tasks if w == b"0:condition"]  # denoise still releasing on ranks 4 and 5
    job.answer(p.Release, sid)
    out = job.answer(p.Release, sid)
    (closed,) = job.to(A, p.Closed, out)
    assert closed.reason == "complete" and closed.summary.chunks == 2
    assert closed.summary.released == {"decode": [1], "denoise": [2, 3, 6, 4, 5], "condition": [0]}
    assert list(closed.summary.released) == ["decode", "denoise", "condition"]  # in release order, on the wire too
    assert list(p.decode(p.encode(closed), "server").summary.released) == ["decode", "denoise", "condition"]
    assert DropTensors(sid) in out and sid not in job.core.sessions


def test_a_client_close_drains_then_releases() -> None:
    job = Job()
    sid = job.open(num_chunks=None)
    out = job.send(A, p.Close(req=1, session=sid))
    assert not job.to(A, p.Closed, out)  # condition[0] still encoding: it drains first
    job.answer(p.ConditionChunk, sid, 0)
    job.settle(p.Release)
    assert [c.reason for c in job.to(A, p.Closed)] == ["client"]


# ---- control admission


def test_duplicate_skipped_and_unknown_session_controls_are_refused_and_change_nothing() -> None:
    job = Job()
    sid = job.open()
    control(job, sid, 0)
    assert errors(job, A, control(job, sid, 0, keys=frozenset("s"))) == ["rejected_control"]
    assert errors(job, A, control(job, sid, 3)) == ["rejected_control"]
    assert errors(job, B, control(job, sid, 1, who=B)) == ["unknown_session"]  # not B's session
    assert job.core.scheduler.next_control_index(sid) == 1
    assert [a.index for a in job.to(A, p.Accepted, control(job, sid, 1))] == [1]


def test_a_full_control_edge_is_backpressure_with_a_retry_hint() -> None:
    job = Job(scheduler={"control_capacity": 1})
    sid = job.open()
    control(job, sid, 0)  # waits for condition[0]
    out = control(job, sid, 1)
    (error,) = job.to(A, p.Error, out)
    assert error.code == "control_backpressure" and error.req is not None
    assert error.retry_after_s == BACKPRESSURE_RETRY_COLD_S  # no chunk period known yet
    job.answer(p.ConditionChunk, sid, 0)  # denoise 0 starts: the edge has room again
    assert job.to(A, p.Accepted, control(job, sid, 1))


def test_the_backpressure_hint_is_an_eighth_of_the_chunk_period_within_bounds() -> None:
    assert backpressure_retry_s(0.6) == pytest.approx(0.075)  # a GPU stream: 8 retries a chunk, not 300
    assert backpressure_retry_s(0.004) == BACKPRESSURE_RETRY_MIN_S
    assert backpressure_retry_s(30.0) == BACKPRESSURE_RETRY_MAX_S


def test_poses_must_match_the_sessions_own_frame_count() -> None:
    job = Job()
    sid = job.open()
    pose = (1.0, 0, 0, 0, 0, 1.0, 0, 0, 0, 0, 1.0, 0, 0, 0, 0, 1.0)
    out = control(job, sid, 0, poses=(pose,) * 12)
    assert errors(job, A, out) == ["bad_control"] and "chunk 0 has 9 video frames" in job.to(A, p.Error, out)[0].message
    assert job.to(A, p.Accepted, control(job, sid, 0, poses=(pose,) * 9))


def test_live_snapshots_are_cut_only_when_the_dit_is_about_to_need_them() -> None:
    job = Job()
    sid = job.open(live=True, num_chunks=None)  # the DiT is free: chunk 0's snapshot is cut now (a still camera)
    job.send(A, p.ControlState(req=1, session=sid, keys=["w"], revision=1))
    job.answer(p.ConditionChunk, sid, 0)
    assert {t.control for _, t in job.sent(p.DenoiseChunk)} == {p.ChunkControl(revision=-1)}
    job.send(A, p.ControlState(req=2, session=sid, keys=["d"], taps=["i"], revision=2))
    job.answer(p.ConditionChunk, sid, 1)
    assert job.core.scheduler.next_control_index(sid) == 1  # chunk 0 still denoising: chunk 1 is not cut yet
    job.answer(p.DenoiseChunk, sid, 0)
    second = {t.control for _, t in job.sent(p.DenoiseChunk) if t.index == 1}
    assert second == {p.ChunkControl(keys=frozenset("di"), revision=2)}  # the freshest input, the tap once


def test_live_and_indexed_controls_do_not_mix_and_bad_live_input_gets_its_reason() -> None:
    job = Job()
    live, indexed = job.open(live=True), job.open()
    assert errors(job, A, control(job, live, 0)) == ["bad_control"]
    assert errors(job, A, job.send(A, p.ControlState(req=1, session=indexed, keys=["w"]))) == ["bad_control"]
    assert errors(job, A, job.send(A, p.ControlState(req=2, session=live, keys=["q"], revision=1))) == [
        "unknown_keys"]
    job.send(A, p.ControlState(req=3, session=live, keys=["w"], revision=5))
    assert errors(job, A, job.send(A, p.ControlState(req=4, session=live, keys=["s"], revision=5))) == [
        "stale_revision"]


# ---- sizes


def test_each_session_streams_at_the_allowed_size_nearest_its_start_image_with_size_image() -> None:
    job = Job(stream={"size": "image", "height": 480, "width": 832})  # allowed: the default set at 480x832
    wide = job.open(A, image(720, 1280))  # 16:9 -> 480x832 (the official rule would give 464x832, never warmed)
    tall = job.open(B, image(1536, 1024))  # 3:2 portrait -> 720x544
    sizes = {o.session: (o.height, o.width) for o in job.to(A, p.Opened) + job.to(B, p.Opened)}
    assert sizes == {wide: (480, 832), tall: (720, 544)}
    inits = {t.session: (t.image_height, t.image_width, t.height, t.width) for _, t in job.sent(p.InitCondition)}
    assert inits == {wide: (720, 1280, 480, 832), tall: (1536, 1024, 720, 544)}
    assert {t.session: (t.height, t.width) for _, t in job.sent(p.InitDenoise)} == {wide: (480, 832),
                                                                                   tall: (720, 544)}
    assert {t.session: (t.height, t.width) for _, t in job.sent(p.InitDecode)} == {wide: (480, 832),
                                                                                  tall: (720, 544)}
    for sid in (wide, tall):
        control(job, sid, 0, who=A if sid == wide else B)
    job.settle(p.ConditionChunk, p.BroadcastCondition, p.DenoiseChunk, p.DecodeChunk, p.ReceiveFrames)
    shapes = {t.session: t.frames.shape for _, t in job.sent(p.DecodeChunk)}
    assert shapes == {wide: (9, 480, 832, 3), tall: (9, 720, 544, 3)}
    conditions = {t.session: t.tensor.shape for _, t in job.sent(p.BroadcastCondition)}
    latents = {t.session: t.tensor.shape for _, t in job.sent(p.ReceiveLatent)}
    assert conditions == {wide: (3, 480, 832), tall: (3, 720, 544)}
    assert latents == {wide: (12, 3, 240, 416), tall: (12, 3, 360, 272)}


@pytest.mark.parametrize(("shape", "size"), [((300, 900), (480, 832)), ((900, 310), (832, 480)),
                                             ((500, 520), (624, 624)), ((600, 790), (544, 720)),
                                             ((100, 2000), (480, 832)), ((481, 833), (480, 832))])
def test_an_image_of_any_aspect_ratio_lands_on_an_allowed_size(shape: tuple[int, int],
                                                               size: tuple[int, int]) -> None:
    job = Job(stream={"size": "image", "height": 480, "width": 832})
    job.open(A, image(*shape))
    (opened,) = job.to(A, p.Opened)
    assert (opened.height, opened.width) == size
    assert size in {tuple(s) for s in job.core.stats(0.0).sizes}


def test_configured_sizes_are_the_only_ones_a_session_can_get() -> None:
    job = Job(stream={"size": "image", "sizes": [[160, 240], [240, 160]]})
    for who, shape in ((A, (10, 1000)), (B, (1000, 300))):
        job.open(who, image(*shape))
    assert [(o.height, o.width) for o in job.to(A, p.Opened) + job.to(B, p.Opened)] == [(160, 240), (240, 160)]


def test_a_fixed_size_ignores_the_image_size_and_an_image_too_narrow_for_its_size_is_refused() -> None:
    job = Job()
    job.open(A, image(1000, 10))
    assert [o.height for o in job.to(A, p.Opened)] == [160]
    job = Job(stream={"size": "image"})
    out = job.send(A, p.Open(req=5, image=b"png"))
    (decode,) = [o for o in out if isinstance(o, DecodeImage)]
    out = job.step(ImageDecoded(decode.ticket, image(1, 2000)))
    (error,) = job.to(A, p.Error, out)
    assert (error.code, error.req) == ("bad_image", 5) and "too narrow" in error.message
    assert not job.core.sessions and not job.sent(p.InitCondition)


def test_an_undecodable_image_is_refused_with_bad_image() -> None:
    job = Job()
    out = job.send(A, p.Open(req=3, image=b"gif"))
    (decode,) = [o for o in out if isinstance(o, DecodeImage)]
    out = job.step(ImageDecoded(decode.ticket, None, "not a PNG or JPEG"))
    assert [(e.code, e.req, e.message) for e in job.to(A, p.Error, out)] == [("bad_image", 3, "not a PNG or JPEG")]


def test_sessions_are_created_in_request_order_whatever_order_their_images_decode_in() -> None:
    job = Job()
    first = next(o for o in job.send(A, p.Open(req=1, image=b"a")) if isinstance(o, DecodeImage))
    second = next(o for o in job.send(B, p.Open(req=2, image=b"b")) if isinstance(o, DecodeImage))
    assert not job.step(ImageDecoded(second.ticket, image()))  # B waits for A's image
    job.step(ImageDecoded(first.ticket, image()))
    assert [(t.session, w) for w, t in job.sent(p.InitCondition)] == [("s0", b"0:condition")]
    assert list(job.core.sessions) == ["s0", "s1"] and job.core.sessions["s1"].client == B


def test_busy_counts_open_sessions_and_images_still_decoding() -> None:
    job = Job(server={"max_sessions": 2})
    job.open()
    job.send(A, p.Open(req=1, image=b"png"))  # decoding
    (error,) = job.to(B, p.Error, job.send(B, p.Open(req=2, image=b"png")))
    assert error.code == "busy" and error.retry_after_s and "limit of 2 sessions" in error.message


def test_open_limits_are_checked_before_any_work() -> None:
    job = Job(server={"max_chunks": 10, "max_prompt_chars": 5})
    out = job.send(A, p.Open(req=1, image=b"png", num_chunks=11))
    out += job.send(A, p.Open(req=2, image=b"png", prompt="too long"))
    assert errors(job, A, out) == ["bad_request", "bad_request"] and not [o for o in out
                                                                          if isinstance(o, DecodeImage)]


def test_a_model_that_caps_the_session_length_refuses_longer_sessions_and_caps_open_ended_ones() -> None:
    job = Job(model_max_chunks=7)  # a "full" KV cache holding 7 chunks
    out = job.send(A, p.Open(req=1, image=b"png", num_chunks=8))
    (refused,) = job.to(A, p.Error, out)
    assert refused.code == "bad_request" and "1..7" in refused.message and "kv_full_frames" in refused.message
    sid = job.open(A, num_chunks=None)
    (opened,) = [o for o in job.to(A, p.Opened) if o.session == sid]
    assert opened.num_chunks == 7


# ---- failures
