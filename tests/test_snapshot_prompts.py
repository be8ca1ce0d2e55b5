"""Snapshots and prompt changes (and steps) together in the coordinator core, without processes: a save keeps the
text its boundary chunk uses, a restore continues that revision and the saved steps setting, and a prompt encoded
while a save captures starts after the boundary. Harness: ``tests.core_job``'s 7-rank job."""

from __future__ import annotations

from pathlib import Path

from ipc import protocol as p
from runtime.core_types import WorkerSent
from runtime.snapshots import Manifest, SnapshotStore
from tests.core_job import A, Job, control
from tests.test_prompt_core import denoised_revisions, emitted_revisions, run_chunk, scheduled, set_prompt
from tests.test_snapshots import PARTS, written


def finish_save(job: Job, tmp_path: Path) -> Manifest:
    """Every rank captures and writes its file: the manifest on disk."""
    task = job.sent(p.SaveState)[-1][1]
    job.answer(p.SaveState)
    for rank, role in sorted(PARTS):
        job.step(WorkerSent(written(job, task, rank, role)))
    return SnapshotStore(tmp_path).read(task.snapshot)


def test_a_save_after_a_prompt_change_keeps_that_text_and_its_restore_continues_its_revision(tmp_path: Path) -> None:
    job = Job()
    job.use(SnapshotStore(tmp_path))
    sid = job.open(num_chunks=8, prompt="a green valley")
    run_chunk(job, sid, 0)
    req = set_prompt(job, sid, "a desert at dusk")
    job.answer(p.EncodePrompt, sid)
    assert scheduled(job, req).chunk == 1  # type: ignore[union-attr]
    run_chunk(job, sid, 1)
    job.send(A, p.Save(req=40, session=sid))
    (task,) = {t for _, t in job.sent(p.SaveState)}
    assert (task.chunk, task.prompt_revision) == (2, 1)  # the condition rank saves revision 1's context
    saved = finish_save(job, tmp_path)
    assert (saved.prompt, saved.prompt_revision, saved.chunk) == ("a desert at dusk", 1, 2)

    job = Job()  # another server sharing the folder
    job.use(SnapshotStore(tmp_path))
    job.send(A, p.Open(req=41, image=b"", restore=saved.id))
    restored = list(job.core.sessions)[-1]
    job.settle(p.InitCondition, p.InitDecode, p.BroadcastContext, p.InitDenoise)
    assert {t.prompt_revision for _, t in job.sent(p.InitDenoise) if t.session == restored} == {1}
    assert job.core.sessions[restored].prompt == "a desert at dusk"
    run_chunk(job, restored, 2)
    assert denoised_revisions(job, restored) == {2: {1}} and emitted_revisions(job, restored) == [1]
    req = set_prompt(job, restored, "snow")
    job.answer(p.EncodePrompt, restored)
    reply = scheduled(job, req)
    assert reply is not None and (reply.revision, reply.chunk) == (2, 3)  # its revisions continue the snapshot's
    assert [t.index for _, t in job.sent(p.EncodePrompt) if t.session == restored] == [p.context_index(2)]


def test_a_prompt_encoded_while_a_save_captures_starts_after_the_boundary_chunk(tmp_path: Path) -> None:
    job = Job()
    job.use(SnapshotStore(tmp_path))
    sid = job.open(num_chunks=8, prompt="a green valley")
    run_chunk(job, sid, 0)
    run_chunk(job, sid, 1)
    job.send(A, p.Save(req=40, session=sid))
    (task,) = {t for _, t in job.sent(p.SaveState)}  # out at once: the boundary is chunk 2, the text revision 0
    assert (task.chunk, task.prompt_revision) == (2, 0)
    req = set_prompt(job, sid, "a desert at dusk")
    job.answer(p.EncodePrompt, sid)  # encoded before chunk 2 was dispatched: without the pin chunk 2 would take it
    assert scheduled(job, req) is None
    job.answer(p.ConditionChunk, sid, 2)
    control(job, sid, 2)
    reply = scheduled(job, req)
    assert reply is not None and (reply.revision, reply.chunk) == (1, 3)
    job.chunk(sid, 2)
    run_chunk(job, sid, 3)
    assert denoised_revisions(job, sid)[2] == {0} and denoised_revisions(job, sid)[3] == {1}
    saved = finish_save(job, tmp_path)
    assert (saved.prompt, saved.prompt_revision) == ("a green valley", 0)


def test_a_restore_keeps_the_saved_sessions_steps_setting_and_floor(tmp_path: Path) -> None:
    job = Job()
    job.use(SnapshotStore(tmp_path))
    sid = job.open(num_chunks=8, steps=2, min_steps=2)
    run_chunk(job, sid, 0)
    job.send(A, p.Control(req=next(job.req), session=sid, index=1, control=p.ChunkControl(), steps=4))
    job.answer(p.ConditionChunk, sid, 1)
    job.chunk(sid, 1)
    seat = job.core.admitting.capacity.seats[sid]
    job.send(A, p.Save(req=40, session=sid))
    saved = finish_save(job, tmp_path)
    assert (saved.steps, saved.want, saved.floor) == (4, seat.want, seat.floor) == (4, 4, 2)
    job = Job()
    job.use(SnapshotStore(tmp_path))
    job.send(A, p.Open(req=41, image=b"", restore=saved.id))
    restored = list(job.core.sessions)[-1]
    again = job.core.admitting.capacity.seats[restored]
    assert (again.want, again.floor, again.steps) == (4, 2, 4)


def test_a_live_sessions_snapshots_cut_before_its_save_are_applied_as_they_were_after_its_restore(
        tmp_path: Path) -> None:  # fmt: skip
    job = Job()
    job.use(SnapshotStore(tmp_path))
    sid = job.open(num_chunks=8, live=True)
    job.send(A, p.ControlState(req=next(job.req), session=sid, keys=["w"], revision=1))
    job.answer(p.ConditionChunk, sid, 0)
    job.send(A, p.ControlState(req=next(job.req), session=sid, keys=["w"], taps=["i"], mouse=(3.0, -1.0), revision=2))
    job.answer(p.DenoiseChunk, sid, 0)  # chunk 1's snapshot is cut now, before the DiT needs it
    cut = job.core.sessions[sid].controls[1]
    assert cut.mouse == (3.0, -1.0) and cut.keys == {"w", "i"}
    job.send(A, p.Save(req=40, session=sid))
    saved = finish_save(job, tmp_path)
    assert saved.chunk == 1 and saved.live is not None and saved.live.cut == (cut,)
    job = Job()
    job.use(SnapshotStore(tmp_path))
    job.send(A, p.Open(req=41, image=b"", restore=saved.id))
    restored = list(job.core.sessions)[-1]
    job.settle(p.InitCondition, p.InitDecode, p.BroadcastContext, p.InitDenoise)
    job.answer(p.ConditionChunk, restored, 1)
    job.step()
    ((_, denoise),) = [(w, t) for w, t in job.sent(p.DenoiseChunk) if t.session == restored][:1]
    assert (denoise.index, denoise.control) == (1, cut)  # its taps and motion, not just the held keys
