"""A snapshot folder is untrusted input, and saves are bounded (issue 33, points 5, 6, 7), without processes: the
manifest's size checked before it is read and its read left to the shell; the tensors of a file checked before a
collective; a manifest's camera, prompt and length held to this server's limits; refusals that name no path; the
default retention budget and each session's save rate (``runtime.save_rate``, a state machine with ``now``)."""

from __future__ import annotations

import math
import os
import tracemalloc
from pathlib import Path

import msgspec
import pytest
import torch

from ipc import protocol as p
from models.synthetic import synthetic_geometry
from ranks.snapshot_checks import check_condition, check_finite
from runtime.config import Config, ConfigError, load
from runtime.core_types import (
    ClientSent,
    ClientUnreadable,
    DropSnapshotFiles,
    ListSnapshots,
    ManifestRead,
    ManifestWritten,
    ReadManifest,
    SnapshotsListed,
    Tick,
    WorkerSent,
    WriteManifest,
)
from runtime.save_rate import SaveCredit, SaveRate
from runtime.snapshots import (
    MANIFEST,
    Budget,
    SnapshotError,
    SnapshotStore,
    new_snapshot_id,
    read_manifest,
    write_manifest,
)
from tests.core_job import A, Job
from tests.test_snapshot_budget import running, save
from tests.test_snapshots import PARTS, save_job, write_snapshot, written

# ---- point 5: the manifest's size, and who reads it


def test_a_manifest_of_a_gigabyte_is_refused_by_its_size_without_being_read(tmp_path: Path) -> None:
    store, sid = write_snapshot(tmp_path)
    os.truncate(tmp_path / sid / MANIFEST, 1 << 30)  # sparse: no disk used
    tracemalloc.start()
    try:
        with pytest.raises(SnapshotError, match="is 1073741824 bytes: not one of ours"):
            store.read(sid)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated to refuse it"


def test_the_core_asks_the_shell_to_read_a_restores_manifest_and_reads_no_file_itself(tmp_path: Path) -> None:
    job = Job()
    store, snapshot = write_snapshot(tmp_path)

    def no_io(_: str) -> None:
        raise AssertionError("the core read a manifest on rank 0's loop")

    job.use(SnapshotStore(tmp_path))
    job.core.saving.store.read = no_io  # type: ignore[method-assign]
    out = job.core.step([ClientSent(A, p.Open(req=7, image=b"", restore=snapshot))], 1.0)
    (read,) = [o for o in out if isinstance(o, ReadManifest)]
    assert read.snapshot == snapshot and not [o for o in out if isinstance(o, p.Error)]
    out = job.step(ManifestRead(read.ticket, *read_manifest(store, snapshot)))  # what the shell's thread answers
    assert [t.restore for _, t in job.sent(p.InitCondition, out)] == [snapshot]


def test_after_a_save_the_folder_is_listed_for_the_budget_by_the_shell_not_on_the_cores_step(tmp_path: Path) -> None:
    """With a budget (the default now), every save lists the folder: 1.2 s for 1,000 snapshots on a busy CPU."""
    job, sid = running(tmp_path, Budget(max_count=1))
    first, _ = save(job, sid)
    listings: list[float] = []
    job.core.saving.store.listing = lambda: listings.append(1) or []  # type: ignore[method-assign]
    job.send(A, p.Save(req=500, session=sid))
    task = job.sent(p.SaveState)[-1][1]
    job.answer(p.SaveState)
    out = []
    for rank, role in sorted(PARTS):
        out += job.core.step([WorkerSent(written(job, task, rank, role))], job.now)  # the core alone
    (write,) = [o for o in out if isinstance(o, WriteManifest)]  # the shell writes the manifest, then answers
    out = job.core.step([ManifestWritten(write.manifest.id, write_manifest(job.core.saving.store, write.manifest))],
                        job.now)
    assert [s.snapshot for s in job.to(A, p.Saved, out)] == [task.snapshot] and not listings
    (listing,) = [o for o in out if isinstance(o, ListSnapshots)]
    stored = tuple(SnapshotStore(tmp_path).listing())  # what the shell's thread lists
    out = job.core.step([SnapshotsListed(listing.written, stored)], job.now)
    assert [o.snapshot for o in out if isinstance(o, DropSnapshotFiles) and o.expired] == [first]


def test_stats_show_the_folder_as_the_shell_last_listed_it_and_the_core_never_lists_it(tmp_path: Path) -> None:
    write_snapshot(tmp_path)
    job, _ = running(tmp_path, Budget(max_count=5))
    job.core.saving.store.listing = lambda: pytest.fail("the core listed the folder")  # type: ignore[method-assign]
    out = job.core.step([Tick()], job.now)
    assert [o.written for o in out if isinstance(o, ListSnapshots)] == [""]  # "": for stats, after no save
    assert job.core.stats(job.now).snapshots.count is None  # not listed yet
    assert not [o for o in job.core.step([Tick()], job.now + 1) if isinstance(o, ListSnapshots)]  # one at a time
    job.core.step([SnapshotsListed("", tuple(SnapshotStore(tmp_path).listing()))], job.now + 2)
    assert job.core.stats(job.now).snapshots.count == 1
    assert not [o for o in job.core.step([Tick()], job.now + 5) if isinstance(o, ListSnapshots)]  # fresh
    assert job.core.saving.folder.due(job.core.saving.store, job.now + 13)  # stale after 10 s: listed again


# ---- point 6: the tensors of a file


def test_a_condition_file_whose_context_or_pending_condition_has_another_shape_is_refused() -> None:
    g = synthetic_geometry(160, 256, 3)
    context, condition = torch.zeros(g.context_shape), torch.zeros(g.condition_shape)
    check_condition({"context": context}, {3: condition, 4: condition}, g, "s")  # what a save writes
    for own, pending, why in (
            ({"context": context}, {3: torch.zeros(2, 3, 5)}, r"'pending\.3' is torch.float32 \(2, 3, 5\)"),
            ({"context": context[..., :-1]}, {}, "'context' is"),
            ({"context": context}, {3: condition.to(torch.int64)}, "takes a floating-point tensor"),
            ({}, {}, "no tensor 'context'"),
            ({"context": context}, {-1: condition}, "a condition of chunk -1")):
        with pytest.raises(SnapshotError, match=why):
            check_condition(own, pending, g, "s")


def test_a_file_holding_a_nan_or_an_infinity_is_refused() -> None:
    check_finite({"kv": torch.ones(3), "noise": torch.zeros(4, dtype=torch.uint8)}, "f")
    check_finite({"kv": torch.full((100_000,), 60_000.0, dtype=torch.float16)}, "f")  # its sum is past fp16's max
    for bad in (math.nan, math.inf, -math.inf):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            with pytest.raises(SnapshotError, match="'kv' holds values that are not finite"):
                check_finite({"kv": torch.tensor([1.0, bad, -math.inf if bad == math.inf else 2.0]).to(dtype)}, "f")


# ---- point 7: a manifest held to this server's limits, refusals without paths


def test_a_refusal_names_no_path_of_the_servers_folder(tmp_path: Path) -> None:
    job = Job()
    job.use(SnapshotStore(tmp_path / "private" / "snapshots"))
    missing = new_snapshot_id()
    job.send(A, p.Open(req=3, image=b"", restore=missing))
    (error,) = [e for e in job.to(A, p.Error) if e.req == 3]
    assert error.code == "bad_snapshot" and f"no snapshot {missing}" in error.message
    assert "private" not in error.message and str(tmp_path) not in error.message


@pytest.mark.parametrize("intrinsics", [(0.0, 0.0, 0.0, 0.0), (1e300, 1e300, 416.0, 240.0), (500.0, 500.0, -1.0, 9.0)])
def test_a_manifest_with_a_camera_a_client_could_not_give_is_refused(
        tmp_path: Path, intrinsics: tuple[float, ...]) -> None:  # fmt: skip
    store, sid = write_snapshot(tmp_path)
    store.write(msgspec.structs.replace(store.read(sid), intrinsics=intrinsics))
    with pytest.raises(SnapshotError, match=r"focal lengths|principal point"):
        store.read(sid)


def test_a_manifest_prompt_longer_than_this_server_takes_is_refused(tmp_path: Path) -> None:
    job = Job()
    store, sid = write_snapshot(tmp_path)
    store.write(msgspec.structs.replace(store.read(sid), prompt="x" * 200_000))
    job.use(store)
    before = len(job.core.sessions)
    job.send(A, p.Open(req=4, image=b"", restore=sid))
    (error,) = [e for e in job.to(A, p.Error) if e.req == 4]
    assert error.code == "bad_snapshot" and "a prompt of 200000 characters (this server: at most 2000)" in \
        error.message
    assert len(job.core.sessions) == before


def test_a_restore_runs_to_the_length_it_asks_for_or_is_refused_naming_the_range(tmp_path: Path) -> None:
    job = Job()
    store, sid = write_snapshot(tmp_path)  # saved at chunk 3 of 8
    job.use(store)
    job.send(A, p.Open(req=5, image=b"", restore=sid, num_chunks=1))
    (error,) = [e for e in job.to(A, p.Error) if e.req == 5]
    assert error.code == "bad_request" and "must run to a length in 4..100000" in error.message
    job.send(A, p.Open(req=6, image=b"", restore=sid, num_chunks=5))
    job.settle(p.InitCondition, p.InitDecode, p.BroadcastContext, p.InitDenoise)
    (opened,) = [o for o in job.to(A, p.Opened) if o.req == 6]
    assert (opened.first_chunk, opened.num_chunks) == (3, 5)


# ---- point 7: how much a server keeps, how often a session saves


def test_the_default_config_bounds_the_snapshot_folder_and_each_sessions_saves() -> None:
    snapshots = Config().snapshots
    assert snapshots.max_gb == 100.0 and (snapshots.saves_per_minute, snapshots.save_burst) == (10.0, 10)
    for bad in ("--snapshots.saves_per_minute=-1", "--snapshots.save_burst=0", "--snapshots.saves_per_minute=nan"):
        with pytest.raises(ConfigError, match="saves_per_minute"):
            load("cpu-tiny", [bad])


def test_a_session_saves_its_burst_then_one_per_period_and_a_refusal_costs_nothing() -> None:
    rate, credit = SaveRate(per_minute=6.0, burst=2), SaveCredit()  # one save every 10 s
    assert rate.take(credit, 0.0) is None and rate.take(credit, 0.0) is None
    assert rate.take(credit, 4.0) == pytest.approx(6.0)
    assert rate.take(credit, 9.0) == pytest.approx(1.0)  # the refusal at 4 s took nothing
    assert rate.take(credit, 10.0) is None and rate.take(credit, 10.0) == pytest.approx(10.0)
    assert rate.take(credit, 1000.0) is None and rate.take(credit, 1000.0) is None  # earned back up to the burst
    assert rate.take(credit, 1000.0) is not None
    assert SaveRate(0.0, 1).take(SaveCredit(), 0.0) is None  # 0: no limit


def test_a_session_that_saves_too_often_is_refused_busy_with_when_to_retry(tmp_path: Path) -> None:
    job, sid = save_job(tmp_path)
    job.core.saving.store.rate = SaveRate(per_minute=1.0, burst=1)
    job.send(A, p.Save(req=20, session=sid))
    job.answer(p.SaveState, fail="no room")  # the save ends (failed): the session may ask again
    job.send(A, p.Save(req=21, session=sid))
    (busy,) = [e for e in job.to(A, p.Error) if e.req == 21]
    assert busy.code == "busy" and busy.retry_after_s == pytest.approx(60.0, abs=1.0)
    job.step(ClientSent(A, p.Save(req=22, session=sid)), dt=busy.retry_after_s)
    assert not [e for e in job.to(A, p.Error) if e.req == 22] and sid in job.core.saving.pending


def test_a_prompt_of_invalid_utf8_is_refused_naming_it_with_the_request_id() -> None:
    data = msgspec.msgpack.encode({"v": p.PROTOCOL_VERSION, "type": "open", "req": 5, "image": b"", "prompt": "x"})
    data = data.replace(b"\xa1x", b"\xa1\xff")  # the one-byte string "x" becomes the invalid UTF-8 byte 0xff
    with pytest.raises(p.ProtocolViolation, match="a string in the message is not valid UTF-8") as refused:
        p.decode(data, "client")
    job = Job()  # what the shell makes of it (``ClientUnreadable``) reaches the client with its request id
    job.step(ClientUnreadable(A, str(refused.value), refused.value.req))
    (error,) = job.to(A, p.Error)
    assert (error.req, error.code) == (5, "bad_message") and "not valid UTF-8" in error.message
    with pytest.raises(p.ProtocolViolation, match="not a msgpack message"):  # bytes that are no msgpack at all
        p.decode(b"\x84\xc1", "client")
