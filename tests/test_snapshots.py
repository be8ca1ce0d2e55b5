"""Snapshots without processes: ids, the manifest and its validation, the save state machine, the scheduler's
hold and start, and the coordinator core's save and restore played event by event (``tests.core_job.Job``)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec
import pytest
import torch

from ipc import protocol as p
from models import snapshot_io
from models.stages import SessionSpec
from models.synthetic import SyntheticCondition, SyntheticDecode, SyntheticDenoise, synthetic_geometry
from runtime import scheduler as sch
from runtime.config import LayoutConfig
from runtime.core_types import DropSnapshotFiles, WorkerSent
from runtime.placement import placement_of
from runtime.snapshots import (
    FORMAT,
    MANIFEST,
    FileEntry,
    Geometry,
    Identity,
    Manifest,
    PendingSave,
    SaveState,
    SnapshotError,
    SnapshotStore,
    check_id,
    file_name,
    new_snapshot_id,
    refusal,
)
from tests.core_job import A, B, Job, control

# model "": the core's default (the tests' Job names no model)
IDENTITY = Identity(model="", layout="cpu-tiny", world_size=7, condition=0, decode=1,
                    dit=(2, 3, 4, 5, 6))
GEOMETRY = Geometry(height=160, width=256, chunk_latent_frames=3, context_shape=(1, 8), condition_shape=(3, 160, 256),
                    latent_shape=(12, 3, 80, 128))
PARTS = frozenset({(0, "condition"), (1, "decode"), *((r, "denoise") for r in range(2, 7))})


def manifest(sid: str = "", files: tuple[FileEntry, ...] | None = None, **changes: object) -> Manifest:
    files = files if files is not None else tuple(FileEntry(rank=r, role=role, name=file_name(r, role), bytes=1,
                                                            sha256="0" * 64) for r, role in sorted(PARTS))
    fields: dict[str, object] = dict(format=FORMAT, id=sid or new_snapshot_id(), identity=IDENTITY, geometry=GEOMETRY,
                                     chunk=3, seed=1, prompt="", num_chunks=8, intrinsics=None, steps=4, live=None,
                                     files=files, bytes=7, pause_s=0.0, write_s=0.0, created=0.0)
    fields.update(changes)
    return Manifest(**fields)  # type: ignore[arg-type]


# ---- ids and the manifest


def test_a_servers_snapshot_identity_and_the_files_it_expects_derive_from_its_placement() -> None:
    """The identity is built from the placement of the stages (the manifest's bytes as the hand-built one's), and
    the files a restore expects are the placement's stage workers, the ones a save asks for."""
    where = placement_of(LayoutConfig(name="cpu-tiny", world_size=7, coordinator=0, condition=0, decode=1,
                                      dit=[2, 3, 4, 5, 6]))
    here = Identity.of("", "cpu-tiny", where)
    assert msgspec.json.encode(here) == msgspec.json.encode(IDENTITY) == (
        b'{"model":"","layout":"cpu-tiny","world_size":7,"condition":0,"decode":1,"dit":[2,3,4,5,6]}')  # format 1's
    assert here.parts() == PARTS == {(r, str(stage.value)) for stage in p.Stage for r in where.ranks_of(stage)}
    one = Identity.of("m", "one", placement_of(LayoutConfig(name="one", world_size=1, coordinator=0, condition=0,
                                                            decode=0, dit=[0])))
    assert (one.condition, one.decode, one.dit, one.parts()) == (0, 0, (0,), {(0, s.value) for s in p.Stage})


def test_snapshot_ids_are_unguessable_and_nothing_shaped_like_a_path_passes_as_one() -> None:
    ids = {new_snapshot_id() for _ in range(100)}
    assert len(ids) == 100 and all(check_id(i) == i for i in ids)
    for bad in ("../../etc", "a/b" + "c" * 19, "x" * 21, "x" * 23, "", "..", "x" * 21 + "."):
        with pytest.raises(SnapshotError, match="not a snapshot id"):
            check_id(bad)


def test_a_manifest_of_this_server_passes_and_each_difference_is_named() -> None:
    assert refusal(manifest(), IDENTITY, GEOMETRY) is None
    cases = {
        "model 'lingbot": msgspec.structs.replace(IDENTITY, model="lingbot-fast|v1|/ckpt"),
        "DiT sequence-parallel degree 4 (this server: 5)": msgspec.structs.replace(IDENTITY, dit=(2, 3, 4, 5)),
        "layout layout 'split7'": msgspec.structs.replace(IDENTITY, layout="split7"),
        "layout decode 2": msgspec.structs.replace(IDENTITY, decode=2),
    }
    for what, saved in cases.items():
        why = refusal(manifest(identity=saved), IDENTITY, GEOMETRY)
        assert why is not None and what in why, why
    why = refusal(manifest(), IDENTITY, msgspec.structs.replace(GEOMETRY, chunk_latent_frames=4))
    assert why is not None and "chunk_latent_frames 3 (this server: 4)" in why
    why = refusal(manifest(), IDENTITY, None)
    assert why is not None and "frame size 256x160, which this server does not serve" in why
    assert "format 2" in (refusal(manifest(format=2), IDENTITY, GEOMETRY) or "")
    missing = manifest(files=manifest().files[1:])
    assert "do not cover" in (refusal(missing, IDENTITY, GEOMETRY) or "")


def write_snapshot(root: Path, body: bytes = b"x") -> tuple[SnapshotStore, str]:
    store, sid = SnapshotStore(root), new_snapshot_id()
    files = []
    for rank, role in sorted(PARTS):
        (root / sid).mkdir(parents=True, exist_ok=True)
        (root / sid / file_name(rank, role)).write_bytes(body)
        files.append(FileEntry(rank=rank, role=role, name=file_name(rank, role), bytes=len(body),
                               sha256=hashlib.sha256(body).hexdigest()))
    store.write(manifest(sid, tuple(files)))
    return store, sid


def test_the_store_reads_back_what_it_wrote_and_refuses_missing_truncated_or_hand_made_manifests(
        tmp_path: Path) -> None:  # fmt: skip
    store, sid = write_snapshot(tmp_path)
    assert store.read(sid).id == sid
    with pytest.raises(SnapshotError, match="no snapshot"):
        store.read(new_snapshot_id())
    (tmp_path / sid / file_name(3, "denoise")).write_bytes(b"")
    with pytest.raises(SnapshotError, match=r"rank3-denoise\.safetensors has 0 bytes, the manifest says 1"):
        store.read(sid)
    (tmp_path / sid / file_name(3, "denoise")).unlink()
    with pytest.raises(SnapshotError, match="is missing"):
        store.read(sid)
    _, other = write_snapshot(tmp_path)
    (tmp_path / other / MANIFEST).write_bytes(b'{"format": 1, "id": "' + other.encode() + b'", "pickle": 1}')
    with pytest.raises(SnapshotError, match="not valid"):
        store.read(other)
    _, escaping = write_snapshot(tmp_path)
    saved = store.read(escaping)
    bad = msgspec.structs.replace(saved.files[0], role="x/../../../../etc/passwd",
                                  name="rank0-x/../../../../etc/passwd.safetensors")
    store.write(msgspec.structs.replace(saved, files=(bad, *saved.files[1:])))
    with pytest.raises(SnapshotError, match="is not one of ours"):
        store.read(escaping)
    _, moved = write_snapshot(tmp_path)
    (tmp_path / moved / MANIFEST).write_bytes((tmp_path / other / MANIFEST).read_bytes().replace(b"pickle", b"x"))
    elsewhere = new_snapshot_id()
    (tmp_path / elsewhere).mkdir()
    store.write(manifest(sid))  # a manifest copied into another folder names another snapshot
    (tmp_path / elsewhere / MANIFEST).write_bytes((tmp_path / sid / MANIFEST).read_bytes())
    with pytest.raises(SnapshotError, match=f"names snapshot {sid}"):
        store.read(elsewhere)


@pytest.mark.parametrize(("field", "value", "words"), [
    ("chunk", -5, "chunk -5 is not in"), ("chunk", 2**64, "is not in 0.."),
    ("num_chunks", 3, "a session of 3 chunks cannot resume at chunk 4"), ("seed", 2**70, "not a 64-bit number"),
    ("prompt_revision", -1, "prompt revision -1"), ("steps", 3, "steps: steps must be one of"),
    ("want", 2**63, "want: steps must be one of"), ("floor", -1, "floor: steps must be one of")])
def test_a_manifest_whose_numbers_cannot_start_a_session_is_refused(tmp_path: Path, field: str, value: int,
                                                                   words: str) -> None:
    """A shared snapshot folder is writable by others: a negative chunk would pass for a prompt encode's index, 2^64
    would fail the first task's encoding far from its cause, a steps of 3 would skip the open's check."""
    store, sid = write_snapshot(tmp_path)
    saved = msgspec.structs.replace(store.read(sid), chunk=4, num_chunks=10)
    store.write(msgspec.structs.replace(saved, **{field: value}))
    with pytest.raises(SnapshotError, match=words):
        store.read(sid)


def test_a_rank_file_round_trips_and_a_flipped_byte_or_a_non_safetensors_file_is_refused(tmp_path: Path) -> None:
    store, sid = SnapshotStore(tmp_path), new_snapshot_id()
    state = {"kv": torch.arange(12, dtype=torch.bfloat16).view(3, 4), "index": torch.tensor([5])}
    entries = [snapshot_io.write(store.folder(sid), r, role, state)[0] for r, role in sorted(PARTS)]
    store.write(manifest(sid, tuple(entries)))
    folder, files = store.folder(sid), store.read(sid).files
    loaded = snapshot_io.load(folder, files, sid, 4, "denoise")
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
    path = tmp_path / sid / file_name(4, "denoise")
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotError, match=r"rank4-denoise\.safetensors is corrupt"):
        snapshot_io.load(folder, files, sid, 4, "denoise")
    with pytest.raises(SnapshotError, match="no state of rank 9"):
        snapshot_io.load(folder, files, sid, 9, "denoise")


# ---- the save state machine


def test_a_save_releases_the_hold_at_the_last_capture_and_completes_at_the_last_file_in_any_order() -> None:
    save = PendingSave(new_snapshot_id(), "s", A, 1, 3, PARTS, asked=1.0)
    assert save.holds and save.state is SaveState.WAITING
    with pytest.raises(SnapshotError, match="not capturing"):
        save.on_captured((0, "condition"), 1.1)
    save.start(1.2)
    assert not save.holds  # the save tasks are queued before the boundary chunk's: the stream goes on
    entry = FileEntry(rank=2, role="denoise", name=file_name(2, "denoise"), bytes=10, sha256="a" * 64)
    assert not save.on_written(entry, 0.5)  # a file may come before the last capture (another socket)
    for part in sorted(PARTS)[:-1]:
        assert not save.on_captured(part, 1.2, 0.01)
    assert save.on_captured(sorted(PARTS)[-1], 1.25, 0.03) and save.state is SaveState.WRITING
    assert (save.wait_s, save.pause_s) == (pytest.approx(0.2), 0.03)
    for rank, role in sorted(PARTS - {(2, "denoise")}):
        done = save.on_written(FileEntry(rank=rank, role=role, name=file_name(rank, role), bytes=1, sha256=""), 0.1)
    assert done and save.state is SaveState.DONE and save.bytes == 16 and save.write_s == 0.5
    with pytest.raises(SnapshotError, match="not one of its stage workers"):
        PendingSave("x", "s", A, 1, 3, PARTS, 0.0, state=SaveState.CAPTURING).on_captured((9, "denoise"), 0)
    failed = PendingSave("x", "s", A, 1, 3, PARTS, 0.0)
    assert failed.holds and failed.fail("boom") and not failed.fail("again") and not failed.holds


# ---- the scheduler


def test_a_held_session_does_not_start_its_next_denoise_and_the_dit_idles_for_the_save() -> None:
    s = sch.Scheduler()
    s.open("s", 8, 0.0)
    for stage in sch.INIT_ORDER:
        s.init_done("s", stage, 0.0)
    s.chunk_done("s", sch.Stage.CONDITION, 0, 0.1)
    s.hold("s", True, 0.2)
    actions = s.submit_control("s", 0, 0.3)
    assert not [a for a in actions if isinstance(a, sch.RunChunk) and a.stage is sch.Stage.DENOISE]
    actions = s.hold("s", False, 0.5)
    assert [a.index for a in actions if isinstance(a, sch.RunChunk) and a.stage is sch.Stage.DENOISE] == [0]
    idle = [a for a in actions if isinstance(a, sch.DitIdle)]
    assert idle[-1].cause == "save" and idle[-1].end == 0.5


def test_a_restored_session_starts_every_cursor_at_its_snapshot_chunk() -> None:
    s = sch.Scheduler()
    s.open("s", 8, 0.0, start=5)
    actions: list[sch.Action] = []
    for stage in sch.INIT_ORDER:
        actions = s.init_done("s", stage, 0.0)
    assert [a.index for a in actions if isinstance(a, sch.RunChunk) and a.stage is sch.Stage.CONDITION] == [5]
    assert (s.next_control_index("s"), s.next_condition_index("s"), s.next_emit_index("s")) == (5, 7, 5)
    with pytest.raises(sch.AdmissionError, match="expected index 5"):
        s.submit_control("s", 0, 0.1)
    with pytest.raises(ValueError, match="cannot start at chunk 8"):
        s.open("t", 8, 0.0, start=8)


# ---- the coordinator core: save and restore, event by event


def save_job(tmp_path: Path) -> tuple[Job, str]:
    job = Job()
    job.use(SnapshotStore(tmp_path))
    sid = job.open(num_chunks=8)
    for index in range(2):
        control(job, sid, index)
        job.chunk(sid, index)
    return job, sid


def written(job: Job, task: p.SaveState, rank: int, role: str, error: str = "") -> p.SaveWritten:
    """What rank's writer thread reports, its file (100 bytes) put where it would write it."""
    folder = job.core.saving.store.folder(task.snapshot)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / file_name(rank, role)).write_bytes(bytes(100))
    return p.SaveWritten(rank=rank, role=role, session=task.session, stage=p.Stage(role), snapshot=task.snapshot,
                         name=file_name(rank, role), bytes=100, sha256="b" * 64, seconds=0.01, error=error)


def test_a_save_queues_its_tasks_between_the_chunks_before_the_boundary_and_it_and_answers_once_every_file_is_on_disk(
        tmp_path: Path) -> None:  # fmt: skip
    job = Job()
    job.use(SnapshotStore(tmp_path))
    sid = job.open(num_chunks=8)
    control(job, sid, 0)
    job.chunk(sid, 0)
    for index in (1, 2):  # chunk 1 decodes while chunk 2's latent waits for the decode rank
        control(job, sid, index)
        job.answer(p.ConditionChunk, sid, index)
        job.answer(p.DenoiseChunk, sid, index)
    control(job, sid, 3)  # chunk 3 is the boundary: the first chunk not dispatched to the DiT
    job.send(A, p.Save(req=50, session=sid))
    assert not job.sent(p.SaveState) and job.core.saving.pending[sid].chunk == 3
    job.answer(p.ConditionChunk, sid, 3)
    assert not [t for _, t in job.tasks if isinstance(t, p.DenoiseChunk) and t.index == 3], "chunk 3 was not held"
    job.answer(p.DecodeChunk, sid, 1)
    job.answer(p.ReceiveFrames, sid, 1)
    saves = job.sent(p.SaveState)
    assert {who.decode() for who, _ in saves} == {"0:condition", "1:decode", *(f"{r}:denoise" for r in range(2, 7))}
    task = saves[0][1]
    # every task before the boundary went first: the decode of chunk 2 is already in the decode rank's queue
    assert [t.index for _, t in job.sent(p.DecodeChunk)][-1] == 2 and task.chunk == 3
    # the hold ends once the save tasks are out: each worker copies its state before it sees chunk 3's task
    for rank in range(2, 7):
        mine = [t for who, t in job.sent((p.SaveState, p.DenoiseChunk)) if who == f"{rank}:denoise".encode()]
        assert [(type(t).__name__, getattr(t, "index", None)) for t in mine][-2:] == [("SaveState", None),
                                                                                     ("DenoiseChunk", 3)]
    job.answer(p.SaveState)
    for rank, role in sorted(PARTS):
        out = job.step(WorkerSent(written(job, task, rank, role)))
    (saved,) = job.to(A, p.Saved, out)
    assert (saved.req, saved.snapshot, saved.chunk, saved.bytes, saved.files) == (50, task.snapshot, 3, 700, 7)
    stored = SnapshotStore(tmp_path)
    on_disk = msgspec.json.decode((tmp_path / task.snapshot / MANIFEST).read_bytes(), type=Manifest)
    assert on_disk.chunk == 3 and on_disk.identity == job.core.saving.identity and len(on_disk.files) == 7
    assert stored.folder(task.snapshot).is_dir() and sid not in job.core.saving.pending


def test_a_save_that_fails_on_a_rank_lets_the_stream_go_on_and_answers_save_failed(tmp_path: Path) -> None:
    job, sid = save_job(tmp_path)
    job.send(A, p.Save(req=9, session=sid))
    assert job.sent(p.SaveState)  # chunk 1 is decoded: nothing before the boundary is left
    control(job, sid, 2)
    job.answer(p.ConditionChunk, sid, 2)
    job.answer(p.SaveState, ranks=[3], fail="out of host memory")
    assert [t for _, t in job.tasks if isinstance(t, p.DenoiseChunk) and t.index == 2]
    (error,) = [e for e in job.to(A, p.Error) if e.req == 9]
    assert error.code == "save_failed" and "rank 3" in error.message and "out of host memory" in error.message
    job.answer(p.SaveState)  # late answers to a failed save change nothing
    assert not job.to(A, p.Saved)
    (task,) = [t for _, t in job.sent(p.SaveState)][:1]
    # what its ranks wrote is deleted once the last writer is done with the folder (``runtime.late_writes``)
    assert not [o for o in job.log if isinstance(o, DropSnapshotFiles)]
    late = []
    for rank, role in sorted(PARTS - {(3, "denoise")}):
        late += job.step(WorkerSent(written(job, task, rank, role)))
    assert [o.snapshot for o in late if isinstance(o, DropSnapshotFiles)] == [task.snapshot]


def test_a_save_whose_manifest_cannot_be_written_answers_save_failed_and_leaves_no_files(tmp_path: Path) -> None:
    """Without its manifest a save's folder is never a snapshot: its ranks' gigabytes are deleted, not left."""
    job, sid = save_job(tmp_path)
    job.send(A, p.Save(req=11, session=sid))
    task = job.sent(p.SaveState)[-1][1]
    job.answer(p.SaveState)

    def full_disk(manifest: Manifest) -> Path:
        raise OSError(28, "No space left on device")

    job.core.saving.store.write = full_disk  # type: ignore[method-assign]
    out = []
    for rank, role in sorted(PARTS):
        out += job.step(WorkerSent(written(job, task, rank, role)))
    (error,) = [e for e in job.to(A, p.Error, out) if e.req == 11]
    assert error.code == "save_failed" and "No space left" in error.message
    assert [o.snapshot for o in out if isinstance(o, DropSnapshotFiles)] == [task.snapshot]


def test_only_the_owner_saves_and_a_second_save_waits_for_the_first(tmp_path: Path) -> None:
    job, sid = save_job(tmp_path)
    job.send(B, p.Save(req=1, session=sid))
    assert [e.code for e in job.to(B, p.Error)] == ["unknown_session"]
    job.send(A, p.Save(req=2, session=sid))
    job.send(A, p.Save(req=3, session=sid))
    assert [(e.req, e.code) for e in job.to(A, p.Error)] == [(3, "busy")]


def test_a_restore_opens_every_cache_from_the_snapshot_and_continues_its_numbering(tmp_path: Path) -> None:
    job = Job()
    store, snapshot = write_snapshot(tmp_path)
    job.use(store)
    job.send(A, p.Open(req=77, image=b"", restore=snapshot))
    sid = list(job.core.sessions)[-1]
    ((_, init),) = job.sent(p.InitCondition)[-1:]
    assert init.restore == snapshot and init.session == sid and init.image == b""
    job.settle(p.InitCondition, p.InitDecode, p.BroadcastContext, p.InitDenoise)
    assert {t.restore for _, t in job.sent(p.InitDenoise) if t.session == sid} == {snapshot}
    (opened,) = [o for o in job.to(A, p.Opened) if o.req == 77]
    assert (opened.first_chunk, opened.num_chunks) == (3, 8)
    assert [t.index for _, t in job.sent(p.ConditionChunk) if t.session == sid] == [3]
    control(job, sid, 3)
    job.chunk(sid, 3)
    assert [e.facts.index for e in job.emitted(sid)] == [3]


def test_a_restore_of_a_bad_id_or_a_foreign_snapshot_is_refused_and_opens_nothing(tmp_path: Path) -> None:
    job = Job()
    store, snapshot = write_snapshot(tmp_path)
    job.use(store)
    saved = store.read(snapshot)
    store.write(msgspec.structs.replace(saved, identity=msgspec.structs.replace(saved.identity, model="other")))
    _, longer = write_snapshot(tmp_path)
    store.write(msgspec.structs.replace(store.read(longer), num_chunks=10**9))
    before = len(job.core.sessions)
    for bad in ("../x", snapshot, longer):
        job.send(A, p.Open(req=5, image=b"", restore=bad))
    refusals = [e for e in job.to(A, p.Error) if e.req == 5]
    assert [e.code for e in refusals] == ["bad_snapshot"] * 3 and "model 'other' (this server: '')" in \
        refusals[1].message and "at most 100000" in refusals[2].message
    assert len(job.core.sessions) == before


# ---- the synthetic stages


def test_synthetic_stages_restored_from_their_state_produce_the_same_next_chunks() -> None:
    g = synthetic_geometry(32, 48, 2)
    image = torch.randint(0, 255, (40, 60, 3), dtype=torch.uint8)
    spec = SessionSpec("s", 5, "p", image)
    cond, den, dec = SyntheticCondition(g, 0), SyntheticDenoise(g, 0), SyntheticDecode(g, 0)
    context = cond.open(spec)
    den.open(spec, context)
    dec.open(spec)
    control = p.ChunkControl(keys=("w",))
    for i in range(2):
        dec.decode("s", i, den.denoise("s", i, cond.encode("s", i), control))
    states = [snapshot_io.capture(x.state_dict("s")) for x in (cond, den, dec)]
    expected = [dec.decode("s", i, den.denoise("s", i, cond.encode("s", i), control)) for i in (2, 3)]
    fork = SessionSpec("f", 0, "p")
    c2, d2, k2 = SyntheticCondition(g, 0), SyntheticDenoise(g, 0), SyntheticDecode(g, 0)
    ctx2 = c2.load_state(fork, states[0])
    d2.load_state(fork, ctx2, states[1])
    k2.load_state(fork, states[2])
    got = [k2.decode("f", i, d2.denoise("f", i, c2.encode("f", i), control)) for i in (2, 3)]
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


# ---- through the router


def test_the_router_passes_a_save_to_the_sessions_replica_and_its_saved_back_to_the_owner_only() -> None:
    from tests.router_fleet import Fleet

    fleet = Fleet()
    fleet.up("a", "b")
    sid, replica = fleet.open(A)
    fleet.client(B, p.Save(req=3, session=sid))
    assert [e.code for e in fleet.errors(B)] == ["unknown_session"]
    fleet.client(A, p.Save(req=4, session=sid))
    forwarded = [o for o in fleet.to_replica(replica) if isinstance(o.message, p.Save)]
    assert len(forwarded) == 1  # the owner's save, to the session's replica
    saved = p.Saved(req=4, session=sid, snapshot=new_snapshot_id(), chunk=2, bytes=10, pause_s=0.0, write_s=0.0)
    fleet.replica(replica, saved)
    assert fleet.to(A, p.Saved) == [saved] and not fleet.to(B, p.Saved)


def test_a_live_session_restores_with_its_held_keys_at_its_chunk_and_a_fresh_revision_count(tmp_path: Path) -> None:
    job = Job()
    job.use(SnapshotStore(tmp_path))
    sid = job.open(num_chunks=8, live=True)
    job.send(A, p.ControlState(req=next(job.req), session=sid, keys=["w", "j"], revision=7))
    job.chunk(sid, 0)
    job.send(A, p.Save(req=30, session=sid))
    task = job.sent(p.SaveState)[0][1]
    job.answer(p.SaveState)
    for rank, role in sorted(PARTS):
        job.step(WorkerSent(written(job, task, rank, role)))
    saved = SnapshotStore(tmp_path).read(task.snapshot)
    assert saved.live is not None and (saved.live.held, saved.live.revision) == (("j", "w"), 7)
    job.send(A, p.Open(req=31, image=b"", restore=task.snapshot))
    restored = job.core.sessions[list(job.core.sessions)[-1]]
    assert restored.live is not None and restored.live.held == {"j", "w"}
    assert (restored.live.next_index, restored.live.revision) == (saved.chunk, -1)
    job.send(A, p.ControlState(req=next(job.req), session=restored.id, keys=["a"], revision=1))  # counts from 1
    assert not [e for e in job.to(A, p.Error) if e.session == restored.id]


def test_a_saver_whose_writer_is_behind_refuses_the_next_copy_before_it_is_made() -> None:
    import queue
    from types import SimpleNamespace

    from ipc.protocol import Stage
    from ranks.snapshot_saver import MAX_WAITING_WRITES, Saver

    saver = Saver.__new__(Saver)  # no writer thread: only the bound is under test
    saver.ctx, saver.stage, saver._queue = SimpleNamespace(rank=3), Stage.DENOISE, queue.Queue()
    for _ in range(MAX_WAITING_WRITES):
        saver.ensure_room()
        saver._queue.put(("a copy", {}))
    with pytest.raises(SnapshotError, match="rank 3 denoise: 1 snapshot copies still wait for the disk"):
        saver.ensure_room()
