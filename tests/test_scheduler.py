"""Scheduler unit tests: each test plays the roles by feeding events and checks the actions (one rule per test)."""

from __future__ import annotations

import pytest

from runtime.scheduler import (
    PREFETCH_DEPTH,
    TRANSITIONS,
    Action,
    AdmissionError,
    Capacities,
    DitIdle,
    Emit,
    IllegalEvent,
    InitCache,
    Mode,
    Release,
    RunChunk,
    Scheduler,
    SessionClosed,
    SessionEvent,
    SessionFailed,
    SessionIdTaken,
    SessionReady,
    SessionState,
    Stage,
    UnknownSession,
)


class Roles:
    """Plays the three roles: remembers the one task each runs (from the actions) and completes it on demand."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.running: dict[Stage, Action] = {}
        self.log: list[Action] = []
        self.now = 0.0

    def feed(self, actions: list[Action]) -> list[Action]:
        for a in actions:
            self.log.append(a)
            stage = a.stage if isinstance(a, (InitCache, Release, RunChunk)) else None
            if stage is not None:
                assert stage not in self.running, f"{stage} got {a} while running {self.running[stage]}"
                self.running[stage] = a
        return actions

    def tick(self, dt: float = 1.0) -> float:
        self.now += dt
        return self.now

    def open(self, session: str, num_chunks: int | None) -> list[Action]:
        return self.feed(self.sched.open(session, num_chunks, self.tick()))

    def control(self, session: str, index: int) -> list[Action]:
        return self.feed(self.sched.submit_control(session, index, self.tick()))

    def close(self, session: str, reason: str = "client") -> list[Action]:
        return self.feed(self.sched.close(session, reason, self.tick()))

    def finish(self, stage: Stage, ok: bool = True, dt: float = 1.0) -> list[Action]:
        """Complete the task running on ``stage`` (``ok=False``: it fails)."""
        a = self.running.pop(stage)
        now = self.tick(dt)
        s = self.sched
        if isinstance(a, Release):
            return self.feed(s.release_done(a.session, a.stage, ok, now, None if ok else "boom"))
        if not ok:
            index = None if isinstance(a, InitCache) else a.index
            return self.feed(s.stage_failed(a.session, stage, index, "boom", now))
        if isinstance(a, InitCache):
            return self.feed(s.init_done(a.session, a.stage, now))
        return self.feed(s.chunk_done(a.session, stage, a.index, now))

    def ready(self, session: str, num_chunks: int | None = 4) -> list[Action]:
        """Open ``session`` and run its three cache inits; returns every action since the open."""
        out = self.open(session, num_chunks)
        while not any(isinstance(a, SessionReady) and a.session == session for a in out):
            mine = [a.stage for a in self.running.values() if isinstance(a, InitCache) and a.session == session]
            out += self.finish(mine[0] if mine else next(iter(self.running)))
        return out

    def run_until_idle(self, session_controls: dict[str, int] | None = None, limit: int = 10_000) -> None:
        """Complete tasks (downstream first) and send each session's next control when it can be accepted."""
        for _ in range(limit):
            for session, last in (session_controls or {}).items():
                sched = self.sched
                if session in sched.sessions() and sched.session_state(session) is SessionState.READY:
                    i = sched.next_control_index(session)
                    if i < last and sched.can_submit(session, i):
                        self.control(session, i)
            if not self.running:
                return
            stage = next(st for st in (Stage.DECODE, Stage.DENOISE, Stage.CONDITION) if st in self.running)
            self.finish(stage)
        raise AssertionError("did not settle")

    def of(self, kind: type, session: str | None = None) -> list[Action]:
        return [a for a in self.log if isinstance(a, kind) and (session is None or a.session == session)]

    def of_stage(self, stage: Stage) -> list[RunChunk]:
        return [a for a in self.log if isinstance(a, RunChunk) and a.stage is stage]


def snapshot(sched: Scheduler, session: str) -> tuple[object, ...]:
    return (
        sched.session_state(session),
        sched.next_control_index(session),
        sched.next_condition_index(session),
        sched.edges(session),
        len(sched._get(session).chunks),  # per-chunk records held (bounded whatever the length)
        tuple(sched._roles[st] for st in Stage),
    )


# ---- creation and prefetch ----


def test_caches_are_initialised_one_after_another_encode_decode_denoise() -> None:
    roles = Roles(Scheduler())
    assert roles.open("A", 4) == [InitCache("A", Stage.CONDITION)]
    assert roles.sched.session_state("A") is SessionState.INITIALIZING
    assert roles.finish(Stage.CONDITION) == [InitCache("A", Stage.DECODE)]
    out = roles.finish(Stage.DECODE)
    assert [a for a in out if not isinstance(a, DitIdle)] == [InitCache("A", Stage.DENOISE)]
    assert roles.sched.session_state("A") is SessionState.INITIALIZING


def test_two_conditions_are_submitted_after_creation_before_any_control() -> None:
    roles = Roles(Scheduler())
    out = roles.ready("A", 4)
    sched = roles.sched
    assert out[-2:] == [RunChunk("A", Stage.CONDITION, 0), SessionReady("A")]
    assert sched.session_state("A") is SessionState.READY
    assert sched.next_condition_index("A") == PREFETCH_DEPTH == 2
    assert sched.next_control_index("A") == 0
    assert sched.edges("A").condition == 2
    roles.finish(Stage.CONDITION)
    # condition[1] runs with no control in sight
    assert roles.running[Stage.CONDITION] == RunChunk("A", Stage.CONDITION, 1)


def test_single_chunk_session_prefetches_one_condition_and_closes_itself_when_emitted() -> None:
    roles = Roles(Scheduler())
    roles.ready("A", 1)
    assert roles.sched.next_condition_index("A") == 1
    roles.control("A", 0)
    roles.run_until_idle()
    assert [a.index for a in roles.of(Emit, "A")] == [0]
    assert roles.of(SessionClosed) == [SessionClosed("A", "complete", None, ())]
    assert [a.stage for a in roles.of(Release)] == [Stage.DECODE, Stage.DENOISE, Stage.CONDITION]
    assert roles.sched.idle
    with pytest.raises(UnknownSession):
        roles.sched.session_state("A")


# ---- control admission ----


def test_control_is_rejected_while_caches_initialise() -> None:
    roles = Roles(Scheduler())
    roles.open("A", 4)
    with pytest.raises(AdmissionError) as info:
        roles.control("A", 0)
    assert info.value.kind == "not_ready"
    assert info.value.retryable


def test_duplicate_control_is_rejected_and_nothing_changes() -> None:
    roles = Roles(Scheduler())
    roles.ready("A", 8)
    roles.feed(roles.sched.submit_control("A", 0, roles.tick(), payload="w"))
    before = snapshot(roles.sched, "A")
    with pytest.raises(AdmissionError, match="expected index 1") as info:
        roles.sched.submit_control("A", 0, roles.tick(), payload="w")
    assert (info.value.kind, info.value.expected_index, info.value.retryable) == ("duplicate", 1, False)
    with pytest.raises(AdmissionError) as info:
        roles.sched.submit_control("A", 0, roles.tick(), payload="s")
    assert info.value.kind == "conflict"
    assert snapshot(roles.sched, "A") == before


def test_skipped_and_out_of_order_controls_are_rejected_naming_the_expected_index() -> None:
    roles = Roles(Scheduler())
    roles.ready("A", 8)
    before = snapshot(roles.sched, "A")
    for index in (1, 2, 5, -1):
        with pytest.raises(AdmissionError, match="expected index 0") as info:
            roles.control("A", index)
        assert info.value.expected_index == 0
    assert snapshot(roles.sched, "A") == before
    roles.control("A", 0)
    assert roles.sched.next_control_index("A") == 1


def test_control_beyond_the_last_chunk_is_rejected() -> None:
    roles = Roles(Scheduler())
    roles.ready("A", 1)
    roles.control("A", 0)
    with pytest.raises(AdmissionError) as info:
        roles.control("A", 1)
    assert info.value.kind == "out_of_range"


def test_full_control_edge_rejects_with_backpressure_and_can_submit_agrees() -> None:
    roles = Roles(Scheduler(capacities=Capacities(control=1)))
    roles.ready("A", 8)
    roles.control("A", 0)  # condition[0] is still encoding: control[0] waits on the control edge
    assert roles.sched.edges("A").control == 1
    assert not roles.sched.can_submit("A", 1)
    with pytest.raises(AdmissionError) as info:
        roles.control("A", 1)
    assert (info.value.kind, info.value.retryable) == ("control_edge_full", True)
    roles.finish(Stage.CONDITION)  # condition[0] ready: denoise 0 starts, the control edge empties
    assert roles.sched.can_submit("A", 1)
    roles.control("A", 1)


def test_can_submit_is_a_pure_query_that_never_submits() -> None:
    roles = Roles(Scheduler())
    roles.ready("A", 8)
    before = snapshot(roles.sched, "A")
    assert roles.sched.can_submit("A", 0)
    assert not roles.sched.can_submit("A", 1)
    assert snapshot(roles.sched, "A") == before


def test_control_with_a_missing_condition_submits_both_as_one_ingress() -> None:
    roles = Roles(Scheduler())
    roles.ready("A", 8)
    roles.control("A", 0)
    roles.control("A", 1)  # the eager client drains the window: conditions 0 and 1 are both matched
    roles.finish(Stage.CONDITION)  # condition[0] -> denoise 0 starts
    assert roles.sched.next_condition_index("A") == 2
    assert roles.sched.can_submit("A", 2)
    assert roles.sched.next_condition_index("A") == 2  # the query did not submit condition[2]
    roles.control("A", 2)
    assert roles.sched.next_condition_index("A") == 3
    assert roles.sched.next_control_index("A") == 3
    roles.finish(Stage.CONDITION)  # condition[1] done; condition[2] runs next, submitted with its control
    assert roles.running[Stage.CONDITION] == RunChunk("A", Stage.CONDITION, 2)


def test_full_condition_window_rejects_a_control_whose_condition_cannot_be_submitted() -> None:
    roles = Roles(Scheduler(capacities=Capacities(control=3)))
    roles.ready("A", 8)
    for i in range(2):
        roles.control("A", i)
    assert roles.sched.edges("A").condition == PREFETCH_DEPTH
    with pytest.raises(AdmissionError) as info:
        roles.control("A", 2)  # condition[2] would be a third unconsumed condition
    assert info.value.kind == "condition_window_full"
    assert roles.sched.next_condition_index("A") == 2


# ---- join, refill, live cut ----


def test_denoise_starts_only_when_condition_and_control_of_the_chunk_are_both_present() -> None:
    roles = Roles(Scheduler())
    roles.ready("A", 8)
    roles.control("A", 0)  # control first: condition[0] still encoding
    assert Stage.DENOISE not in roles.running
    roles.finish(Stage.CONDITION)
    assert roles.running[Stage.DENOISE] == RunChunk("A", Stage.DENOISE, 0)
    roles.finish(Stage.CONDITION)  # condition[1] first: control[1] not there yet
    roles.finish(Stage.DENOISE)
    roles.finish(Stage.DECODE)
    assert Stage.DENOISE not in roles.running
    roles.control("A", 1)
    assert roles.running[Stage.DENOISE] == RunChunk("A", Stage.DENOISE, 1)


def test_refill_after_denoise_submits_the_condition_two_ahead() -> None:
    roles = Roles(Scheduler())
    roles.ready("A", 8)
    roles.finish(Stage.CONDITION)
    roles.finish(Stage.CONDITION)  # conditions 0 and 1 encoded; the encode role idles: no refill before a denoise
    roles.control("A", 0)
    assert roles.sched.next_condition_index("A") == 2
    assert Stage.CONDITION not in roles.running
    out = roles.finish(Stage.DENOISE)
    # the next encode overlaps this decode
    assert RunChunk("A", Stage.CONDITION, 2) in out and RunChunk("A", Stage.DECODE, 0) in out
    assert roles.sched.next_condition_index("A") == 3


def test_refill_stops_at_the_last_chunk() -> None:
    roles = Roles(Scheduler())
    roles.ready("A", 2)
    roles.control("A", 0)
    roles.control("A", 1)
    roles.run_until_idle()
    assert [a.index for a in roles.of_stage(Stage.CONDITION)] == [0, 1]
    assert [a.index for a in roles.of(Emit)] == [0, 1]


def test_control_wanted_names_the_next_control_only_when_the_dit_is_about_to_need_it() -> None:
    roles = Roles(Scheduler())
    roles.ready("A", 4)
    roles.open("B", 4)
    assert roles.sched.control_wanted("B") is None  # caches still initialising
    before = snapshot(roles.sched, "A")
    assert roles.sched.control_wanted("A") == 0
    assert snapshot(roles.sched, "A") == before  # a pure query
    roles.control("A", 0)
    assert roles.sched.control_wanted("A") is None  # control[0] waits for its condition
    roles.finish(Stage.CONDITION)  # denoise 0 starts
    assert roles.sched.control_wanted("A") is None  # a snapshot cut now would only grow older
    roles.finish(Stage.DENOISE)
    assert roles.sched.control_wanted("A") == 1
    roles.close("A")
    assert roles.sched.control_wanted("A") is None


def test_full_latent_edge_holds_the_dit_back_with_idle_cause_edge() -> None:
    roles = Roles(Scheduler())  # latent capacity 1; the decode below is slower than the denoise
    roles.ready("A", 8)
    roles.control("A", 0)
    roles.control("A", 1)
    roles.finish(Stage.CONDITION)  # condition[0] -> denoise 0
    roles.control("A", 2)
    roles.finish(Stage.CONDITION)
    roles.finish(Stage.CONDITION)  # conditions 1 and 2 ready
    roles.finish(Stage.DENOISE)  # latent 0 goes straight to decode; denoise 1 starts
    assert roles.running[Stage.DENOISE] == RunChunk("A", Stage.DENOISE, 1)
    roles.finish(Stage.DENOISE)  # latent 1 waits for the decode role: the latent edge is full
    assert roles.sched.edges("A").latent == 1
    assert Stage.DENOISE not in roles.running  # chunk 2 has both inputs but no room downstream
    out = roles.finish(Stage.DECODE, dt=3.0)
    assert [type(a) for a in out] == [Emit, RunChunk, DitIdle, RunChunk]
    assert [a.stage for a in out if isinstance(a, RunChunk)] == [Stage.DECODE, Stage.DENOISE]
    idle = roles.of(DitIdle)[-1]
    assert (idle.cause, idle.end - idle.start) == ("edge", 3.0)
    assert roles.running[Stage.DENOISE] == RunChunk("A", Stage.DENOISE, 2)


# ---- metrics ----


def test_condition_only_ingress_does_not_start_the_latency_clock() -> None:
    roles = Roles(Scheduler())
    roles.ready("A", 1)
    submitted = roles.now
    roles.finish(Stage.CONDITION, dt=1.0)
    roles.tick(50.0)  # the user thinks for a long time; the condition waits, prefetched
    roles.control("A", 0)
    accepted = roles.now
    roles.finish(Stage.DENOISE, dt=2.0)
    roles.finish(Stage.DECODE, dt=3.0)
    (emit,) = roles.of(Emit)
    assert emit.times.condition_submitted == submitted
    assert emit.times.control_accepted == accepted
    assert emit.times.control_to_output == pytest.approx(5.0)
    assert emit.times.condition_wait == 0.0


def test_dit_idle_is_split_by_cause_waiting_for_control_then_for_condition() -> None:
    roles = Roles(Scheduler(mode=Mode.SERIAL))
    roles.ready("A", 2)
    t_ready = roles.now
    roles.tick(4.0)
    roles.control("A", 0)  # serial: the condition is submitted only now -> the DiT waits for it
    t_control = roles.now
    roles.finish(Stage.CONDITION, dt=2.0)
    idles = [a for a in roles.of(DitIdle) if a.end > t_ready]
    assert [(i.start, i.end, i.cause) for i in idles] == [
        (t_ready, t_control, "control"),
        (t_control, t_control + 2.0, "condition"),
    ]


def test_dit_idle_names_each_waiting_session_with_its_own_blocker() -> None:
    roles = Roles(Scheduler(mode=Mode.SERIAL))
    roles.ready("A", 2)
    roles.ready("B", 2)
    roles.control("B", 0)  # serial: B's condition is only now submitted -> B waits for it, A for its control
    roles.tick(3.0)
    roles.finish(Stage.CONDITION, dt=1.0)
    idles = [a for a in roles.of(DitIdle) if ("B", "condition") in a.blocked]
    assert idles and all(dict(i.blocked) == {"A": "control", "B": "condition"} for i in idles)
    assert all(i.cause == "condition" for i in idles)  # overall: the most internal blocker


# ---- several sessions ----


def test_sessions_share_the_dit_round_robin_and_the_second_first_frame_does_not_wait_for_the_first_stream() -> None:
    roles = Roles(Scheduler())
    roles.ready("A", 50)
    for i in range(2):
        roles.control("A", i)
    for _ in range(6):  # A streams alone for a while
        stage = next(st for st in (Stage.DECODE, Stage.DENOISE, Stage.CONDITION) if st in roles.running)
        roles.finish(stage)
        if roles.sched.can_submit("A", roles.sched.next_control_index("A")):
            roles.control("A", roles.sched.next_control_index("A"))
    roles.open("B", 50)
    roles.run_until_idle({"A": 50, "B": 50})
    emits = [(e.session, e.index) for e in roles.of(Emit)]
    assert emits.index(("B", 0)) < emits.index(("A", 49))
    assert emits.index(("B", 0)) < emits.index(("A", 12))  # within a few chunks of A, not after its stream
    both = [d.session for d in roles.of_stage(Stage.DENOISE)]
    first_b = both.index("B")
    assert both[first_b : first_b + 20] == ["B", "A"] * 10  # strict alternation while both have work
    assert [e.index for e in roles.of(Emit, "B")] == list(range(50))


def test_stage_failure_fails_only_that_session_and_releases_its_caches_in_reverse_order() -> None:
    roles = Roles(Scheduler())
    roles.ready("A", 4)
    roles.ready("B", 4)
    roles.control("A", 0)
    roles.control("B", 0)
    roles.finish(Stage.CONDITION)  # A0
    assert roles.running[Stage.DENOISE] == RunChunk("A", Stage.DENOISE, 0)
    out = roles.finish(Stage.DENOISE, ok=False)
    assert SessionFailed("A", "denoise failed on chunk 0: boom") in out
    assert roles.sched.session_state("A") is SessionState.RELEASING
    roles.run_until_idle({"B": 4})
    assert [a.stage for a in roles.of(Release, "A")] == [Stage.DECODE, Stage.DENOISE, Stage.CONDITION]
    assert roles.of(SessionClosed, "A") == [SessionClosed("A", "failed", "denoise failed on chunk 0: boom", ())]
    assert roles.of(Emit, "A") == []
    assert [e.index for e in roles.of(Emit, "B")] == [0, 1, 2, 3]
    assert roles.of(SessionClosed, "B") == [SessionClosed("B", "complete", None, ())]


def test_init_failure_releases_the_caches_whose_init_was_issued() -> None:
    roles = Roles(Scheduler())
    roles.open("A", 4)
    roles.finish(Stage.CONDITION)
    out = roles.finish(Stage.DECODE, ok=False)
    assert SessionFailed("A", "decode failed: boom") in out
    roles.run_until_idle()
    assert [a.stage for a in roles.of(Release)] == [Stage.DECODE, Stage.CONDITION]
    assert not any(isinstance(a, InitCache) and a.stage is Stage.DENOISE for a in roles.log)


# ---- close ----


def test_close_drains_the_running_task_drops_queued_work_then_releases() -> None:
    roles = Roles(Scheduler())
    roles.ready("A", 8)
    roles.control("A", 0)
    roles.control("A", 1)
    roles.finish(Stage.CONDITION)  # denoise 0 runs; condition[1] encodes
    out = roles.close("A")
    assert out == [] and roles.sched.session_state("A") is SessionState.CLOSING
    with pytest.raises(AdmissionError) as info:
        roles.control("A", 2)
    assert info.value.kind == "closed"
    assert roles.finish(Stage.CONDITION) == []  # condition[1] discarded; denoise 0 still running
    out = roles.finish(Stage.DENOISE)  # drained: no decode of latent 0, no refill
    assert out[0] == Release("A", Stage.DECODE)
    assert not any(isinstance(a, Emit) or (isinstance(a, RunChunk) and a.stage is not Stage.DENOISE) for a in out)
    roles.run_until_idle()
    assert [a.stage for a in roles.of(Release)] == [Stage.DECODE, Stage.DENOISE, Stage.CONDITION]
    assert roles.of(SessionClosed) == [SessionClosed("A", "client", None, ())]


def test_closing_a_closing_session_is_a_no_op() -> None:
    roles = Roles(Scheduler())
    roles.ready("A", 8)
    roles.close("A", "client")
    before = snapshot(roles.sched, "A")
    assert roles.close("A", "disconnect") == []
    assert snapshot(roles.sched, "A") == before
    roles.run_until_idle()
    assert roles.of(SessionClosed)[0].reason == "client"


def test_close_during_init_waits_for_the_running_init_and_releases_what_was_initialised() -> None:
    roles = Roles(Scheduler())
    roles.open("A", 4)
    roles.finish(Stage.CONDITION)  # decode init now running
    roles.close("A")
    out = roles.finish(Stage.DECODE)
    assert out == [Release("A", Stage.DECODE)]
    roles.run_until_idle()
    assert [a.stage for a in roles.of(Release)] == [Stage.DECODE, Stage.CONDITION]
    assert not roles.of(SessionReady)


def test_cleanup_failure_poisons_the_session_retries_the_release_and_never_reuses_the_id() -> None:
    roles = Roles(Scheduler(max_release_retries=2))
    roles.ready("A", 4)
    roles.close("A")
    roles.finish(Stage.CONDITION)  # the running encode of condition[0] drains
    roles.finish(Stage.DECODE)  # decode released
    roles.finish(Stage.DENOISE, ok=False)
    assert roles.sched.session_state("A") is SessionState.POISONED
    roles.finish(Stage.DENOISE, ok=False)
    roles.finish(Stage.DENOISE, ok=False)  # 1 try + 2 retries: given up, the encode release goes ahead
    roles.finish(Stage.CONDITION)
    assert [a.stage for a in roles.of(Release)] == [Stage.DECODE] + [Stage.DENOISE] * 3 + [Stage.CONDITION]
    assert roles.of(SessionClosed) == [SessionClosed("A", "client", None, (Stage.DENOISE,), poisoned=True)]
    assert roles.sched.session_state("A") is SessionState.POISONED
    assert roles.sched.idle
    with pytest.raises(SessionIdTaken, match="poisoned"):
        roles.open("A", 4)


def test_cleanup_that_succeeds_on_retry_leaks_nothing_but_still_poisons_the_id() -> None:
    roles = Roles(Scheduler())
    roles.ready("A", 4)
    roles.close("A")
    roles.finish(Stage.CONDITION)
    roles.finish(Stage.DECODE, ok=False)
    roles.run_until_idle()
    assert roles.of(SessionClosed) == [SessionClosed("A", "client", None, (), poisoned=True)]
    with pytest.raises(SessionIdTaken):
        roles.open("A", 4)


def test_a_cleanly_closed_id_can_be_opened_again_but_a_live_one_cannot() -> None:
    roles = Roles(Scheduler())
    roles.ready("A", 4)
    with pytest.raises(SessionIdTaken):
        roles.open("A", 4)
    roles.close("A")
    roles.run_until_idle()
    roles.ready("A", 4)
    assert roles.sched.session_state("A") is SessionState.READY


# ---- serial mode ----


def test_serial_mode_submits_condition_with_control_and_admits_the_next_control_after_emission() -> None:
    roles = Roles(Scheduler(mode=Mode.SERIAL))
    out = roles.ready("A", 3)
    assert not any(isinstance(a, RunChunk) and a.stage is Stage.CONDITION for a in out)
    assert roles.sched.next_condition_index("A") == 0
    out = roles.control("A", 0)
    assert RunChunk("A", Stage.CONDITION, 0) in out
    with pytest.raises(AdmissionError) as info:
        roles.control("A", 1)
    assert info.value.kind == "serial"
    roles.finish(Stage.CONDITION)
    out = roles.finish(Stage.DENOISE)
    assert not any(isinstance(a, RunChunk) and a.stage is Stage.CONDITION for a in out)  # no refill in serial mode
    assert not roles.sched.can_submit("A", 1)
    roles.finish(Stage.DECODE)
    assert roles.sched.can_submit("A", 1)
    roles.run_until_idle({"A": 3})
    order = [(a.stage.value if isinstance(a, RunChunk) else "emit", a.index) for a in roles.log
             if isinstance(a, (RunChunk, Emit))]
    expected = [(n, i) for i in range(3) for n in ("condition", "denoise", "decode", "emit")]
    assert order == expected


# ---- boundedness, illegal events, validation ----


def test_endless_session_keeps_per_chunk_state_bounded() -> None:
    roles = Roles(Scheduler())
    roles.ready("A", None)
    for _ in range(2000):
        i = roles.sched.next_control_index("A")
        if roles.sched.can_submit("A", i):
            roles.control("A", i)
        stage = next(st for st in (Stage.DECODE, Stage.DENOISE, Stage.CONDITION) if st in roles.running)
        roles.finish(stage)
        assert len(roles.sched._get("A").chunks) <= PREFETCH_DEPTH + 2
    assert len(roles.of(Emit)) > 600


def test_illegal_events_raise_and_change_nothing() -> None:
    roles = Roles(Scheduler())
    roles.ready("A", 4)
    before = snapshot(roles.sched, "A")
    with pytest.raises(IllegalEvent):
        roles.sched.chunk_done("A", Stage.CONDITION, 1, roles.tick())  # condition[0] is the one encoding
    with pytest.raises(IllegalEvent):
        roles.sched.chunk_done("A", Stage.DENOISE, 0, roles.tick())
    with pytest.raises(IllegalEvent):
        roles.sched.init_done("A", Stage.CONDITION, roles.tick())
    with pytest.raises(IllegalEvent):
        roles.sched.release_done("A", Stage.DECODE, True, roles.tick())
    with pytest.raises(IllegalEvent):
        roles.sched.stage_failed("A", Stage.DECODE, 0, "boom", roles.tick())
    with pytest.raises(UnknownSession):
        roles.sched.chunk_done("Z", Stage.CONDITION, 0, roles.tick())
    assert snapshot(roles.sched, "A") == before


def test_transition_table_has_no_way_out_of_a_terminal_state_and_no_way_back_to_ready() -> None:
    assert not any(state is SessionState.CLOSED for state, _ in TRANSITIONS)
    assert {new for (old, _), new in TRANSITIONS.items() if old is SessionState.POISONED} == {SessionState.POISONED}
    assert {old for (old, _), new in TRANSITIONS.items() if new is SessionState.READY} == {
        SessionState.INITIALIZING,
        SessionState.READY,
    }
    assert all((state, SessionEvent.CLOSE) in TRANSITIONS for state in SessionState if state is not SessionState.CLOSED)


@pytest.mark.parametrize("field", ["control", "latent", "output"])
@pytest.mark.parametrize("value", [0, -1, True])
def test_capacities_must_be_positive_ints(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        Capacities(**{field: value})


@pytest.mark.parametrize("num_chunks", [0, -3])
def test_open_rejects_a_session_without_chunks(num_chunks: int) -> None:
    with pytest.raises(ValueError):
        Scheduler().open("A", num_chunks, 0.0)
