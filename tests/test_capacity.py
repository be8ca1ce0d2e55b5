"""The capacity model and the degrade ladder as a pure state machine (runtime/capacity.py): no processes."""

from __future__ import annotations

import pytest

from ipc.protocol import ChunkControl, ChunkFacts, ChunkTimes, Span
from runtime.capacity import CapacityModel, StageTimes, stage_busy
from runtime.config import CapacityConfig

SIZE = (160, 256)
MEDIA = 0.75  # 12 frames at 16 fps
COSTS = {"condition": 0.02, "denoise": 0.3, "decode": 0.03}  # of 4 steps; the DiT's time follows its passes


def facts(index: int, steps: int, emitted: float, costs: dict[str, float] = COSTS) -> ChunkFacts:
    dit = costs["denoise"] * (steps + 1) / 5
    spans = (Span("condition", 0, "condition", 0.0, 0.0, costs["condition"]),
             Span("denoise", 2, "denoise", 0.0, 0.0, dit - 0.01), Span("transfer:latent", 2, "denoise", 0.0, 1.0, 1.01),
             Span("denoise", 3, "denoise", 0.0, 0.0, dit - 0.02),  # a second DiT rank: lockstep, counted once
             Span("transfer:condition", 2, "condition_edge", 0.0, 0.0, 5.0),  # another thread: not the DiT's time
             Span("decode", 1, "decode", 0.0, 0.0, costs["decode"]))  # fmt: skip
    times = ChunkTimes(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, emitted)
    return ChunkFacts(index, 12, ChunkControl(), times, spans, steps)


def model(**config: object) -> CapacityModel:
    return CapacityModel(CapacityConfig(**{"alpha": 1.0, **config}))  # type: ignore[arg-type]


def measured(m: CapacityModel, sid: str, steps: int = 4, chunks: int = 3) -> None:
    for i in range(1, chunks + 1):
        m.on_chunk(sid, facts(i, steps, float(i)), warm=False)


def test_a_stage_is_busy_for_its_threads_spans_on_its_busiest_rank() -> None:
    f = facts(1, 4, 1.0)
    assert stage_busy(f, "denoise") == pytest.approx(0.3)  # leader's denoise + its latent send
    assert stage_busy(f, "condition") == pytest.approx(0.02)  # the edge thread's broadcast is not the encoder's
    assert stage_busy(ChunkFacts(0, 12, ChunkControl(), f.times), "decode") is None


def test_the_period_is_the_busiest_stages_round_and_fewer_steps_scale_the_dit_by_its_passes() -> None:
    m = model()
    assert m.admit("a", SIZE, MEDIA, 4, 1).ok
    assert m.period() is None  # nothing measured yet
    measured(m, "a")
    assert m.period() == pytest.approx(0.3)
    assert m.admit("b", SIZE, MEDIA, 4, 1).changed == {"b": 4}
    assert m.period() == pytest.approx(0.6)
    assert m.rtf(m.seats["a"])[0] == pytest.approx(MEDIA / 0.6)
    assert m.period({"a": 1, "b": 2}) == pytest.approx(0.3 * 2 / 5 + 0.3 * 3 / 5)  # 1 and 2 steps: 2 and 3 passes
    assert m.times.get("decode", 1, SIZE) == pytest.approx(0.03)  # the other stages do not depend on steps
    assert m.times.get("denoise", 4, (320, 512)) is None  # another frame size is another geometry


def test_until_the_pipeline_is_measured_sessions_are_admitted_by_the_count_rule() -> None:
    m = model()
    for sid in "abcdef":
        admission = m.admit(sid, SIZE, MEDIA, 4, 1)
        assert admission.ok and admission.changed == {sid: 4}
    assert m.headroom() is None


def test_a_third_session_makes_the_ladder_step_down_the_newest_first_and_a_closing_one_lets_them_climb_back() -> None:
    m = model(ladder="newest")
    m.admit("a", SIZE, MEDIA, 4, 1)
    measured(m, "a")
    m.admit("b", SIZE, MEDIA, 4, 1)
    # three at 4 steps: 0.9 s > 0.75 / 1.1; the newest (c) goes down first, to 2 then 1, then b to 2
    admission = m.admit("c", SIZE, MEDIA, 4, 1)
    assert admission.ok
    steps = {sid: seat.steps for sid, seat in m.seats.items()}
    assert steps == {"a": 4, "b": 2, "c": 1}
    assert m.seats["b"].why == "ladder_down"
    assert m.period() * 1.1 <= MEDIA  # type: ignore[operator]
    assert m.remove("c") == {"b": 4}
    assert m.seats["b"].why == "ladder_up"


def test_policy_all_lowers_every_session_together_and_climbs_back_together() -> None:
    m = model(ladder="all")
    m.admit("a", SIZE, MEDIA, 4, 1)
    measured(m, "a")
    m.admit("b", SIZE, MEDIA, 4, 1)
    admission = m.admit("c", SIZE, MEDIA, 4, 1)
    assert admission.ok and admission.changed == {"a": 2, "b": 2, "c": 2}
    assert m.remove("c") == {"a": 4, "b": 4}


def test_floors_hold_and_when_real_time_cannot_hold_the_answer_is_busy_with_the_reason_and_a_hint() -> None:
    m = model(ladder="newest")
    m.admit("a", SIZE, MEDIA, 4, 4)  # a never goes below 4 steps
    measured(m, "a")
    m.admit("b", SIZE, MEDIA, 4, 1, chunks=10)
    before = {sid: s.steps for sid, s in m.seats.items()}
    refused = m.admit("c", SIZE, MEDIA, 4, 4)  # even with b at 1 step: 0.3 + 0.12 + 0.3 > 0.75 / 1.1
    assert not refused.ok and "real time cannot hold for 3 sessions" in refused.reason
    assert refused.retry_after_s == pytest.approx(10 * m.period())  # b ends after its 10 chunks: then c fits
    assert {sid: s.steps for sid, s in m.seats.items()} == before and "c" not in m.seats  # nothing changed
    assert m.seats["a"].steps == 4


def test_with_the_ladder_off_steps_stay_fixed_and_the_third_session_is_refused() -> None:
    m = model(ladder="off")
    m.admit("a", SIZE, MEDIA, 4, 1)
    measured(m, "a")
    assert m.admit("b", SIZE, MEDIA, 4, 1).ok
    refused = m.admit("c", SIZE, MEDIA, 4, 1)
    assert not refused.ok and refused.retry_after_s is None  # no session ends by itself
    assert [s.steps for s in m.seats.values()] == [4, 4]


def test_count_admission_admits_beyond_real_time_at_the_lowest_steps() -> None:
    m = model(admission="count")
    m.admit("a", SIZE, MEDIA, 4, 1)
    measured(m, "a")
    for sid in "bcdefg":
        assert m.admit(sid, SIZE, MEDIA, 4, 1).ok
    assert m.headroom() < 0  # type: ignore[operator]
    assert m.stats().headroom is None  # a router must not place by a rule this server does not keep


def test_a_session_asking_for_other_steps_gets_them_as_far_as_real_time_allows() -> None:
    m = model(ladder="newest")
    m.admit("a", SIZE, MEDIA, 4, 1)
    measured(m, "a")
    m.admit("b", SIZE, MEDIA, 4, 1)
    assert m.ask("a", 1) == {"a": 1} and m.seats["a"].why == "client"
    assert m.admit("c", SIZE, MEDIA, 4, 1).changed == {"c": 2}  # room made by a's lower steps: 0.12 + 0.3 + 0.18
    # a asks for 4 again: it gets them, and the newer sessions step down for it (the policy's order)
    assert m.ask("a", 4) == {"a": 4, "b": 2, "c": 1}
    assert (m.seats["a"].why, m.seats["b"].why) == ("client", "ladder_down")
    assert m.period() * 1.1 <= MEDIA  # type: ignore[operator]


def test_the_measured_real_time_factor_counts_only_periods_since_the_pipeline_last_changed() -> None:
    m = model()
    m.admit("a", SIZE, MEDIA, 4, 1)
    for i, t in enumerate((0.0, 0.5, 1.0, 1.5)):
        m.on_chunk("a", facts(i, 4, t), warm=False)
    assert m.rtf(m.seats["a"])[1] == pytest.approx(MEDIA / 0.5)
    m.admit("b", SIZE, MEDIA, 4, 1)  # a new session changes everyone's period
    assert m.rtf(m.seats["a"])[1] is None
    stats = m.stats(visible={"b"})
    assert set(stats.sessions) == {"b"} and stats.headroom == pytest.approx(1 - 0.6 * 1.1 / MEDIA)
    for i, t in enumerate((2.0, 2.6, 3.2), start=4):
        m.on_chunk("a", facts(i, 4, t), warm=False)
    assert m.rtf(m.seats["a"])[1] == pytest.approx(MEDIA / 0.6)
    m.remove("b")  # a session leaves: the same steps, another period
    assert m.rtf(m.seats["a"])[1] is None


def test_measurements_that_miss_real_time_step_sessions_down_without_an_event() -> None:
    m = model(ladder="newest")
    m.admit("a", SIZE, MEDIA, 4, 1)
    measured(m, "a")
    m.admit("b", SIZE, MEDIA, 4, 1)
    assert m.rebalance() == {}  # holds: nothing to do
    slow = {**COSTS, "denoise": 0.5}  # the machine got slower: 2 x 0.5 > 0.75
    m.on_chunk("a", facts(9, 4, 9.0, slow), warm=False)
    assert m.rebalance() == {"a": 2, "b": 1}  # b to its floor first (0.7 s still misses), then a


def test_a_pipeline_that_cannot_hold_real_time_even_for_one_session_serves_by_count_at_full_steps() -> None:
    m = model()
    m.admit("a", SIZE, MEDIA, 4, 1)
    for i in range(1, 4):  # the real model on a CPU: 10 s a chunk, even 1 step misses 0.75 s by far
        m.on_chunk("a", facts(i, 4, float(i), {**COSTS, "denoise": 10.0}), warm=False)
    assert m.rebalance() == {} and m.seats["a"].steps == 4
    admission = m.admit("b", SIZE, MEDIA, 4, 1)
    assert admission.ok and admission.changed == {"b": 4}


def test_a_session_alone_runs_the_steps_it_asked_for_even_when_they_miss_real_time() -> None:
    m = model()
    m.admit("a", SIZE, MEDIA, 4, 1)
    for i in range(1, 4):  # 4 steps miss real time alone (0.8 s for 0.75 s), 1 step would hold it
        m.on_chunk("a", facts(i, 4, float(i), {**COSTS, "denoise": 0.8}), warm=False)
    assert m.rebalance() == {} and m.seats["a"].steps == 4
    assert m.admit("b", SIZE, MEDIA, 4, 1).changed == {"a": 1, "b": 1}  # sharing: the ladder makes room


class CountedTimes(StageTimes):
    """The model's stage times, counting the lookups (how much work a chunk costs the model)."""

    lookups = 0

    def get(self, stage: str, steps: int, size: tuple[int, int]) -> float | None:
        self.lookups += 1
        return super().get(stage, steps, size)


def test_each_chunk_costs_the_model_the_settings_served_not_the_sessions() -> None:
    """``rebalance()`` runs on every emitted chunk: its period was summed over every session (O(sessions^2) a
    round); now over the distinct (steps, size) settings, summed again only when a seat or its steps change."""
    m = model(admission="count", margin=0.0)
    m.times = CountedTimes(1.0)
    sessions = [f"s{n}" for n in range(200)]
    for n, sid in enumerate(sessions):
        m.admit(sid, SIZE if n % 2 else (320, 512), 1e9, 4, 4)  # a huge media time: always in real time
    for sid in sessions[:2]:
        measured(m, sid)
    m.times.lookups = 0
    for i, sid in enumerate(sessions):  # one round: a chunk of every session
        m.on_chunk(sid, facts(4 + i, 4, 4.0 + i), warm=False)
        assert m.rebalance() == {}
    assert m.times.lookups <= len(sessions) * 3 * 2, m.times.lookups  # per chunk: 3 stages x 2 settings
    seats = list(m.seats.values())  # the same period as summed seat by seat
    assert m.period() == pytest.approx(m.period({s.sid: s.steps for s in seats}, seats))
