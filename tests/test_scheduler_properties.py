"""Property test: random interleavings of role completions, failures, controls, opens and closes over several sessions.

A driver plays the roles (completes any running task next, sometimes with a failure), sends controls at random
times (sometimes a wrong index), closes sessions at random, and checks the scheduler's invariants after every step
against its own record of what happened; then it drives everything to completion and checks that every session
closed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from runtime.scheduler import (
    INIT_ORDER,
    PREFETCH_DEPTH,
    RELEASE_ORDER,
    Action,
    AdmissionError,
    Capacities,
    DitIdle,
    Emit,
    InitCache,
    Mode,
    Release,
    RunChunk,
    Scheduler,
    SessionClosed,
    SessionFailed,
    SessionReady,
    SessionState,
    Stage,
)


@dataclass
class Seen:
    """What the driver observed of one session."""

    num_chunks: int | None
    inited: list[Stage] = field(default_factory=list)
    encoded: set[int] = field(default_factory=set)
    accepted: set[int] = field(default_factory=set)
    denoised: set[int] = field(default_factory=set)
    emitted: list[int] = field(default_factory=list)
    release_attempts: list[Stage] = field(default_factory=list)
    released: list[Stage] = field(default_factory=list)
    closed: SessionClosed | None = None
    failed: bool = False  # the driver failed one of its tasks
    told: bool = False  # SessionFailed was emitted
    ready: bool = False  # SessionReady was emitted


class Driver:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.running: dict[Stage, Action] = {}
        self.seen: dict[str, Seen] = {}
        self.now = 0.0
        self.opened = 0
        self.idle_end = 0.0

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    # ---- checking every action as it comes out ----

    def feed(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, DitIdle):
                assert a.cause in {"condition", "control", "edge", "no_session"}
                assert self.idle_end <= a.start < a.end <= self.now
                self.idle_end = a.end
                continue
            seen = self.seen[a.session]
            assert seen.closed is None, f"{a} after the session closed"
            stage = a.stage if isinstance(a, (InitCache, Release, RunChunk)) else None
            if stage is not None:
                assert stage not in self.running, f"{stage} got {a} while running {self.running[stage]}"
                self.running[stage] = a
                if stage is Stage.DENOISE:
                    assert Stage.DENOISE not in [k for k, v in self.running.items() if v is not a]
            if isinstance(a, InitCache):
                assert a.stage not in seen.inited
                seen.inited.append(a.stage)
            elif isinstance(a, RunChunk) and a.stage is Stage.DENOISE:
                assert a.index in seen.encoded and a.index in seen.accepted, f"denoise {a} without both inputs"
                assert a.index not in seen.denoised
                seen.denoised.add(a.index)
            elif isinstance(a, Emit):
                assert a.index == len(seen.emitted), f"emitted {a.index} after {seen.emitted}"
                assert a.times.control_accepted is not None
                assert a.times.control_accepted <= a.times.denoise_start <= a.times.emitted
                assert a.times.condition_ready <= a.times.denoise_start
                seen.emitted.append(a.index)
            elif isinstance(a, Release):
                expected = [st for st in RELEASE_ORDER if st in seen.inited]
                done = len(set(seen.release_attempts) - {a.stage})
                assert a.stage == expected[done], f"release {a.stage} out of order after {seen.release_attempts}"
                assert a.stage not in seen.released
                seen.release_attempts.append(a.stage)
            elif isinstance(a, SessionClosed):
                settled = sorted(seen.released + list(a.leaked))
                assert settled == sorted(seen.inited), f"released {seen.released} leaked {a.leaked} of {seen.inited}"
                assert seen.released == [st for st in RELEASE_ORDER if st in seen.released]
                assert (a.error is not None) == seen.failed
                if a.reason == "complete":
                    assert seen.emitted == list(range(seen.num_chunks or -1))
                assert a.poisoned == (len(seen.release_attempts) > len(seen.released))  # some release failed
                seen.closed = a
            elif isinstance(a, SessionReady):
                assert not seen.ready and seen.inited == list(INIT_ORDER)
                seen.ready = True
            elif isinstance(a, SessionFailed):
                assert seen.failed and not seen.told
                seen.told = True

    def check_invariants(self) -> None:
        caps = self.sched.capacities
        for session in self.sched.sessions():
            gap = self.sched.next_condition_index(session) - self.sched.next_control_index(session)
            assert 0 <= gap <= PREFETCH_DEPTH
            edges = self.sched.edges(session)
            assert edges.condition <= PREFETCH_DEPTH
            assert edges.control <= caps.control
            assert edges.latent <= caps.latent
            assert edges.output <= caps.output
            assert len(self.sched._get(session).chunks) <= PREFETCH_DEPTH + caps.control + caps.latent + caps.output
        for stage in Stage:
            task = self.sched._roles[stage]
            assert (task is None) == (stage not in self.running)

    # ---- the driver's moves ----

    def open(self, num_chunks: int | None) -> None:
        session = f"s{self.opened}"
        self.opened += 1
        self.seen[session] = Seen(num_chunks)
        self.feed(self.sched.open(session, num_chunks, self.tick()))

    def finish(self, stage: Stage, ok: bool) -> None:
        a = self.running.pop(stage)
        now = self.tick()
        s = self.sched
        seen = self.seen[a.session]
        if isinstance(a, Release):
            if ok:
                seen.released.append(a.stage)
            self.feed(s.release_done(a.session, a.stage, ok, now, None if ok else "release boom"))
        elif not ok:
            index = None if isinstance(a, InitCache) else a.index
            seen.failed = True
            self.feed(s.stage_failed(a.session, stage, index, "boom", now))
        elif isinstance(a, InitCache):
            self.feed(s.init_done(a.session, a.stage, now))
        else:
            if a.stage is Stage.CONDITION:
                seen.encoded.add(a.index)
            self.feed(s.chunk_done(a.session, a.stage, a.index, now))

    def control(self, session: str, offset: int) -> bool:
        """Send control[next + offset]; a wrong index must be rejected with nothing changed."""
        s = self.sched
        index = s.next_control_index(session) + offset
        before = (
            s.session_state(session),
            s.next_control_index(session),
            s.next_condition_index(session),
            s.edges(session),
            len(s._get(session).chunks),
        )
        allowed = s.can_submit(session, index)
        assert s.next_condition_index(session) == before[2]  # the query never submits
        try:
            actions = s.submit_control(session, index, self.tick())
        except AdmissionError as e:
            assert not allowed
            assert e.expected_index == before[1]
            after = (
                s.session_state(session),
                s.next_control_index(session),
                s.next_condition_index(session),
                s.edges(session),
                len(s._get(session).chunks),
            )
            assert after == before
            return False
        assert allowed and offset == 0 and self.seen[session].ready
        self.seen[session].accepted.add(index)
        self.feed(actions)
        return True

    def live(self) -> list[str]:
        return [x for x in self.sched.sessions() if self.sched.session_state(x) is not SessionState.POISONED]


@st.composite
def schedulers(draw: st.DrawFn) -> Scheduler:
    caps = Capacities(control=draw(st.integers(1, 3)), latent=draw(st.integers(1, 2)), output=draw(st.integers(1, 2)))
    return Scheduler(
        mode=draw(st.sampled_from(Mode)),
        capacities=caps,
        max_release_retries=draw(st.integers(0, 2)),
    )


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sched=schedulers(), data=st.data())
def test_random_interleavings_keep_every_invariant_and_every_session_closes(
    sched: Scheduler, data: st.DataObject
) -> None:
    d = Driver(sched)
    moves = ["open", "close"] + ["finish"] * 6 + ["control"] * 4
    for _ in range(data.draw(st.integers(10, 150), label="steps")):
        move = data.draw(st.sampled_from(moves))
        if move == "open" and d.opened < 4:
            d.open(data.draw(st.sampled_from([1, 2, 3, 5, None])))
        elif move == "finish" and d.running:
            stage = data.draw(st.sampled_from(sorted(d.running)))
            d.finish(stage, ok=data.draw(st.integers(0, 19)) != 0)
        elif move == "control" and d.live():
            d.control(data.draw(st.sampled_from(d.live())), data.draw(st.sampled_from([-1, 0, 0, 0, 1, 2])))
        elif move == "close" and d.live():
            d.feed(sched.close(data.draw(st.sampled_from(d.live())), "client", d.tick()))
        d.check_invariants()

    # Drive to completion: endless sessions are closed, finite ones run out; nothing fails any more.
    for session in d.live():
        if d.seen[session].num_chunks is None:
            d.feed(sched.close(session, "client", d.tick()))
    for _ in range(2000):
        sent = any(
            d.control(x, 0)
            for x in d.live()
            if sched.session_state(x) is SessionState.READY and sched.can_submit(x, sched.next_control_index(x))
        )
        if d.running:
            d.finish(next(iter(sorted(d.running))), ok=True)
        elif not sent:
            break
        d.check_invariants()
    assert sched.idle, f"stuck: sessions {sched.sessions()} running {d.running}"
    for session, seen in d.seen.items():
        assert seen.closed is not None, f"{session} never closed"
        if seen.closed.reason == "complete":
            assert not seen.failed
        event(f"closed {seen.closed.reason}" + (" poisoned" if seen.closed.poisoned else ""))
        event(f"emitted {min(len(seen.emitted), 3)}+ chunks" if seen.emitted else "emitted nothing")
        if seen.closed.leaked:
            event("leaked a cache")
