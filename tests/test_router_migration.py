"""The router core's snapshots and migration without processes (``router.snapshot_every``): the save cadence, the
router's own ``saved`` replies kept, a session restored on a survivor under the id its client knows, the
``migrated`` notice, controls below the resume chunk, and a session without a snapshot ending as before."""

from __future__ import annotations

import asyncio
import queue
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq

from ipc import protocol as p
from ipc.aio_client import AsyncClient
from ipc.client import Client, ClientCore, ServerError, SessionMigrated
from runtime.migration import renamed
from runtime.router_migration import MAX_PROMPTS_ASKED
from runtime.router_types import (
    ChunkHead,
    DropSnapshot,
    ReplicaRefused,
    ReplicaSent,
    SessionOrigin,
    ShutdownRequested,
    Tick,
    ToReplica,
    ToWatchers,
)
from tests.router_fleet import A, Fleet, chunk, opened, stats_of

SNAP1, SNAP2 = "s" * 22, "t" * 22
MOVED = "0000000000ff"  # the restored session's id on its new replica


def fleet(every: int = 2, listed: dict[str, int] | None = None) -> Fleet:
    f = Fleet(listed, snapshot_every=every)
    f.up(*f.core.replicas)
    return f


def chunks(f: Fleet, name: str, sid: str, indices: range) -> None:
    for i in indices:
        f.replica(name, chunk(sid, i))


def saves(f: Fleet, name: str) -> list[p.Save]:
    return [o.message for o in f.to_replica(name, p.Save) if isinstance(o.message, p.Save)]


def saved(req: int, sid: str, snapshot: str, at: int) -> p.Saved:
    return p.Saved(req=req, session=sid, snapshot=snapshot, chunk=at, bytes=100, pause_s=0.001, write_s=0.01)


def snapshotted(f: Fleet, name: str, sid: str, at: int = 2, snapshot: str = SNAP1) -> None:
    """Chunks up to the router's first save; the replica answers it with a snapshot at chunk ``at``."""
    chunks(f, name, sid, range(2))
    (save,) = saves(f, name)
    f.replica(name, saved(save.req, sid, snapshot, at))


def restore(f: Fleet) -> ToReplica:
    sent = f.sent_open()
    assert isinstance(sent.message, p.Open) and sent.message.restore is not None
    return sent


def migrated(f: Fleet, sid: str, dead: str, at: int = 2) -> str:
    """The replica ``dead`` fails; the router's restore opens on the survivor as ``MOVED``; its name."""
    f.replica(dead, p.Error(code="rank_failed", message="rank 3 died"))
    sent = restore(f)
    f.replica(sent.replica, msgspec.structs.replace(opened(sent.message.req, MOVED), first_chunk=at))
    return sent.replica


def decoded(o: Any) -> Any:
    return p.decode(o, "server") if isinstance(o, bytes) else o


def test_the_router_saves_each_session_every_k_chunks_one_at_a_time_and_keeps_its_replies() -> None:
    f = fleet(every=2)
    sid, name = f.open(A)
    chunks(f, name, sid, range(1))
    assert not saves(f, name)
    chunks(f, name, sid, range(1, 2))
    (save,) = saves(f, name)
    assert save.session == sid
    chunks(f, name, sid, range(2, 6))  # the save is in flight: no second one
    assert len(saves(f, name)) == 1
    f.clear()
    f.replica(name, saved(save.req, sid, SNAP1, 3))
    assert not f.to(A, p.Saved)  # the router's own: never forwarded
    assert f.core.sessions[sid].migration.snapshot == SNAP1 and f.core.sessions[sid].migration.snapshot_chunk == 3
    chunks(f, name, sid, range(6, 8))
    assert len(saves(f, name)) == 1 and f.core.stats(A, f.now).router.autosaves == 1


def test_a_clients_own_save_is_forwarded_and_answered_to_it() -> None:
    f = fleet(every=4)
    sid, name = f.open(A)
    f.client(A, p.Save(req=77, session=sid))
    f.replica(name, saved(f.to_replica(name, p.Save)[-1].origin.req, sid, SNAP2, 1))  # type: ignore[union-attr]
    (reply,) = f.to(A, p.Saved)
    assert reply.req == 77 and reply.snapshot == SNAP2
    assert f.core.sessions[sid].migration.snapshot == SNAP2  # a place to resume from too


def test_no_save_is_asked_with_snapshot_every_off() -> None:
    f = fleet(every=0)
    sid, name = f.open(A)
    chunks(f, name, sid, range(8))
    assert not saves(f, name)


def test_a_router_save_that_fails_or_meets_a_full_link_is_the_routers_and_is_tried_again() -> None:
    f = fleet(every=2)
    sid, name = f.open(A)
    chunks(f, name, sid, range(2))
    (save,) = saves(f, name)
    f.replica(name, p.Error(req=save.req, session=sid, code="busy", message="one save at a time"))
    assert not f.errors(A) and f.core.sessions[sid].migration.autosave is None
    chunks(f, name, sid, range(2, 4))
    retry = saves(f, name)[-1]
    f.step(ReplicaRefused(name, f.generation[name], SessionOrigin(A, retry.req, sid, "autosave")))
    assert not f.errors(A)
    chunks(f, name, sid, range(4, 5))  # at once at the next chunk
    assert len(saves(f, name)) == 3


def test_a_session_with_a_snapshot_moves_to_a_survivor_under_its_id_and_its_client_is_told() -> None:
    f = fleet(every=2)
    sid, name = f.open(A)
    snapshotted(f, name, sid, at=2)
    chunks(f, name, sid, range(2, 4))
    f.clear()
    f.replica(name, p.Error(code="rank_failed", message="rank 3 died"))
    assert not f.errors(A) and not f.to(A, p.Closed)  # not lost
    sent = restore(f)
    assert sent.replica != name and sent.message.restore == SNAP1 and sent.message.image == b""
    f.replica(sent.replica, msgspec.structs.replace(opened(sent.message.req, MOVED), first_chunk=2))
    (notice,) = f.to(A, p.Migrated)
    assert (notice.session, notice.chunk, notice.replica) == (sid, 2, sent.replica)
    assert f.core.stats(A, f.now).router.migrations == 1

    f.clear()  # its chunks come again from the snapshot's chunk, under the id the client knows
    f.step(ReplicaSent(sent.replica, f.generation[sent.replica], ChunkHead(MOVED), p.encode(chunk(MOVED, 2))))
    (got,) = f.to(A, p.Chunk)
    assert got.session == sid and got.facts.index == 2 and got.frames == chunk(sid, 2).frames


def test_a_migrated_sessions_watchers_are_told_where_its_chunks_come_again_from() -> None:
    f = fleet(every=2)
    sid, name = f.open(A)
    watcher = b"watcher"
    f.client(watcher, p.Watch(req=1, session=sid, token=f.core.watchers.tokens[sid]))
    snapshotted(f, name, sid)
    f.clear()
    survivor = migrated(f, sid, name)
    (told,) = [o for o in f.log if isinstance(o, ToWatchers) and isinstance(o.payload, p.Migrated)]
    assert told.watchers == (watcher,) and (told.payload.chunk, told.payload.replica) == (2, survivor)


def test_requests_the_dead_replica_never_answered_are_answered_when_the_session_moves() -> None:
    f = fleet(every=2)
    sid, name = f.open(A)
    snapshotted(f, name, sid)
    f.client(A, p.Control(req=20, session=sid, index=2))
    f.replica(name, p.Accepted(req=20, session=sid, index=2))  # answered: nothing to say for it later
    f.client(A, p.Save(req=21, session=sid))
    f.client(A, p.SetPrompt(req=22, session=sid, prompt="a canyon"))
    f.client(A, p.Control(req=23, session=sid, index=3))
    f.clear()
    f.replica(name, p.Error(code="rank_failed", message="rank 3 died"))
    answered = {e.req: e.code for e in f.errors(A)}
    assert answered == {21: "busy", 22: "prompt_backpressure", 23: "control_backpressure"}, answered
    assert all(e.retry_after_s and e.session == sid for e in f.errors(A))


def test_a_migrated_sessions_messages_are_renamed_both_ways() -> None:
    f = fleet(every=2)
    sid, name = f.open(A)
    snapshotted(f, name, sid)
    survivor = migrated(f, sid, name)
    f.clear()
    f.client(A, p.Control(req=9, session=sid, index=2))
    (sent,) = f.to_replica(survivor, p.Control)
    assert isinstance(sent.message, p.Control) and sent.message.session == MOVED and sent.message.index == 2
    f.replica(survivor, p.Accepted(req=9, session=MOVED, index=2))
    assert [(m.req, m.session) for m in f.to(A, p.Accepted)] == [(9, sid)]
    f.client(A, p.ControlState(req=10, session=sid, keys=["w"], revision=1))
    assert f.to_replica(survivor, p.ControlState)[-1].message.session == MOVED  # type: ignore[union-attr]
    f.client(A, p.Close(req=11, session=sid))
    assert f.to_replica(survivor, p.Close)[-1].message.session == MOVED  # type: ignore[union-attr]
    f.replica(survivor, p.Closed(session=MOVED, reason="client"))
    assert [m.session for m in f.to(A, p.Closed)] == [sid]
    assert not f.core.sessions and not f.core.migration.aliases


def test_a_control_below_the_resume_chunk_is_refused_clearly() -> None:
    f = fleet(every=2)
    sid, name = f.open(A)
    snapshotted(f, name, sid, at=2)
    survivor = migrated(f, sid, name, at=2)
    f.clear()
    f.client(A, p.Control(req=5, session=sid, index=1))
    (error,) = f.errors(A)
    assert error.code == "rejected_control" and error.req == 5 and error.session == sid
    assert "resumed from its snapshot at chunk 2" in error.message and "from index 2" in error.message
    assert not f.to_replica(survivor, p.Control)


def test_input_while_the_restore_is_on_its_way_waits_or_is_refused_with_a_retry_hint() -> None:
    f = fleet(every=2)
    sid, name = f.open(A)
    snapshotted(f, name, sid)
    f.replica(name, p.Error(code="rank_failed", message="rank 3 died"))
    sent = restore(f)
    f.client(A, p.Control(req=5, session=sid, index=2))
    (error,) = f.errors(A)
    assert error.code == "control_backpressure" and error.retry_after_s is not None
    f.client(A, p.ControlState(req=6, session=sid, keys=["w"], revision=3))
    assert not f.to_replica(sent.replica, p.ControlState)  # kept
    f.replica(sent.replica, msgspec.structs.replace(opened(sent.message.req, MOVED), first_chunk=2))
    (state,) = [o.message for o in f.to_replica(sent.replica, p.ControlState)]
    assert isinstance(state, p.ControlState) and state.session == MOVED and state.revision == 3


def test_the_restore_goes_where_placement_says_never_to_the_dead_replica() -> None:
    f = fleet(every=2, listed={"a": 2, "b": 1, "c": 2})
    f.answer_stats("b", stats_of(open_sessions=1))  # a direct client fills b
    sid, name = f.open(A)
    assert name == "a"
    snapshotted(f, name, sid)
    assert migrated(f, sid, name) == "c"  # a is down and b is full


def test_a_session_without_a_snapshot_ends_as_before() -> None:
    f = fleet(every=4)
    sid, name = f.open(A)
    chunks(f, name, sid, range(3))  # no save asked yet
    f.clear()
    f.replica(name, p.Error(code="rank_failed", message="rank 3 died"))
    (error,) = f.errors(A)
    assert error.code == "rank_failed" and error.session == sid and "sessions are lost" in error.message
    (closed,) = f.to(A, p.Closed)
    assert closed.reason == "failed"
    assert not [o for o in f.log if isinstance(o, ToReplica) and isinstance(o.message, p.Open)]


def test_a_session_whose_restore_is_refused_ends_with_the_reason() -> None:
    f = fleet(every=2)
    sid, name = f.open(A)
    snapshotted(f, name, sid)
    f.clear()
    f.replica(name, p.Error(code="rank_failed", message="rank 3 died"))
    sent = restore(f)
    f.replica(sent.replica, p.Error(req=sent.message.req, code="bad_snapshot", message="model differs"))
    (error,) = f.errors(A)
    assert error.code == "rank_failed" and error.session == sid and "bad_snapshot: model differs" in error.message
    assert [c.reason for c in f.to(A, p.Closed)] == ["failed"] and not f.core.sessions


def prompts_to(f: Fleet, name: str) -> list[p.SetPrompt]:
    return [decoded(o.message) for o in f.to_replica(name, p.SetPrompt) if isinstance(decoded(o.message), p.SetPrompt)]


def moved_after_a_prompt(text: str) -> tuple[Fleet, str, str, p.SetPrompt]:
    """A session whose replica scheduled ``text`` from chunk 5, moved from its snapshot of chunk 2: the fleet, its
    id, its new replica and the router's own set_prompt of ``text`` there."""
    f = fleet(every=2, listed={"a": 2, "b": 2, "c": 2})
    sid, name = f.open(A)
    snapshotted(f, name, sid, at=2)
    f.client(A, p.SetPrompt(req=30, session=sid, prompt=text))
    f.replica(name, p.PromptScheduled(req=30, session=sid, revision=1, chunk=5))
    survivor = migrated(f, sid, name, at=2)
    (replay,) = prompts_to(f, survivor)
    return f, sid, survivor, replay


def test_a_prompt_scheduled_after_the_snapshot_is_set_again_on_the_new_replica_once_its_restore_opened() -> None:
    f = fleet(every=2)
    sid, name = f.open(A)
    snapshotted(f, name, sid, at=2)
    f.client(A, p.SetPrompt(req=30, session=sid, prompt="a canyon at dusk"))
    f.replica(name, p.PromptScheduled(req=30, session=sid, revision=1, chunk=3))  # after the snapshot's chunk 2
    assert [(m.req, m.revision) for m in f.to(A, p.PromptScheduled)] == [(30, 1)]
    f.clear()
    f.replica(name, p.Error(code="rank_failed", message="rank 3 died"))
    sent = restore(f)
    assert not prompts_to(f, sent.replica)  # not before its restore opened
    f.replica(sent.replica, msgspec.structs.replace(opened(sent.message.req, MOVED), first_chunk=2))
    (replay,) = prompts_to(f, sent.replica)
    assert (replay.session, replay.prompt) == (MOVED, "a canyon at dusk") and replay.req < 0

    f.replica(sent.replica, p.PromptScheduled(req=replay.req, session=MOVED, revision=1, chunk=3))
    assert [m.req for m in f.to(A, p.PromptScheduled)] == [] and not f.errors(A)  # the router's own answer
    prompt = f.core.sessions[sid].migration.prompt
    assert prompt is not None and prompt.chunk == 3
    f.client(A, p.SetPrompt(req=31, session=sid, prompt="a storm"))  # the client's own still reach it
    f.replica(sent.replica, p.PromptScheduled(req=31, session=MOVED, revision=2, chunk=4))
    assert [(m.req, m.session) for m in f.to(A, p.PromptScheduled)] == [(31, sid)]
    assert not f.core.sessions[sid].migration.asked and not f.core.sessions[sid].migration.prompts_asked


def test_a_prompt_scheduled_at_or_before_the_snapshots_chunk_is_in_it_and_not_set_again() -> None:
    f = fleet(every=2)
    sid, name = f.open(A)
    f.client(A, p.SetPrompt(req=30, session=sid, prompt="a canyon at dusk"))
    f.replica(name, p.PromptScheduled(req=30, session=sid, revision=1, chunk=2))
    snapshotted(f, name, sid, at=2)  # its boundary chunk uses the prompt: the snapshot holds it
    survivor = migrated(f, sid, name, at=2)
    assert [m.session for m in f.to(A, p.Migrated)] == [sid] and not prompts_to(f, survivor)


def test_the_routers_own_prompt_meeting_a_full_link_is_sent_again_and_its_refusal_reaches_no_client() -> None:
    f, sid, survivor, replay = moved_after_a_prompt("a canyon at dusk")
    f.step(ReplicaRefused(survivor, f.generation[survivor], SessionOrigin(A, replay.req, sid, "replay_prompt")))
    assert not f.errors(A)
    f.step(Tick())
    again = prompts_to(f, survivor)[-1]
    assert len(prompts_to(f, survivor)) == 2 and again.prompt == "a canyon at dusk"

    f.clear()  # its new replica dies before answering it: the next one gets it too
    f.replica(survivor, p.Error(code="rank_failed", message="rank 1 died"))
    sent = restore(f)
    f.replica(sent.replica, msgspec.structs.replace(opened(sent.message.req, "0000000000ee"), first_chunk=2))
    (third,) = prompts_to(f, sent.replica)
    assert third.prompt == "a canyon at dusk"
    f.replica(sent.replica, p.Error(req=third.req, session="0000000000ee", code="prompt_failed", message="encode"))
    assert not f.errors(A) and f.core.sessions[sid].migration.prompt is None  # it goes on with its snapshot's prompt


def test_a_replay_waiting_for_a_full_link_never_follows_the_clients_newer_prompt() -> None:
    f, sid, survivor, replay = moved_after_a_prompt("old")
    f.step(ReplicaRefused(survivor, f.generation[survivor], SessionOrigin(A, replay.req, sid, "replay_prompt")))
    f.client(A, p.SetPrompt(req=31, session=sid, prompt="new"))  # the client's own, after the move
    f.step(Tick())  # the link drained: the old text must not be sent after the new one
    assert [m.prompt for m in prompts_to(f, survivor)] == ["old", "new"]


def test_a_replay_the_new_replica_cannot_take_now_is_sent_again_not_given_up() -> None:
    f, sid, survivor, replay = moved_after_a_prompt("a canyon at dusk")
    rid = f.core.sessions[sid].rid
    f.replica(survivor, p.Error(req=replay.req, session=rid, code="prompt_backpressure", message="4 wait"))
    f.step(Tick())
    assert [m.prompt for m in prompts_to(f, survivor)] == ["a canyon at dusk"] * 2 and not f.errors(A)


def test_a_prompt_whose_text_the_router_forgot_is_never_replaced_by_an_older_one() -> None:
    f = fleet(every=2)
    sid, name = f.open(A)
    snapshotted(f, name, sid, at=2)
    f.client(A, p.SetPrompt(req=30, session=sid, prompt="a canyon at dusk"))
    f.replica(name, p.PromptScheduled(req=30, session=sid, revision=1, chunk=3))
    for req in range(40, 40 + MAX_PROMPTS_ASKED + 1):  # the first of them is forgotten, and scheduled
        f.client(A, p.SetPrompt(req=req, session=sid, prompt=f"prompt {req}"))
    f.replica(name, p.PromptScheduled(req=40, session=sid, revision=2, chunk=4))
    assert [m.req for m in f.to(A, p.PromptScheduled)] == [30, 40]
    survivor = migrated(f, sid, name, at=2)
    assert not prompts_to(f, survivor)  # not "a canyon at dusk": revision 2 replaced it


def test_a_chunk_is_renamed_in_its_head_only() -> None:
    data = p.encode(chunk("0000000000aa", 5))
    out = renamed(data, "0000000000aa", "0000000000bb")
    assert p.decode(out, "server") == chunk("0000000000bb", 5)
    assert len(out) == len(data) and out[-12:] == data[-12:]


def test_the_clients_answers_are_never_taken_for_the_routers_save_whatever_its_request_ids() -> None:
    f = fleet(every=2)
    sid, name = f.open(A)
    chunks(f, name, sid, range(2))
    (save,) = saves(f, name)
    f.client(A, p.Control(req=abs(save.req), session=sid, index=2))
    f.replica(name, p.Error(req=abs(save.req), session=sid, code="control_backpressure", message="full"))
    assert [e.code for e in f.errors(A)] == ["control_backpressure"]  # the client's, forwarded
    f.replica(name, saved(save.req, sid, SNAP1, 2))
    assert not f.to(A, p.Saved) and f.core.sessions[sid].migration.snapshot == SNAP1


def test_a_client_request_with_a_negative_id_is_refused_and_never_reaches_a_replica() -> None:
    """Negative request ids are the router's own (its saves, its prompts after a migration): a client's could have
    its answer taken for the router's, so it is refused at the door."""
    f = fleet(every=2)
    sid, name = f.open(A)
    before = len(f.to_replica(name, p.Save))
    f.client(A, p.Save(req=-1, session=sid))
    f.client(A, p.SetPrompt(req=-2, session=sid, prompt="night"))
    assert [(e.code, e.req) for e in f.errors(A)] == [("bad_request", -1), ("bad_request", -2)]
    assert len(f.to_replica(name, p.Save)) == before and not prompts_to(f, name)


def test_with_snapshots_dir_the_routers_superseded_snapshots_and_those_of_ended_sessions_are_deleted() -> None:
    f = Fleet(None, snapshot_every=2, snapshots_dir="/shared/snapshots")
    f.up("a", "b")
    sid, name = f.open(A)
    snapshotted(f, name, sid, snapshot=SNAP1)
    assert not [o for o in f.log if isinstance(o, DropSnapshot)]
    chunks(f, name, sid, range(2, 4))
    f.replica(name, saved(saves(f, name)[-1].req, sid, SNAP2, 4))
    f.client(A, p.Save(req=5, session=sid))  # the client's own: never deleted
    f.replica(name, saved(5, sid, "c" * 22, 5))
    f.replica(name, p.Closed(session=sid, reason="complete"))
    assert [o.snapshot for o in f.log if isinstance(o, DropSnapshot)] == [SNAP1, SNAP2]


def test_without_snapshots_dir_nothing_is_deleted() -> None:
    f = fleet(every=2)
    sid, name = f.open(A)
    snapshotted(f, name, sid)
    f.replica(name, p.Closed(session=sid, reason="complete"))
    assert not [o for o in f.log if isinstance(o, DropSnapshot)]


def test_a_routers_save_answered_after_its_session_ended_is_deleted_and_reaches_nobody() -> None:
    f = Fleet(None, snapshot_every=2, snapshots_dir="/shared/snapshots")
    f.up("a", "b")
    sid, name = f.open(A)
    chunks(f, name, sid, range(2))
    (save,) = saves(f, name)
    f.replica(name, p.Closed(session=sid, reason="complete"))
    f.replica(name, saved(save.req, sid, SNAP1, 2))
    assert not f.to(A, p.Saved) and [o.snapshot for o in f.log if isinstance(o, DropSnapshot)] == [SNAP1]


def test_the_sdk_raises_session_migrated_once_and_marks_the_first_chunk_after_it() -> None:
    errors: list[ServerError] = []
    core: ClientCore[queue.Queue[Any], Future[Any]] = ClientCore(queue.Queue, errors.append)
    sid = "0000000000aa"
    core.route(p.encode(chunk(sid, 5)))
    core.route(p.encode(p.Migrated(session=sid, chunk=4, replica="b")))
    core.route(p.encode(chunk(sid, 4)))
    events = core.session(sid).events
    first, notice, again = events.get_nowait(), events.get_nowait(), events.get_nowait()
    assert first.index == 5 and first.migrated is None
    assert isinstance(notice, SessionMigrated) and (notice.chunk, notice.replica, notice.session) == (4, "b", sid)
    assert again.index == 4 and again.migrated == p.Migrated(session=sid, chunk=4, replica="b")
    assert not errors  # a notice, not an error


def test_the_sdks_chunk_iterator_goes_on_after_a_migration() -> None:
    with zmq.Context() as context, context.socket(zmq.ROUTER) as server:  # a server on loopback, played here
        port = server.bind_to_random_port("tcp://127.0.0.1")
        with Client(f"tcp://127.0.0.1:{port}", identity=b"player", timeout_s=5) as client:
            assert server.poll(5000) and server.recv_multipart()[0] == b"player"  # its first heartbeat
            sid = "0000000000aa"
            for message in (chunk(sid, 3), p.Migrated(session=sid, chunk=2, replica="b"), chunk(sid, 2),
                            chunk(sid, 3), p.Closed(session=sid, reason="complete")):
                server.send_multipart([b"player", p.encode(message)])
            moves: list[int] = []
            got = list(client.chunks(sid, on_migrated=lambda m: moves.append(m.chunk)))
            assert [c.index for c in got] == [3, 2, 3] and moves == [2] and got[1].migrated is not None


def test_a_session_being_restored_when_the_router_stops_is_told_shutdown() -> None:
    f = fleet(every=2)
    sid, name = f.open(A)
    snapshotted(f, name, sid)
    f.replica(name, p.Error(code="rank_failed", message="rank 3 died"))
    f.clear()
    f.step(ShutdownRequested())
    assert [(c.session, c.reason) for c in f.to(A, p.Closed)] == [(sid, "shutdown")]


def test_the_async_sdks_chunk_iterator_goes_on_after_a_migration() -> None:
    async def play(port: int, server: zmq.Socket) -> tuple[list[int], list[int]]:
        async with AsyncClient(f"tcp://127.0.0.1:{port}", identity=b"player", timeout_s=5) as client:
            assert await asyncio.to_thread(server.poll, 5000)  # its first heartbeat
            server.recv_multipart()
            sid = "0000000000aa"
            for message in (chunk(sid, 3), p.Migrated(session=sid, chunk=2, replica="b"), chunk(sid, 2),
                            p.Closed(session=sid, reason="complete")):
                server.send_multipart([b"player", p.encode(message)])
            moves: list[int] = []

            async def moved(m: SessionMigrated) -> None:
                moves.append(m.chunk)

            return [c.index async for c in client.chunks(sid, on_migrated=moved)], moves

    with zmq.Context() as context, context.socket(zmq.ROUTER) as server:
        port = server.bind_to_random_port("tcp://127.0.0.1")
        assert asyncio.run(play(port, server)) == ([3, 2], [2])
