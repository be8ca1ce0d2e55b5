"""The coordinator core without processes, when things go wrong or end: stage and rank failures, clients gone or
slow, shutdown, stats, closing twice, and the per-session settings (camera, steps, real time). Harness:
``tests.core_job``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ipc import protocol as p
from models.camera import intrinsics_at
from runtime.clients import MAX_PEERS
from runtime.core_types import (
    EXIT_FAILED,
    EXIT_OK,
    ClientUnreachable,
    ClientUnreadable,
    DecodeImage,
    FramesMissing,
    ImageDecoded,
    MemorySampled,
    RankLost,
    ShutdownRequested,
    Stop,
    Tick,
    WorkerSent,
)
from runtime.memory_admission import MemoryAdmission
from tests.core_job import A, B, Job, control, errors, image


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
