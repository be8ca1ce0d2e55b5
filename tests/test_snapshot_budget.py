"""The snapshot folder's retention budget (``[snapshots] max_gb``, ``max_count``) without processes: the pure choice
(``runtime.snapshots.over_budget``), the store's listing of what counts, and the coordinator core deleting the
oldest complete snapshots after a save (``tests.core_job.Job``), what it keeps, what stats show."""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec
import pytest

from ipc import protocol as p
from ipc.metrics_types import ServerStats, SnapshotFolder
from runtime.config import ConfigError
from runtime.config import load as load_config
from runtime.core_types import DropSnapshotFiles, Tick, WorkerSent
from runtime.replicas import read_stats
from runtime.snapshots import MANIFEST, Budget, SnapshotStore, Stored, new_snapshot_id, over_budget
from tests.core_job import A, Job, control
from tests.test_snapshots import PARTS, write_snapshot, written

SAVED_BYTES = 7 * 100  # what ``written`` puts on disk for one save: 100 bytes per stage worker


def old_snapshot(root: Path, created: float) -> str:
    """A complete snapshot saved at wall-clock ``created`` (7 bytes of files)."""
    store, snapshot = write_snapshot(root)
    store.write(msgspec.structs.replace(store.read(snapshot), created=created))
    return snapshot


def running(tmp_path: Path, budget: Budget) -> tuple[Job, str]:
    job = Job()
    job.use(SnapshotStore(tmp_path, budget))
    sid = job.open(num_chunks=8)
    for index in range(2):
        control(job, sid, index)
        job.chunk(sid, index)
    return job, sid


def save(job: Job, sid: str) -> tuple[str, list[str]]:
    """A complete save of ``sid``: (its id, the snapshots the core deleted for the budget, deleted as the shell
    does)."""
    job.send(A, p.Save(req=next(job.req), session=sid))
    task = job.sent(p.SaveState)[-1][1]
    job.answer(p.SaveState)
    out = []
    for rank, role in sorted(PARTS):
        out += job.step(WorkerSent(written(job, task, rank, role)))
    assert [s.snapshot for s in job.to(A, p.Saved, out)] == [task.snapshot]
    expired = [o.snapshot for o in out if isinstance(o, DropSnapshotFiles) and o.expired]
    for snapshot in expired:
        job.core.saving.store.delete(snapshot)  # what ranks.coordinator does with the output
    return task.snapshot, expired


def test_the_budget_picks_the_oldest_first_by_bytes_and_by_count_and_skips_the_kept() -> None:
    stored = [Stored("c", 3.0, 10), Stored("a", 1.0, 10), Stored("b", 2.0, 10), Stored("d", 4.0, 10)]
    assert over_budget(stored, Budget(), ()) == []  # no limit
    assert over_budget(stored, Budget(max_bytes=25), ()) == ["a", "b"]
    assert over_budget(stored, Budget(max_count=3), ()) == ["a"]
    assert over_budget(stored, Budget(max_bytes=40, max_count=4), ()) == []  # exactly at the budget
    assert over_budget(stored, Budget(max_bytes=25, max_count=1), ()) == ["a", "b", "c"]  # the tighter one
    assert over_budget(stored, Budget(max_count=2), {"a"}) == ["b", "c"]
    assert over_budget(stored, Budget(max_bytes=5), {"d", "b"}) == ["a", "c"]  # the kept ones alone exceed it


def test_a_save_over_the_budget_deletes_the_oldest_complete_snapshots_and_keeps_the_one_just_written(
        tmp_path: Path) -> None:  # fmt: skip
    first, second, third = (old_snapshot(tmp_path, t) for t in (1.0, 2.0, 3.0))
    job, sid = running(tmp_path, Budget(max_bytes=SAVED_BYTES + 10))  # room for the save and one old snapshot
    new, expired = save(job, sid)
    assert expired == [first, second]  # the two oldest; the third (7 bytes) fits beside the new one
    assert {s.id for s in SnapshotStore(tmp_path).listing()} == {third, new}
    job.send(A, p.Open(req=70, image=b"", restore=first))  # a client that kept the id of a deleted one
    (error,) = [e for e in job.to(A, p.Error) if e.req == 70]
    assert error.code == "bad_snapshot" and f"no snapshot {first}" in error.message

    job, sid = running(tmp_path, Budget(max_count=2))
    newer, expired = save(job, sid)
    assert expired == [third]  # by count: the oldest goes, whatever its size
    assert {s.id for s in SnapshotStore(tmp_path).listing()} == {new, newer}


def test_a_snapshot_a_restore_is_still_loading_is_kept_until_its_caches_are_ready(tmp_path: Path) -> None:
    first, second, third = (old_snapshot(tmp_path, t) for t in (1.0, 2.0, 3.0))
    job, sid = running(tmp_path, Budget(max_count=2))
    job.send(A, p.Open(req=80, image=b"", restore=first))  # its ranks read the files at init: not answered yet
    restoring = list(job.core.sessions)[-1]
    _, expired = save(job, sid)
    assert expired == [second, third] and (tmp_path / first / MANIFEST).is_file()
    job.answer(p.ConditionChunk, sid)  # the condition rank encoded ahead for the saved session; then the restore's
    job.settle(p.InitCondition, p.InitDecode, p.BroadcastContext, p.InitDenoise)
    assert [o.session for o in job.to(A, p.Opened) if o.req == 80] == [restoring]  # its caches are ready
    _, expired = save(job, sid)
    assert expired == [first]  # no longer read: the oldest goes now


def test_a_folder_that_is_not_a_complete_snapshot_is_never_counted_nor_deleted(tmp_path: Path) -> None:
    old = old_snapshot(tmp_path, 1.0)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / MANIFEST).write_bytes(b"{}")
    (tmp_path / "README").write_text("the operator's")
    in_progress = tmp_path / new_snapshot_id()  # a save still writing (or failed): no manifest
    in_progress.mkdir()
    (in_progress / "rank2-denoise.safetensors").write_bytes(bytes(10))
    garbage = tmp_path / new_snapshot_id()
    garbage.mkdir()
    (garbage / MANIFEST).write_bytes(b"not json")
    store, other_format = write_snapshot(tmp_path)
    store.write(msgspec.structs.replace(store.read(other_format), format=2, created=0.5))
    store, truncated = write_snapshot(tmp_path)  # a file missing: not complete
    store.write(msgspec.structs.replace(store.read(truncated), created=0.1))
    (tmp_path / truncated / "rank3-denoise.safetensors").unlink()
    before = sorted(path.name for path in tmp_path.rglob("*"))

    job, sid = running(tmp_path, Budget(max_count=1))
    new, expired = save(job, sid)
    assert expired == [old]
    after = sorted(path.name for path in tmp_path.rglob("*"))
    assert set(before) - set(after) == {old} and {s.id for s in SnapshotStore(tmp_path).listing()} == {new}


def test_a_budget_smaller_than_one_snapshot_keeps_the_latest_save_and_warns_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    old = old_snapshot(tmp_path, 1.0)
    job, sid = running(tmp_path, Budget(max_bytes=SAVED_BYTES // 2))
    with caplog.at_level(logging.WARNING, logger="runtime.core"):
        first, expired = save(job, sid)
        assert expired == [old] and (tmp_path / first / MANIFEST).is_file()
        second, expired = save(job, sid)
    assert expired == [first] and (tmp_path / second / MANIFEST).is_file()
    warnings = [r.getMessage() for r in caplog.records if "smaller than one snapshot" in r.getMessage()]
    assert len(warnings) == 1 and first in warnings[0]


def test_stats_show_the_snapshot_folder_and_its_budget_and_a_router_reads_them(tmp_path: Path) -> None:
    old_snapshot(tmp_path, 1.0)
    old_snapshot(tmp_path, 2.0)
    job, sid = running(tmp_path, Budget(max_bytes=3 << 30, max_count=5))
    job.step(Tick())  # the core asks the shell to list the folder (off the loop); stats show the last listing
    (reply,) = job.to(A, p.StatsReply, job.send(A, p.Stats(req=90)))
    assert reply.stats.snapshots == SnapshotFolder(count=2, bytes=14, max_bytes=3 << 30, max_count=5)
    save(job, sid)
    folder = job.core.stats(job.now).snapshots
    assert (folder.count, folder.bytes) == (3, 14 + SAVED_BYTES)  # listed again after the save
    wire = msgspec.msgpack.decode(p.encode(reply))["stats"]
    typed, _ = read_stats(wire)
    assert typed.snapshots == reply.stats.snapshots
    older = {k: v for k, v in wire.items() if k != "snapshots"}  # a server of before: the field is unset
    assert read_stats(older)[0].snapshots is msgspec.UNSET
    assert msgspec.convert(older, ServerStats).open_sessions == reply.stats.open_sessions


def test_the_snapshot_budget_config_is_checked_and_given_in_gib(tmp_path: Path) -> None:
    cfg = load_config("cpu-tiny", ["--snapshots.max_gb=25.5", "--snapshots.max_count=10"])
    assert Budget.of(cfg.snapshots.max_gb, cfg.snapshots.max_count) == Budget(int(25.5 * 2**30), 10)
    assert load_config("cpu-tiny", []).snapshots.max_gb == 100.0  # a disk never fills by default (issue 33 point 7)
    for bad in ("--snapshots.max_gb=-1", "--snapshots.max_gb=nan", "--snapshots.max_gb=inf",
                "--snapshots.max_gb=1e10", "--snapshots.max_count=-2", f"--snapshots.max_count={2**62}"):
        with pytest.raises(ConfigError, match=r"snapshots\.max_gb must be a finite number in \[0, "):
            load_config("cpu-tiny", [bad])


def test_a_server_without_a_budget_never_lists_its_folder(tmp_path: Path) -> None:
    """The folder may hold thousands of snapshots on a shared filesystem: without a budget rank 0's loop (which
    serves every stream) reads none of them, neither after a save nor for stats."""
    kept = old_snapshot(tmp_path, 1.0)
    job, sid = running(tmp_path, Budget())
    listed: list[int] = []
    real = job.core.saving.store.listing
    job.core.saving.store.listing = lambda: listed.append(1) or real()  # type: ignore[method-assign]
    save(job, sid)
    (reply,) = job.to(A, p.StatsReply, job.send(A, p.Stats(req=91)))
    assert reply.stats.snapshots == SnapshotFolder(count=None, bytes=None, max_bytes=0, max_count=0)
    assert not listed and (tmp_path / kept).is_dir()


def test_each_open_sessions_latest_save_is_kept_by_the_budget(tmp_path: Path) -> None:
    """A router moves a session with its latest snapshot when its replica dies; a paused session makes no newer one:
    the budget never deletes the latest save of a session still open here, only older ones."""
    job, first = running(tmp_path, Budget(max_count=1))
    second = job.open(num_chunks=8)
    for index in range(2):
        control(job, second, index)
        job.chunk(second, index)
    kept, _ = save(job, first)
    latest, expired = save(job, second)
    assert expired == [] and {s.id for s in SnapshotStore(tmp_path).listing()} == {kept, latest}
    _, expired = save(job, first)
    assert expired == [kept]  # superseded by the session's newer save


def test_a_manifest_whose_total_is_not_its_files_is_not_counted_and_stats_stay_in_range(tmp_path: Path) -> None:
    """A hand-made or corrupt manifest in a shared folder must not put a negative or huge total in every replica's
    stats (a router marks such a replica down) nor steer what the budget deletes."""
    honest = old_snapshot(tmp_path, 1.0)
    forged = old_snapshot(tmp_path, 2.0)
    store = SnapshotStore(tmp_path)
    store.write(msgspec.structs.replace(store.read(forged), bytes=-(2**62)))
    assert [s.id for s in store.listing()] == [honest]
    job, _ = running(tmp_path, Budget(max_count=5))
    job.step(Tick())  # listed by the shell
    stats = job.core.stats(job.now)
    assert stats.snapshots == SnapshotFolder(count=1, bytes=7, max_bytes=0, max_count=5)
    read_stats(msgspec.to_builtins(stats))  # a router takes it


def test_a_tiny_positive_budget_is_a_budget_not_none() -> None:
    assert Budget.of(1e-12, 0) == Budget(max_bytes=1, max_count=0) and Budget.of(0.0, 0) == Budget()
