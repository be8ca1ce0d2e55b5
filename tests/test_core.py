"""The coordinator core without processes: each test plays the clients and the ranks of the 7-rank layout by
feeding events (with their time) and checks what the core asks the shell to do, one rule per test."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from ipc import protocol as p
from models.camera import intrinsics_at
from models.synthetic import synthetic_geometry
from ranks.worker import completion
from runtime.clients import (
    BACKPRESSURE_RETRY_COLD_S,
    BACKPRESSURE_RETRY_MAX_S,
    BACKPRESSURE_RETRY_MIN_S,
    MAX_PEERS,
    backpressure_retry_s,
)
from runtime.config import LayoutConfig, MetricsConfig, SchedulerConfig, ServerConfig, StreamConfig, TimeoutsConfig
from runtime.core import CoordinatorCore
from runtime.core_types import (
    EXIT_FAILED,
    EXIT_OK,
    ClientSent,
    ClientUnreachable,
    ClientUnreadable,
    DecodeImage,
    DropTensors,
    EmitChunk,
    FramesMissing,
    ImageDecoded,
    ListSnapshots,
    ManifestRead,
    ManifestWritten,
    MemorySampled,
    Output,
    RankLost,
    ReadManifest,
    ShutdownRequested,
    SnapshotsListed,
    Stop,
    Tick,
    ToClient,
    ToWorker,
    WorkerSent,
    WriteManifest,
)
from runtime.images import DecodedImage
from runtime.memory_admission import MemoryAdmission
from runtime.placement import CONDITION_EDGE, LATENT_RECEIVER
from runtime.snapshots import SnapshotStore, read_manifest, write_manifest

A, B = b"client-a", b"client-b"
STAGE_OF_ROLE = {"condition": p.Stage.CONDITION, "denoise": p.Stage.DENOISE, "decode": p.Stage.DECODE}


def image(height: int = 160, width: int = 256) -> DecodedImage:
    return DecodedImage(bytes(height * width * 3), height, width)


class Job:
    """The core of the cpu-tiny layout (condition 0, decode 1, DiT 2-6) and everything around it: the clients'
    messages go in as events, the tasks it sends are answered the way the ranks answer them (the real
    ``ranks.worker.completion``; a broadcast's receivers and the latent receiver stay silent)."""

    def __init__(self, stream: dict[str, Any] | None = None, server: dict[str, Any] | None = None,
                 timeouts: dict[str, Any] | None = None, scheduler: dict[str, Any] | None = None,
                 model_max_chunks: int | None = None, observers: tuple[Any, ...] = ()) -> None:  # fmt: skip
        stream_config = StreamConfig(**(stream or {}))
        geometry = synthetic_geometry(stream_config.height, stream_config.width, stream_config.chunk_latent_frames)
        self.core = CoordinatorCore(
            LayoutConfig(), ServerConfig(**{"max_sessions": 4, **(server or {})}), stream_config,
            SchedulerConfig(**(scheduler or {})), TimeoutsConfig(**(timeouts or {})), MetricsConfig(warmup_chunks=0),
            dataclasses.replace(geometry, max_chunks=model_max_chunks), 0.0,
            new_id=(f"s{i}" for i in itertools.count()).__next__, observers=observers)
        self.now = 0.0
        self.tasks: list[tuple[bytes, p.WorkerTask]] = []  # sent, not yet answered
        self.log: list[Output] = []
        self.req = itertools.count(1)

    # ---- driving

    def step(self, *events: Any, dt: float = 0.001) -> list[Output]:
        self.now += dt
        out = self.core.step(events, self.now)
        self.log += out
        self.tasks += [(o.identity, o.message) for o in out if isinstance(o, ToWorker)
                       and not isinstance(o.message, p.Ping)]
        direct = list(out)  # the shell's answers to these; the steps they make answer their own
        for read in [o for o in direct if isinstance(o, ReadManifest)]:  # as the shell does, off its loop
            out += self.step(ManifestRead(read.ticket, *read_manifest(self.core.saving.store, read.snapshot)), dt=0.0)
        for write in [o for o in direct if isinstance(o, WriteManifest)]:
            out += self.step(ManifestWritten(write.manifest.id, write_manifest(self.core.saving.store, write.manifest)),
                             dt=0.0)
        for listing in [o for o in direct if isinstance(o, ListSnapshots)]:
            out += self.step(SnapshotsListed(listing.written, tuple(self.core.saving.store.listing())), dt=0.0)
        return out

    def use(self, store: SnapshotStore) -> None:
        """Save to and restore from ``store`` (a test's own folder)."""
        self.core.saving.store = store

    def send(self, who: bytes, message: p.ClientMessage) -> list[Output]:
        return self.step(ClientSent(who, message))

    def open(self, who: bytes = A, img: DecodedImage | None = None, ready: bool = True, **fields: Any) -> str:
        out = self.send(who, p.Open(req=next(self.req), image=b"png", **{"num_chunks": 4, **fields}))
        (decode,) = [o for o in out if isinstance(o, DecodeImage)]
        self.step(ImageDecoded(decode.ticket, img or image()))
        sid = list(self.core.sessions)[-1]
        while ready and not [o for o in self.to(who, p.Opened) if o.session == sid]:
            inits = [t for _, t in self.tasks if isinstance(t, p.InitCondition | p.InitDecode | p.BroadcastContext
                                                            | p.InitDenoise)]
            if not inits:  # a role is busy with another session's chunk: let it move on
                inits = [t for _, t in self.tasks]
            assert inits, "the session cannot become ready"
            self.answer(type(inits[0]), inits[0].session, getattr(inits[0], "index", None))
        return sid

    def answer(self, kind: type, session: str | None = None, index: int | None = None,
               ranks: Iterable[int] | None = None, fail: str = "", fatal: bool = False) -> list[Output]:
        """Answer the pending tasks of ``kind`` (of ``session``/``index``, on ``ranks``) as their ranks would."""
        out: list[Output] = []
        for who, task in list(self.tasks):
            rank, role = who.decode().split(":")
            if not isinstance(task, kind) or (session is not None and task.session != session) or (
                    index is not None and getattr(task, "index", None) != index) or (
                    ranks is not None and int(rank) not in ranks):
                continue
            self.tasks.remove((who, task))
            silent = role == LATENT_RECEIVER or (role == CONDITION_EDGE and rank != "0")
            if fail or fatal:
                done: Any = p.TaskFailed(rank=int(rank), role=role, session=task.session, phase=task.phase,
                                         stage=STAGE_OF_ROLE.get(role), index=getattr(task, "index", -1),
                                         error=fail or "boom", fatal=fatal)
            elif silent:
                continue
            else:
                spans = [p.WorkerSpan(role if role in STAGE_OF_ROLE else "transfer:x", self.now, self.now + 0.0005)]
                done = completion(task, STAGE_OF_ROLE.get(role), int(rank), role, spans)
            out += self.step(WorkerSent(done))
        return out

    def settle(self, *kinds: type, limit: int = 200) -> None:
        """Answer tasks of ``kinds`` until none is pending."""
        for _ in range(limit):
            pending = [task for _, task in self.tasks if isinstance(task, kinds)]
            if not pending:
                return
            self.answer(type(pending[0]), pending[0].session, getattr(pending[0], "index", None))
        raise AssertionError("did not settle")

    def play(self, sessions: dict[bytes, str], chunks: int, limit: int = 2000) -> None:
        """Send each session's controls as soon as they can be accepted and answer every task in order, until
        every session closed."""
        sched = self.core.scheduler
        for _ in range(limit):
            for who, sid in sessions.items():
                if sid in self.core.sessions and sched.session_state(sid).value == "ready":
                    index = sched.next_control_index(sid)
                    if index < chunks and sched.can_submit(sid, index):
                        control(self, sid, index, who=who)
            if not self.tasks:
                return
            _, task = self.tasks[0]
            self.answer(type(task), task.session, getattr(task, "index", None))
        raise AssertionError("did not settle")

    def chunk(self, session: str, index: int) -> list[Output]:
        """Run chunk ``index`` of ``session`` from its encoded condition to its emission."""
        self.answer(p.ConditionChunk, session, index)
        self.answer(p.DenoiseChunk, session, index)
        self.answer(p.DecodeChunk, session, index)
        return self.answer(p.ReceiveFrames, session, index)

    # ---- reading

    def to(self, who: bytes, kind: type, out: Iterable[Output] | None = None) -> list[Any]:
        return [o.message for o in (self.log if out is None else out)
                if isinstance(o, ToClient) and o.identity == who and isinstance(o.message, kind)]

    def sent(self, kind: type, out: Iterable[Output] | None = None) -> list[tuple[bytes, Any]]:
        return [(o.identity, o.message) for o in (self.log if out is None else out)
                if isinstance(o, ToWorker) and isinstance(o.message, kind)]

    def emitted(self, session: str) -> list[EmitChunk]:
        return [o for o in self.log if isinstance(o, EmitChunk) and o.session == session]


def control(job: Job, sid: str, index: int, who: bytes = A, **fields: Any) -> list[Output]:
    return job.send(who, p.Control(req=next(job.req), session=sid, index=index, control=p.ChunkControl(**fields)))


def errors(job: Job, who: bytes, out: Iterable[Output] | None = None) -> list[str]:
    return [e.code for e in job.to(who, p.Error, out)]


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


def test_a_stage_failure_fails_only_its_session_and_releases_its_caches() -> None:
    job = Job()
    bad, good = job.open(A), job.open(B)
    for sid, who in ((bad, A), (good, B)):
        control(job, sid, 0, who=who)
    job.answer(p.ConditionChunk, bad, 0)
    job.answer(p.DenoiseChunk, bad, 0)
    out = job.answer(p.DecodeChunk, bad, 0, fail="ValueError: latent is not finite")
    (failed,) = job.to(A, p.Error, out)
    assert failed.code == "failed" and "decode chunk: ValueError: latent is not finite" in failed.message
    job.settle(p.ReceiveFrames, p.Release, p.ConditionChunk, p.BroadcastCondition)
    (closed,) = job.to(A, p.Closed)
    assert closed.reason == "failed" and "not finite" in closed.error
    assert not job.emitted(bad)  # the frames of the failed chunk never leave
    job.chunk(good, 0)
    assert [e.facts.index for e in job.emitted(good)] == [0] and not job.to(B, p.Error)


def test_a_failed_init_fails_the_session() -> None:
    job = Job()
    job.open(ready=False)
    out = job.answer(p.InitCondition, fail="RuntimeError: out of memory")
    assert errors(job, A, out) == ["failed"]
    job.settle(p.Release)
    assert [c.reason for c in job.to(A, p.Closed)] == ["failed"]


def test_a_failed_release_on_one_dit_rank_is_retried_on_every_rank_and_poisons_the_session() -> None:
    job = Job()
    sid = job.open(num_chunks=None)
    job.send(A, p.Close(req=1, session=sid))
    job.settle(p.ConditionChunk, p.BroadcastCondition)
    job.answer(p.Release, sid)  # decode
    job.answer(p.Release, sid, ranks=[4], fail="RuntimeError: cuda error")
    retried = [w for w, _ in job.sent(p.Release) if w.endswith(b":denoise")]
    assert sorted(retried) == sorted([f"{r}:denoise".encode() for r in range(2, 7)] * 2)  # again on every rank
    job.settle(p.Release)
    (closed,) = job.to(A, p.Closed)
    assert closed.summary.poisoned and closed.summary.leaked_caches == []
    assert sorted(closed.summary.released["denoise"]) == [2, 3, 4, 5, 6]


def test_a_fatal_failure_ends_the_job_and_tells_every_client() -> None:
    job = Job()
    sid = job.open(A)
    job.send(B, p.Stats(req=1))  # a client without a session hears of it too
    job.answer(p.ConditionChunk, sid, 0)
    control(job, sid, 0)
    out = job.answer(p.DenoiseChunk, sid, 0, ranks=[4], fail="denoise of s0/0 on a 5-rank DiT group", fatal=True)
    assert [(e.code, e.session) for e in job.to(A, p.Error, out)] == [("rank_failed", sid)]
    assert errors(job, B, out) == ["rank_failed"] and "rank 4 denoise" in job.to(B, p.Error, out)[0].message
    assert out[-1] == Stop(EXIT_FAILED, "rank 4 denoise: denoise of s0/0 on a 5-rank DiT group")
    assert job.step(Tick()) == []  # stopped: nothing more


def test_a_failed_rank_reaches_each_session_of_a_client_however_many_other_clients_were_heard() -> None:
    job = Job()
    first, second = job.open(A), job.open(A)
    for n in range(MAX_PEERS + 10):  # more identities than are remembered beside the sessions' owners
        job.step(ClientUnreadable(f"peer-{n}".encode(), "not a msgpack message"), dt=0.0001)
    out = job.step(RankLost("rank 3 is unreachable (its denoise worker disconnected)"))
    assert [(e.code, e.session) for e in job.to(A, p.Error, out)] == [("rank_failed", first), ("rank_failed", second)]
    assert errors(job, f"peer-{MAX_PEERS + 9}".encode(), out) == ["rank_failed"]  # and the latest of the others


def test_a_silent_rank_ends_the_job_while_beating_ranks_keep_it_alive() -> None:
    job = Job(timeouts={"rank_dead_s": 5.0, "heartbeat_s": 1.0})
    for _ in range(5):
        beats = [WorkerSent(p.Beat(rank=r, seq=0, echo=job.now, received=job.now, sent=job.now))
                 for r in range(1, 7) if r != 3]
        assert not [o for o in job.step(*beats, Tick(), dt=1.0) if isinstance(o, Stop)]
    (stop,) = [o for o in job.step(Tick(), dt=1.0) if isinstance(o, Stop)]
    assert stop.code == EXIT_FAILED and stop.reason.startswith("rank 3 stopped answering")


def test_a_task_past_its_deadline_ends_the_job_naming_the_rank() -> None:
    job = Job(timeouts={"stage_s": 10.0, "rank_dead_s": 1e9})
    sid = job.open()
    assert not [o for o in job.step(Tick(), dt=9.0) if isinstance(o, Stop)]
    (stop,) = [o for o in job.step(Tick(), dt=2.0) if isinstance(o, Stop)]
    assert stop.reason == f"rank 0 did not finish the condition of chunk 0 of session {sid} within 10 s"


def test_a_lost_rank_ends_the_job() -> None:
    job = Job()
    job.open()
    out = job.step(RankLost("rank 3 is unreachable (its denoise worker disconnected)"))
    assert errors(job, A, out) == ["rank_failed"] and isinstance(out[-1], Stop) and out[-1].code == EXIT_FAILED


def test_missing_frames_fail_their_session() -> None:
    job = Job()
    sid = job.open()
    control(job, sid, 0)
    job.chunk(sid, 0)
    out = job.step(FramesMissing(sid, 0, "no tensor within 1 s"))
    assert errors(job, A, out) == ["failed"] and "never reached rank 0" in job.to(A, p.Error, out)[0].message


def test_an_internal_error_costs_only_the_session_it_concerns() -> None:
    job = Job()
    bad, good = job.open(A), job.open(B)
    job.core.sessions[bad].controls = None  # type: ignore[assignment]  # a bug in the core's bookkeeping
    out = control(job, bad, 0)
    assert errors(job, A, out) == ["internal", "failed"]
    assert job.to(B, p.Accepted, control(job, good, 0, who=B))


# ---- clients away


def test_a_client_gone_keeps_its_session_until_it_resumes_with_the_same_identity() -> None:
    job = Job()
    sid = job.open(A, num_chunks=None)
    control(job, sid, 0)
    job.step(ClientUnreachable(A, sid, "gone"))
    job.chunk(sid, 0)
    assert [e.to for e in job.emitted(sid)] == [None]  # produced meanwhile, dropped
    assert errors(job, B, job.send(B, p.Heartbeat(req=1, session=sid))) == ["unknown_session"]
    reconnected = b"client-a"  # the same identity, a new connection
    assert job.to(reconnected, p.HeartbeatAck, job.send(reconnected, p.Heartbeat(req=2, session=sid)))
    control(job, sid, 1)
    job.chunk(sid, 1)
    assert [e.to for e in job.emitted(sid)] == [None, A]


def test_a_client_that_stops_reading_is_closed_at_once() -> None:
    job = Job()
    sid = job.open(A, num_chunks=None)
    job.step(ClientUnreachable(A, sid, "full"))
    job.settle(p.ConditionChunk, p.BroadcastCondition, p.Release)
    assert sid not in job.core.sessions and not job.to(A, p.Closed)  # nothing more is sent to it


def test_a_silent_client_has_its_session_closed_after_the_client_timeout() -> None:
    job = Job(server={"client_timeout_s": 2.0}, timeouts={"rank_dead_s": 1e9})
    quiet, chatty = job.open(A, num_chunks=None), job.open(B, num_chunks=None)
    job.step(Tick(), dt=1.5)
    job.send(B, p.Heartbeat(req=1))
    job.step(Tick(), dt=1.0)
    job.settle(p.ConditionChunk, p.BroadcastCondition, p.Release)
    assert [c.reason for c in job.to(A, p.Closed)] == ["disconnect"]
    assert quiet not in job.core.sessions and chatty in job.core.sessions


# ---- two sessions, stats, shutdown


def test_two_sessions_share_the_ranks_and_each_gets_its_chunks_in_order() -> None:
    job = Job()
    sids = {A: job.open(A), B: job.open(B)}
    job.play(sids, chunks=4)
    for who, sid in sids.items():
        assert [(e.facts.index, e.to) for e in job.emitted(sid)] == [(i, who) for i in range(4)]
        assert [c.reason for c in job.to(who, p.Closed)] == ["complete"]
    denoised = [t.session for who, t in job.sent(p.DenoiseChunk) if who == b"2:denoise"]
    assert denoised.index(sids[B]) < len(denoised) - 1 - denoised[::-1].index(sids[A])  # interleaved on the DiT


class Recorder:
    """A metrics observer that writes down every event it hears (``runtime.metrics.MetricsObserver``)."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def on_open(self, session: str, now: float) -> None:
        self.events.append(("open", session))

    def on_chunk(self, session: str, facts: p.ChunkFacts, memory: Any) -> None:
        self.events.append(("chunk", session, facts))

    def on_idle(self, start: float, end: float, cause: str, blocked: tuple[tuple[str, str], ...]) -> None:
        self.events.append(("idle", cause, blocked))

    def on_reject(self, reason: str) -> None:
        self.events.append(("reject", reason))

    def on_error(self, kind: str) -> None:
        self.events.append(("error", kind))

    def on_close(self, session: str, now: float) -> None:
        self.events.append(("close", session))

    def on_gauges(self, open_sessions: int, memory: Any) -> None:
        self.events.append(("gauges", open_sessions))


def test_every_metrics_observer_hears_each_event_once_as_the_server_metrics_do() -> None:
    recorder = Recorder()
    job = Job(observers=(recorder,))
    sid = job.open(num_chunks=2)
    job.send(A, p.Control(req=next(job.req), session="nope", index=0))  # refused: unknown session
    job.play({A: sid}, chunks=2)
    job.step(Tick(), dt=job.core.timeouts.heartbeat_s)
    kinds = [e[0] for e in recorder.events]
    assert kinds.count("open") == 1 and kinds.count("close") == 1 and kinds.index("open") < kinds.index("close")
    chunks = [e[2] for e in recorder.events if e[0] == "chunk"]
    assert chunks == [e.facts for e in job.emitted(sid)]  # the very facts the client got, each once
    assert kinds.index("close") > max(i for i, k in enumerate(kinds) if k == "chunk")
    assert [e[1] for e in recorder.events if e[0] == "reject"] == list(job.core.server_metrics.rejects.counts)
    idle = [e for e in recorder.events if e[0] == "idle"]
    server = job.core.server_metrics
    assert len(idle) == sum(server.idle.count.values()) > 0 and ("gauges", 0) in recorder.events
    assert server.chunks_emitted == len(chunks) and server.sessions_total == 1 and not server.sessions


def test_stats_report_sessions_ranks_and_the_layout() -> None:
    job = Job()
    job.open()
    job.step(MemorySampled(0, 10, 20, 0), WorkerSent(p.Beat(rank=3, seq=0, echo=0.0, received=0.0, sent=0.0,
                                                              rss=5)))
    (reply,) = job.to(B, p.StatsReply, job.send(B, p.Stats(req=9)))
    assert reply.req == 9 and reply.stats.open_sessions == 1 and reply.stats.layout == "cpu-tiny"
    assert reply.stats.ranks["0"].peak_rss == 20 and reply.stats.ranks["3"].rss == 5


def test_pings_go_to_every_rank_but_the_coordinators_once_per_heartbeat_period() -> None:
    job = Job(timeouts={"heartbeat_s": 1.0})
    out = job.step(Tick())
    assert sorted(w for w, _ in job.sent(p.Ping, out)) == [f"{r}:heartbeat".encode() for r in range(1, 7)]
    assert not job.sent(p.Ping, job.step(Tick(), dt=0.5))
    assert job.sent(p.Ping, job.step(Tick(), dt=0.6))


def test_an_unreadable_message_gets_bad_message_with_its_request_id() -> None:
    job = Job()
    out = job.step(ClientUnreadable(A, "invalid 'control' message: unknown keys ['q']", req=4))
    (error,) = job.to(A, p.Error, out)
    assert (error.code, error.req) == ("bad_message", 4)
    assert job.core.server_metrics.rejects.counts == {"bad_message": 1}


@pytest.mark.parametrize(("lost", "code"), [((), "shutdown"), ((3,), "rank_failed")])
def test_shutdown_tells_every_client_and_closes_every_session(lost: tuple[int, ...], code: str) -> None:
    job = Job()
    sid = job.open(A)
    job.send(B, p.Stats(req=1))
    out = job.step(ShutdownRequested(lost))
    assert errors(job, A, out) == errors(job, B, out) == [code]
    (closed,) = job.to(A, p.Closed, out)
    assert (closed.session, closed.reason) == (sid, "shutdown") and closed.summary.session == sid
    assert out[-1].code == EXIT_OK and (not lost or "rank 3 is gone" in out[-1].reason)


# ---- closing twice, privacy


def test_a_second_close_while_the_first_drains_is_answered_closing_and_the_session_closes_once() -> None:
    job = Job()
    sid = job.open()
    control(job, sid, 0)
    job.send(A, p.Close(req=50, session=sid))
    out = job.send(A, p.Close(req=51, session=sid))
    assert [(e.req, e.code) for e in job.to(A, p.Error, out)] == [(51, "closing")]
    job.settle(p.ConditionChunk, p.DenoiseChunk, p.DecodeChunk, p.ReceiveFrames, p.Release)
    assert [c.session for c in job.to(A, p.Closed)] == [sid]
    out = job.send(A, p.Close(req=52, session=sid))
    assert [(e.req, e.code) for e in job.to(A, p.Error, out)] == [(52, "unknown_session")]


def test_stats_show_a_client_its_own_sessions_and_operators_all_of_them() -> None:
    job = Job()
    mine, theirs = job.open(A), job.open(B)
    out = job.send(A, p.Stats(req=60))
    (reply,) = job.to(A, p.StatsReply, out)
    assert list(reply.stats.per_session) == [mine] and reply.stats.open_sessions == 2
    assert theirs.encode() not in p.encode(reply)
    assert set(job.core.stats(job.now).per_session) == {mine, theirs}  # no client: the operator's view


def test_a_session_gets_the_camera_its_open_asks_for_or_the_servers_and_the_reply_says_which() -> None:
    job = Job()
    wide, narrow = (415.5, 415.7, 415.8, 239.8), (520.0, 520.0, 416.0, 240.0)
    job.core.intrinsics = wide  # the server's controls.intrinsics
    own = job.open(A, intrinsics=narrow)
    default = job.open(B)
    sent = {t.session: t.intrinsics for _, t in job.sent(p.InitDenoise)}
    assert sent == {own: narrow, default: wide}  # every DiT rank opens the session with its camera
    for who, sid, camera in ((A, own, narrow), (B, default, wide)):
        (opened,) = [o for o in job.to(who, p.Opened) if o.session == sid]
        assert opened.intrinsics == intrinsics_at(camera, opened.height, opened.width)  # at the session's frame
        assert opened.intrinsics != camera or (opened.height, opened.width) == (480, 832)


def test_a_sessions_steps_reach_every_dit_rank_and_a_controls_change_is_receipted_from_its_chunk() -> None:
    job = Job()
    sid = job.open(steps=2, num_chunks=4)
    assert job.to(A, p.Opened)[-1].steps == 2
    for index, steps in enumerate((None, None, 1)):
        job.send(A, p.Control(req=next(job.req), session=sid, index=index, steps=steps))
        job.chunk(sid, index)
    per_chunk = {(t.index, t.steps) for _, t in job.sent(p.DenoiseChunk)}
    assert per_chunk == {(0, 2), (1, 2), (2, 1)}  # every DiT rank runs what rank 0 chose for the chunk
    facts = [e.facts for e in job.emitted(sid)]
    assert [(f.steps, f.steps_changed) for f in facts] == [(2, None), (2, None), (1, "client")]
    (mine,) = job.core.stats(job.now, A).capacity.sessions.values()
    assert (mine.steps, mine.want_steps, mine.steps_changed) == (1, 1, "client")


def test_a_live_sessions_steps_change_from_the_next_chunk_cut() -> None:
    job = Job()
    sid = job.open(live=True, num_chunks=None)  # chunk 0 is cut at once, at the default 4 steps
    job.send(A, p.ControlState(req=1, session=sid, keys=["w"], revision=1, steps=1))
    job.answer(p.ConditionChunk, sid, 0)
    job.answer(p.ConditionChunk, sid, 1)
    job.answer(p.DenoiseChunk, sid, 0)  # chunk 1 is cut now, with the new steps
    assert sorted({(t.index, t.steps) for _, t in job.sent(p.DenoiseChunk)}) == [(0, 4), (1, 1)]


def test_an_open_real_time_cannot_hold_is_refused_busy_with_the_models_reason_after_others_step_down() -> None:
    job = Job()
    job.core.admitting.memory = MemoryAdmission(lambda height, width: {2: 1}, {})  # each session holds a byte on rank 2
    first = job.open(num_chunks=None)
    for stage, seconds in (("condition", 0.02), ("denoise", 0.32), ("decode", 0.03)):  # as if measured: 4 steps
        job.core.admitting.capacity.times.add(stage, 4, (160, 256), seconds)
    C, D = b"client-c", b"client-d"
    second = job.open(B, num_chunks=None)  # 2 x 0.32 s holds 0.75 s of media with the 10 % margin
    third = job.open(C, num_chunks=None)  # 3 x 0.32 s does not: the newest steps down (1 step), then the second (2)
    seats = job.core.admitting.capacity.seats
    assert {sid: seats[sid].steps for sid in (first, second, third)} == {first: 4, second: 2, third: 1}
    assert job.to(C, p.Opened)[-1].steps == 1
    out = job.send(D, p.Open(req=99, image=b"png", num_chunks=4, min_steps=4))  # the others at 1 step: 0.704 s
    (decode,) = [o for o in out if isinstance(o, DecodeImage)]
    (error,) = job.to(D, p.Error, job.step(ImageDecoded(decode.ticket, image())))
    assert error.code == "busy" and error.req == 99 and "real time cannot hold for 4 sessions" in error.message
    assert error.retry_after_s == 5.0  # no session ends by itself: the default hint
    assert len(job.core.sessions) == 3 and set(job.core.admitting.capacity.seats) == {first, second, third}
    assert set(job.core.admitting.memory.admitted) == {first, second, third}  # the refused open holds no bytes


def test_the_core_imports_without_torch() -> None:
    """Rank 0's rules plan with shapes and never build a tensor: a tool or a router host without torch can load them."""
    blocked = ("import sys; sys.modules['torch'] = None; import runtime.core, runtime.router; "
               "assert 'torch' not in [m for m, v in sys.modules.items() if v is not None]")
    done = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
