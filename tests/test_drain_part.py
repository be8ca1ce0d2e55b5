"""The drain part (``runtime.drain``) alone: a state machine with ``now`` passed in, no core, no socket."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from ipc import protocol
from ranks.coordinator import Coordinator
from runtime.config import ServerConfig
from runtime.core_types import ClientError, DecodeImage, DrainEnded, ImageDecoded, Tick, WorkerSent
from runtime.drain import FAILED_RETRY_S, RETRY_S, Drain
from runtime.parts import CloseSession, Hold, SaveSession, ToOwner
from runtime.snapshots import MANIFEST
from tests.core_job import A, B, control, image
from tests.test_snapshots import PARTS, save_job, written

OPERATOR = "operator-token-0123456789"


def saved(sid: str, req: int, chunk: int, snapshot: str = "snap") -> protocol.Saved:
    return protocol.Saved(req=req, session=sid, snapshot=snapshot, chunk=chunk, bytes=1, pause_s=0.0, write_s=0.0)


def asked(answers: list) -> dict[str, int]:
    return {a.session: a.req for a in answers if isinstance(a, SaveSession)}


def test_idle_until_started_then_every_open_session_is_saved_once() -> None:
    drain = Drain(drain_s=50.0)
    assert drain.tick(0.0, {}) == [] and not drain.active
    reply = drain.start(["a", "b"], 1.0, req=7)
    assert reply == protocol.Draining(req=7, sessions=2, left_s=50.0)
    first = asked(drain.tick(1.0, {}))
    assert set(first) == {"a", "b"} and all(req < 0 for req in first.values())
    assert asked(drain.tick(1.1, {})) == {}  # in flight: not asked twice
    assert drain.start(["c"], 2.0, req=8).sessions == 2  # a repeat changes nothing


def test_a_saved_session_is_told_only_once_every_chunk_below_its_boundary_left() -> None:
    drain = Drain(drain_s=50.0)
    drain.start(["a"], 0.0)
    req = asked(drain.tick(0.0, {}))["a"]
    answer = saved("a", req, chunk=5)
    assert drain.takes("a", answer) and not drain.takes("a", saved("a", req - 1, 5)) and not drain.takes("b", answer)
    assert drain.answered("a", answer, 0.5) == []
    assert drain.tick(0.6, {"a": 4}) == []  # chunk 4 is still on its way
    out = drain.tick(0.7, {"a": 5})
    assert out == [ToOwner("a", protocol.Draining(session="a", snapshot="snap", chunk=5), b""),
                   CloseSession("a", "drained")]
    assert drain.tick(0.8, {"a": 5}) == []  # told once
    drain.closed("a", 0.9, "drained")
    (end,) = drain.tick(1.0, {})
    assert isinstance(end, DrainEnded) and "every session handed off (1 of 1)" in end.why
    assert drain.tick(1.1, {}) == []  # ended once


def test_a_session_not_ready_or_busy_is_asked_again_later_one_at_its_end_runs_out() -> None:
    drain = Drain(drain_s=50.0)
    drain.start(["opening", "last"], 0.0)
    reqs = asked(drain.tick(0.0, {}))
    drain.refused("opening", ClientError("not_ready", "still opening"), 0.0)
    drain.refused("last", ClientError("bad_request", "nothing left to save"), 0.0)
    assert asked(drain.tick(RETRY_S / 2, {})) == {}
    again = asked(drain.tick(RETRY_S, {}))
    assert set(again) == {"opening"} and again["opening"] != reqs["opening"]
    failed = protocol.Error(req=again["opening"], session="opening", code="save_failed", message="disk full")
    assert drain.takes("opening", failed) and drain.answered("opening", failed, 1.0) == []
    assert asked(drain.tick(1.0 + RETRY_S, {})) == {}  # a failed save (a disk error) is not hammered ...
    retry = asked(drain.tick(1.0 + FAILED_RETRY_S, {}))["opening"]  # ... but tried again a while later
    failed_again = protocol.Error(req=retry, session="opening", code="save_failed", message="disk full")
    # the last try failed: its hold ends, the session streams on here until the drain's end, never asked again
    assert drain.answered("opening", failed_again, 3.0) == [Hold("opening", False)]
    assert asked(drain.tick(10.0, {})) == {}


def test_the_drain_time_running_out_ends_it_with_sessions_still_open() -> None:
    drain = Drain(drain_s=10.0)
    drain.start(["a"], 100.0)
    drain.tick(100.0, {})
    assert drain.reply(3, 104.0).left_s == 6.0
    (end,) = drain.tick(110.0, {})
    assert isinstance(end, DrainEnded) and "1 sessions still open" in end.why


def test_a_restore_that_opens_during_the_drain_is_handed_off_too() -> None:
    drain = Drain(drain_s=50.0)
    drain.opened("before", 0.0)  # not draining yet: nothing kept
    drain.start([], 1.0)
    drain.opened("restored", 1.5)
    assert set(asked(drain.tick(1.5, {}))) == {"restored"}
    assert drain.tick(2.0, {}) == []  # not over while it is open
    drain.closed("restored", 2.5)
    assert isinstance(drain.tick(3.0, {})[0], DrainEnded)


def test_an_open_is_refused_busy_naming_the_drain() -> None:
    refusal = Drain(drain_s=50.0).refusal()
    assert refusal.code == "busy" and "draining" in str(refusal) and refusal.retry_after_s


# ---- the part in the coordinator core, played event by event (``tests.core_job.Job``, no process)


def test_the_core_drains_a_session_holds_its_boundary_hands_it_off_and_ends(tmp_path: Path) -> None:
    job, sid = save_job(tmp_path)  # chunks 0 and 1 streamed; chunk 2 is the next boundary
    job.core.draining.operator_token = OPERATOR
    (reply,) = job.to(B, protocol.Draining, job.send(B, protocol.Drain(req=5, operator=OPERATOR)))
    assert (reply.req, reply.sessions, reply.left_s) == (5, 1, 50.0)
    out = job.send(B, protocol.Open(req=6, image=b"png", num_chunks=4))
    (busy,) = job.to(B, protocol.Error, out)
    assert busy.code == "busy" and "draining" in busy.message and not [o for o in out if isinstance(o, DecodeImage)]
    job.step(Tick())
    (task,) = {t.snapshot: t for _, t in job.sent(protocol.SaveState)}.values()
    assert task.chunk == 2
    control(job, sid, 2)
    job.answer(protocol.ConditionChunk, sid, 2)
    job.answer(protocol.SaveState)
    for rank, role in sorted(PARTS):
        job.step(WorkerSent(written(job, task, rank, role)))
    out = job.step(Tick())
    assert not job.to(A, protocol.Saved), "the drain's save is answered to the drain, never to the client"
    (notice,) = job.to(A, protocol.Draining, out)
    assert (notice.session, notice.snapshot, notice.chunk) == (sid, task.snapshot, 2)
    assert 2 not in [t.index for _, t in job.sent(protocol.DenoiseChunk)], \
        "the boundary chunk is computed on the server that restores it, never twice"
    job.settle(protocol.ConditionChunk, protocol.Release)  # what runs ends, then its caches are released
    (closed,) = job.to(A, protocol.Closed)
    assert closed.reason == "drained"
    (end,) = [o for o in job.step(Tick()) if isinstance(o, DrainEnded)]
    assert "every session handed off (1 of 1)" in end.why
    assert (tmp_path / task.snapshot / MANIFEST).is_file()  # kept for its restore elsewhere (the budget's to delete)


def test_the_first_stop_signal_drains_a_second_stops_at_once_as_does_one_without_a_drain_time_or_a_loop() -> None:
    def shell(drain_s: float, core: object = "serving") -> SimpleNamespace:  # what ``signalled`` reads and sets
        if core == "serving":
            core = SimpleNamespace(draining=SimpleNamespace(active=False))
        return SimpleNamespace(drain_asked=False, stopping=False, server=ServerConfig(drain_s=drain_s), core=core)

    rank0 = shell(50.0)
    assert Coordinator.signalled(rank0).startswith("draining")  # type: ignore[arg-type]
    assert rank0.drain_asked and not rank0.stopping
    assert Coordinator.signalled(rank0) == "stopping" and rank0.stopping  # type: ignore[arg-type]
    draining = shell(50.0, core=SimpleNamespace(draining=SimpleNamespace(active=True)))  # an operator's drain
    for stops in (shell(0.0), shell(50.0, core=None), draining):  # no drain time; still warming up; draining
        assert Coordinator.signalled(stops) == "stopping" and stops.stopping  # type: ignore[arg-type]


def test_an_open_asked_before_the_drain_whose_image_decodes_after_is_refused_busy(tmp_path: Path) -> None:
    job, _ = save_job(tmp_path)
    (decode,) = [o for o in job.send(B, protocol.Open(req=6, image=b"png", num_chunks=4)) if isinstance(o, DecodeImage)]
    job.core.draining.operator_token = OPERATOR
    job.send(A, protocol.Drain(req=7, operator=OPERATOR))
    before = set(job.core.sessions)
    (busy,) = job.to(B, protocol.Error, job.step(ImageDecoded(decode.ticket, image())))
    assert busy.req == 6 and busy.code == "busy" and "draining" in busy.message
    assert set(job.core.sessions) == before, "no session is created on a draining server"


def test_a_drain_request_without_the_operator_token_is_refused_unauthorized_and_changes_nothing(
        tmp_path: Path) -> None:
    job, sid = save_job(tmp_path)
    for token in (None, OPERATOR):  # a server with no operator token drains on a stop signal only
        job.core.draining.operator_token = token
        for operator in ({}, {"operator": "wrong"}, {"operator": OPERATOR[:-1]}, {"operator": OPERATOR + "x"}):
            if token is None and operator:
                operator = {"operator": OPERATOR}
            (refused,) = job.to(B, protocol.Error, job.send(B, protocol.Drain(req=9, **operator)))
            assert (refused.req, refused.code, refused.message) == (9, "unauthorized", "unauthorized")
            assert not job.core.draining.active and not job.to(A, protocol.Draining, job.step(Tick()))
    assert sid in job.core.sessions


def test_after_a_failed_drain_save_a_later_save_of_the_session_lets_its_hold_go(tmp_path: Path) -> None:
    job, sid = save_job(tmp_path)
    saves, session, scheduler = job.core.saving, job.core.sessions[sid], job.core.scheduler
    state, chunk = scheduler.session_state(sid), scheduler.next_denoise_index(sid)
    saves.save(session, A, protocol.Save(req=-1, session=sid), state, chunk, None, 4, 0.0, last=True)
    assert Hold(sid, False) not in saves.advance(sid, session, True, 0.0)  # the drain's: its boundary stays held
    saves.failed(saves.pending[sid], "disk full", 0.5)
    saves.save(session, A, protocol.Save(req=5, session=sid), state, chunk, None, 4, 1.0)  # its client's own
    assert Hold(sid, False) in saves.advance(sid, session, True, 1.0), "a client's save never freezes the stream"
