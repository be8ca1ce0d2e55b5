"""A replica's chunk indices checked by the router core (``runtime.chunk_claims``), without processes: one wrong
``saved.chunk`` or ``opened.first_chunk`` (2**63, or merely not what the router saw) never pins a session's
snapshot or its resume index."""

from __future__ import annotations

import msgspec

from ipc import protocol as p
from runtime.chunk_claims import MAX_AHEAD
from tests.router_fleet import A, opened
from tests.test_router_migration import SNAP1, SNAP2, chunks, fleet, restore, saved, saves, snapshotted

SNAP3 = "u" * 22


def test_a_save_boundary_past_what_the_session_streamed_is_not_kept_and_the_next_true_save_is() -> None:
    f = fleet(every=2, listed={"a": 4, "b": 4})
    sid, name = f.open(A)
    snapshotted(f, name, sid, at=2, snapshot=SNAP1)
    session = f.core.sessions[sid]
    chunks(f, name, sid, range(2, 4))
    f.replica(name, saved(saves(f, name)[-1].req, sid, SNAP2, 2**63))  # the router's own save, answered wrongly
    assert (session.migration.snapshot, session.migration.snapshot_chunk) == (SNAP1, 2)
    chunks(f, name, sid, range(4, 6))
    f.replica(name, saved(saves(f, name)[-1].req, sid, SNAP3, 5))  # the next one, right: kept (nothing pinned)
    assert (session.migration.snapshot, session.migration.snapshot_chunk) == (SNAP3, 5)


def test_a_clients_own_save_with_a_boundary_far_ahead_or_behind_is_forwarded_but_not_a_place_to_resume() -> None:
    f = fleet(every=0)
    sid, name = f.open(A)
    chunks(f, name, sid, range(3))
    for req, at in ((70, 3 + MAX_AHEAD + 1), (71, -1)):
        f.client(A, p.Save(req=req, session=sid))
        f.replica(name, saved(req, sid, SNAP2, at))
    assert [m.req for m in f.to(A, p.Saved)] == [70, 71]  # the client hears its replica as it answered
    assert f.core.sessions[sid].migration.snapshot is None
    f.client(A, p.Save(req=72, session=sid))
    f.replica(name, saved(72, sid, SNAP3, 3 + 2))  # a boundary a few chunks ahead of the stream is normal
    assert f.core.sessions[sid].migration.snapshot == SNAP3


def test_a_restore_that_starts_elsewhere_than_its_snapshot_ends_the_migration_and_pins_no_resume_index() -> None:
    f = fleet(every=2)
    sid, name = f.open(A)
    snapshotted(f, name, sid, at=2)
    f.replica(name, p.Error(code="rank_failed", message="rank 3 died"))
    sent = restore(f)
    f.clear()
    f.replica(sent.replica, msgspec.structs.replace(opened(sent.message.req, "0000000000ff"), first_chunk=2**63))
    assert not f.to(A, p.Migrated)
    (closed,) = f.to(A, p.Closed)
    assert closed.reason == "failed" and closed.error is not None and "snapshot was of chunk 2" in closed.error
    assert [o.message.session for o in f.to_replica(sent.replica, p.Close)] == ["0000000000ff"]  # type: ignore[union-attr]
    assert sid not in f.core.sessions


def test_a_new_session_said_to_start_past_chunk_zero_is_refused_and_closed_on_its_replica() -> None:
    f = fleet(every=2)
    f.client(A, p.Open(req=5, image=b"png", num_chunks=8))
    sent = f.sent_open()
    f.replica(sent.replica, msgspec.structs.replace(opened(sent.message.req, "0000000000aa"), first_chunk=2**63))
    assert [(e.req, e.code) for e in f.errors(A)] == [(5, "failed")] and not f.to(A, p.Opened)
    assert [o.message.session for o in f.to_replica(sent.replica, p.Close)] == ["0000000000aa"]  # type: ignore[union-attr]
    assert not f.core.sessions
