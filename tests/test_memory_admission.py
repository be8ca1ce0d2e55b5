"""Memory-aware admission in the coordinator core, without processes: a session opens only if every rank has room
for what the memory model says it costs at the session's frame size; the bytes come back when it closes."""

from __future__ import annotations

from collections.abc import Iterable

from ipc import protocol as p
from runtime.core_types import DecodeImage, ImageDecoded, Output, WorkerSent
from runtime.images import DecodedImage
from runtime.memory_admission import MemoryAdmission
from tests.core_job import A, B, Job, control, image

ROOMS = {0: 1000, 1: 1000, 2: 100, 3: 100, 4: 100, 5: 100, 6: 100}


def cost(height: int, width: int) -> dict[int, int]:
    """Bytes per rank: 10 on ranks 0 and 1; on each DiT rank 40 for frames up to 256 wide, 70 for wider ones."""
    return {0: 10, 1: 10, **{r: 40 if width <= 256 else 70 for r in range(2, 7)}}


def memory_job(rooms: dict[int, int] = ROOMS, **kw: object) -> Job:
    job = Job(**kw)  # type: ignore[arg-type]
    job.core.admitting.memory = MemoryAdmission(cost, dict(rooms))
    return job


def ask(job: Job, who: bytes, img: DecodedImage | None = None, req: int = 7) -> list[Output]:
    """An open whose image decodes at once; what the core answered."""
    out: Iterable[Output] = job.send(who, p.Open(req=req, image=b"png"))
    return job.step(*[ImageDecoded(o.ticket, img or image()) for o in out if isinstance(o, DecodeImage)])


def test_a_session_that_does_not_fit_on_a_rank_is_busy_naming_the_rank_the_bytes_needed_and_free() -> None:
    job = memory_job()
    first, second = job.open(A), job.open(A)
    (refused,) = job.to(B, p.Error, ask(job, B))  # the count limit (4) is not reached: the bytes refuse it
    assert refused.code == "busy" and refused.req == 7 and refused.retry_after_s
    assert "rank 2 " in refused.message and "needs 40 bytes" in refused.message
    assert "has 20 bytes" in refused.message and "retry" in refused.message
    assert set(job.core.sessions) == {first, second}


def test_closing_a_session_gives_its_bytes_back_and_a_new_one_fits() -> None:
    job = memory_job()
    first = job.open(A, num_chunks=None)
    job.open(B, num_chunks=None)
    assert job.to(A, p.Error, ask(job, A))
    job.send(A, p.Close(req=1, session=first))
    job.settle(p.ConditionChunk, p.BroadcastCondition, p.Release)
    assert first not in job.core.sessions
    assert not job.to(A, p.Error, ask(job, A, req=8))
    assert len(job.core.sessions) == 2


def test_the_cost_follows_the_frame_size_of_each_session() -> None:
    job = memory_job(stream={"size": "image", "height": 160, "width": 256,
                             "sizes": [[160, 256], [96, 400], [256, 160]]})  # the sizes a session may get
    job.open(A, img=image(160, 256))  # 40 on each DiT rank: 60 left
    (refused,) = job.to(B, p.Error, ask(job, B, image(100, 400)))  # streams at 96x400: 70
    assert refused.code == "busy" and "96x400" in refused.message and "needs 70 bytes" in refused.message
    assert not job.to(B, p.Error, ask(job, B, image(256, 160), req=8))  # 256x160: 40 fits
    assert len(job.core.sessions) == 2


def test_a_failed_session_gives_its_bytes_back() -> None:
    job = memory_job(rooms={**ROOMS, 3: 40})  # one session at a time on rank 3
    bad = job.open(A)
    control(job, bad, 0)
    job.answer(p.ConditionChunk, bad, 0)
    job.answer(p.DenoiseChunk, bad, 0, fail="SessionInputError: rank 3 could not prepare the chunk: "
                                             "OutOfMemoryError: CUDA out of memory")
    job.settle(p.ReceiveFrames, p.Release, p.ConditionChunk, p.BroadcastCondition, p.DecodeChunk)
    assert bad not in job.core.sessions
    assert not job.to(B, p.Error, ask(job, B))


def test_ranks_without_a_limit_never_refuse_and_a_beat_updates_a_room() -> None:
    job = memory_job(rooms={})
    for _ in range(4):
        job.open(A)
    assert len(job.core.sessions) == 4
    job = memory_job()
    job.step(WorkerSent(p.Beat(rank=4, seq=0, echo=0.0, received=0.0, sent=0.0, room=30, cache_bytes=7)))
    (refused,) = job.to(A, p.Error, ask(job, A))
    assert refused.code == "busy" and "rank 4 " in refused.message and "has 30 bytes" in refused.message


def test_stats_show_each_ranks_session_bytes_and_free_bytes() -> None:
    job = memory_job()
    job.open(A)
    job.step(WorkerSent(p.Beat(rank=3, seq=0, echo=0.0, received=0.0, sent=0.0, room=100, cache_bytes=38)))
    (reply,) = job.to(B, p.StatsReply, job.send(B, p.Stats(req=9)))
    ranks = reply.stats.ranks
    assert ranks["3"].session_bytes == 40 and ranks["3"].free_bytes == 60
    assert ranks["3"].measured_session_bytes == 38 and ranks["3"].room_bytes == 100
    assert ranks["0"].session_bytes == 10 and ranks["0"].free_bytes == 990


def test_an_oom_while_one_dit_rank_opens_the_caches_answers_the_open_and_gives_the_bytes_back() -> None:
    job = memory_job(rooms={**ROOMS, 3: 40})
    job.open(A, ready=False)
    job.settle(p.InitCondition, p.BroadcastContext, p.InitDecode)
    out = job.answer(p.InitDenoise, ranks=[3], fail="OutOfMemoryError: CUDA out of memory")
    (failed,) = job.to(A, p.Error, out)
    assert failed.code == "failed" and "OutOfMemoryError" in failed.message
    assert failed.req == 1 and failed.session is None  # the open's answer: its client never learnt the session
    job.settle(p.InitDenoise, p.Release)
    assert not job.core.sessions and not job.to(B, p.Error, ask(job, B))


def test_a_size_that_cannot_hold_one_session_is_named_at_start_with_the_rank_short_of_room() -> None:
    admission = MemoryAdmission(cost, {**ROOMS, 4: 60})  # rank 4 holds a 40-byte session, not a 70-byte one
    (reason,) = admission.unservable([(160, 256), (96, 400)])
    assert reason.startswith("no 96x400 session can open") and "rank 4 " in reason and "needs 70 bytes" in reason
    assert not MemoryAdmission(cost, dict(ROOMS)).unservable([(160, 256), (96, 400)])
    assert not MemoryAdmission(None, {2: 0}).unservable([(160, 256)])  # no memory model: nothing to say
