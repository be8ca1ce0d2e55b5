"""A failed save and its writers (issue 33, points 3 and 4): a writer thread survives any error of one save and answers
for it; the failed save's folder is deleted once every writer is done with it, however many saves failed meanwhile;
the bookkeeping (``runtime.late_writes``) as a state machine with ``now`` passed in."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import torch
import zmq

from ipc import protocol as p
from ipc.protocol import Stage
from runtime.core_types import DropSnapshotFiles, WorkerSent
from runtime.late_writes import LateWrites
from runtime.snapshots import file_name, new_snapshot_id
from tests.core_job import A, Job, control
from tests.test_snapshots import PARTS, save_job, written


def drops(out: list) -> list[str]:
    return [o.snapshot for o in out if isinstance(o, DropSnapshotFiles)]


# ---- the writer thread


def test_a_writer_answers_a_save_safetensors_cannot_write_and_then_writes_the_next(tmp_path: Path) -> None:
    """safetensors raises its own ``SafetensorError`` (here: its file's path is taken by a folder, as when the save's
    folder is pulled from under it); the save fails with an answer and the thread writes the next save's file."""
    from ranks.snapshot_saver import Saver

    context = zmq.Context()
    coordinator = context.socket(zmq.ROUTER)
    coordinator.bind("inproc://coordinator")
    stop = threading.Event()
    ctx = SimpleNamespace(rank=3, snapshots_dir=str(tmp_path), zmq=context, endpoint="inproc://coordinator", stop=stop)
    saver = Saver(ctx, Stage.DENOISE)  # type: ignore[arg-type]
    try:
        broken, fine = new_snapshot_id(), new_snapshot_id()
        (tmp_path / broken / f".{file_name(3, 'denoise')}.tmp").mkdir(parents=True)
        for snapshot in (broken, fine):
            saver.submit(p.SaveState(session="s0", snapshot=snapshot, chunk=3), {"kv": torch.ones(4)})
        answers = []
        while len(answers) < 2:
            assert coordinator.poll(20_000), f"the writer answered {len(answers)} of 2 saves"
            _, data = coordinator.recv_multipart()
            message = p.decode(data, "worker")
            if isinstance(message, p.SaveWritten):
                answers.append(message)
        assert answers[0].snapshot == broken and "SafetensorError" in answers[0].error
        assert answers[1].snapshot == fine and not answers[1].error and answers[1].bytes > 0
        assert (tmp_path / fine / file_name(3, "denoise")).is_file()
    finally:
        stop.set()
        if saver._thread is not None:
            saver._thread.join(5)
        coordinator.close(linger=0)
        context.term()


# ---- the core: when the failed save's folder goes


def failed_save(tmp_path: Path) -> tuple[Job, p.SaveState]:
    """A save whose tasks are out and copied, that rank 3 fails at its copy: six writers still write."""
    job, sid = save_job(tmp_path)
    job.send(A, p.Save(req=9, session=sid))
    task = job.sent(p.SaveState)[-1][1]
    job.answer(p.SaveState, ranks=[3], fail="out of host memory")
    return job, task


def test_a_failed_saves_folder_is_deleted_only_once_its_last_writer_has_answered(tmp_path: Path) -> None:
    job, task = failed_save(tmp_path)
    assert [e.code for e in job.to(A, p.Error) if e.req == 9] == ["save_failed"]  # answered at once
    assert not drops(job.log), "the folder was deleted while six writers still write into it"
    job.answer(p.SaveState)  # the others copied
    writers = sorted(part for part in PARTS if part != (3, "denoise"))
    for rank, role in writers[:-1]:
        assert not drops(job.step(WorkerSent(written(job, task, rank, role))))
    rank, role = writers[-1]
    assert drops(job.step(WorkerSent(written(job, task, rank, role, error="disk full")))) == [task.snapshot]


def test_late_files_of_a_hundred_failed_saves_are_all_deleted(tmp_path: Path) -> None:
    """The old core remembered the last 64 failed saves: a file written after that stayed on disk for ever."""
    job, sid = save_job(tmp_path)
    tasks = []
    for n in range(100):
        job.send(A, p.Save(req=1000 + n, session=sid))
        tasks.append(job.sent(p.SaveState)[-1][1])
        job.answer(p.SaveState, ranks=[3], fail="busy writer")  # fails; six writers still busy with their copy
        job.answer(p.SaveState)
    assert not drops(job.log)
    out = []
    for task in tasks:
        for rank, role in sorted(PARTS - {(3, "denoise")}):
            out += job.step(WorkerSent(written(job, task, rank, role)))
    assert drops(out) == [t.snapshot for t in tasks]
    control(job, sid, 2)  # the session streams on
    job.chunk(sid, 2)


def test_a_late_refusal_of_a_failed_save_does_not_fail_the_next_save_of_the_session(tmp_path: Path) -> None:
    """A refusal names the session, not the save: it belongs to the failed save whose worker still owed it."""
    job, sid = save_job(tmp_path)
    job.send(A, p.Save(req=1, session=sid))
    job.answer(p.SaveState, ranks=[3], fail="no room")  # the first save fails; rank 4 has not answered yet
    first4 = [(who, t) for who, t in job.tasks if isinstance(t, p.SaveState) and who == b"4:denoise"]
    job.tasks = [x for x in job.tasks if x not in first4]
    job.answer(p.SaveState)
    job.send(A, p.Save(req=2, session=sid))  # a second save starts at once
    assert job.sent(p.SaveState)[-1][1].snapshot != first4[0][1].snapshot
    job.step(WorkerSent(p.TaskFailed(rank=4, role="denoise", session=sid, phase=p.Phase.SAVE, stage=Stage.DENOISE,
                                     error="no room")))  # rank 4's answer to the first save's task, late
    assert not [e for e in job.to(A, p.Error) if e.req == 2]
    assert sid in job.core.saving.pending


def test_late_writes_track_each_failed_save_until_its_last_part_answers_or_it_is_given_up() -> None:
    late = LateWrites(wait_s=10.0, limit=2)
    assert late.failed("a", "s0", frozenset(), now=0.0) == ["a"]  # nothing was sent: delete at once
    assert late.failed("b", "s0", {(2, "denoise"), (1, "decode")}, now=0.0) == []
    assert not late.answered("b", (2, "denoise")) and "b" in late
    assert late.refused("s0", (1, "decode")) == (True, "b") and "b" not in late
    assert late.refused("s0", (1, "decode")) == (False, None)
    late.failed("c", "s0", {(1, "decode")}, now=1.0)
    late.failed("d", "s1", {(1, "decode")}, now=2.0)
    assert late.failed("e", "s1", {(1, "decode")}, now=3.0) == ["c"]  # over the limit: the oldest is given up
    assert late.expired(now=12.5) == ["d"] and len(late) == 1
    assert late.answered("e", (1, "decode")) and len(late) == 0
    assert not late.answered("never", (1, "decode"))  # a save that never failed: nothing to do



def test_a_refusal_naming_a_newer_save_leaves_an_older_failed_saves_writer_alone() -> None:
    late = LateWrites(wait_s=10.0)
    late.failed("s1", "session", {(1, "decode")}, now=0.0)  # its writer on rank 1 may still be writing s1's file
    assert late.refused("session", (1, "decode"), "s2") == (False, None)  # the newer save's refusal: s1 untouched
    assert "s1" in late
    assert late.refused("session", (1, "decode"), "s1") == (True, "s1")  # s1's own answer: now its folder goes
