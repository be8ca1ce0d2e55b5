"""Real time as the admission rule: a capacity model of the pipeline and the degrade ladder (pure, on rank 0).

**Stage times.** Every emitted chunk brings its spans; a stage's busy time for the chunk is, on the busiest rank of
that stage, the sum of the spans its stage thread ran (the stage itself, plus the transfer it sends on that thread:
the DiT leader's latent, the decode rank's frames). A moving estimate (exponential, weight ``alpha`` on the newest)
is kept per (stage, steps, frame size). Before a steps setting is measured, the DiT's time at ``s`` steps is taken
from a measured setting ``s'`` in proportion to its passes (``s + 1`` over ``s' + 1``: each step is one pass, plus
the t = 0 refresh), the other stages' from any setting (steps do not change them).

**Period.** Each stage is one serial server that every session visits once per chunk, and the scheduler is fair at
chunk boundaries, so with sessions ``j`` sharing the pipeline every session's chunk period is the busiest stage's
round: ``P = max over stages of sum_j t(stage, steps_j, size_j)``. A session's real-time factor is its chunk's media
seconds (frames / fps: 12 / 16 = 0.75 s for v1) over ``P``; it keeps real time when that is at least
``1 + margin``.

**Ladder.** The steps of every session follow from the sessions present, by one function (``assign``): start each
at its best (``want``); while the prediction misses real time and sessions share the pipeline (a session alone runs
what it asked: the ladder makes room for others, it does not fix a slow deployment), lower by one quality preset
(4 -> 2 -> 1) the newest session still above its floor (policy ``newest``), or every such session at once
(``all``); ``off`` never lowers. It runs when a session asks
to open (admitted only if some assignment keeps everyone in real time: otherwise ``busy``), closes (the others
climb back), changes its own best steps, and whenever the measurements say the current assignment no longer holds
real time. Until every stage of a session's frame size is measured the model cannot predict: admission falls back
to ``server.max_sessions`` and the steps stay where they are. So it does when real time is out of reach even for
one session alone at its floor (``hopeless``: the real model on a CPU).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from statistics import median
from typing import Literal

from ipc.metrics_types import CapacityStats, SeatStats
from ipc.protocol import QUALITY_STEPS, ChunkFacts, Stage
from runtime.config import CapacityConfig

STAGES = tuple(stage.value for stage in Stage)  # condition, denoise, decode: one serial server each
Size = tuple[int, int]  # a session's frame size (height, width): the geometry its stage times depend on
KEPT_PERIODS = 8  # measured periods per session since the last change (a short, bounded window)
Why = Literal["client", "ladder_down", "ladder_up"]


def stage_busy(facts: ChunkFacts, stage: str) -> float | None:
    """Seconds the stage's thread was busy with this chunk on its busiest rank (None: no span of it)."""
    per_rank: dict[int, float] = {}
    for span in facts.spans:
        if span.role == stage:
            per_rank[span.rank] = per_rank.get(span.rank, 0.0) + span.duration
    return max(per_rank.values()) if per_rank else None


class StageTimes:
    """Moving estimates of stage busy times per (stage, steps, size); bounded by the presets and sizes served."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.seconds: dict[tuple[str, int, Size], float] = {}

    def add(self, stage: str, steps: int, size: Size, seconds: float) -> None:
        key = (stage, steps, size)
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else old + self.alpha * (seconds - old)

    def get(self, stage: str, steps: int, size: Size) -> float | None:
        """The estimate, or one derived from another steps setting of the same size (module rules), or None."""
        exact = self.seconds.get((stage, steps, size))
        if exact is not None:
            return exact
        for other in QUALITY_STEPS:
            known = self.seconds.get((stage, other, size))
            if known is not None:
                return known * (steps + 1) / (other + 1) if stage == Stage.DENOISE.value else known
        return None


@dataclass
class Seat:
    """One session as the model sees it."""

    sid: str
    size: Size
    media_s: float  # media seconds of one steady chunk (frames per chunk / fps)
    want: int  # its best quality (the open's or its latest control's steps)
    floor: int  # the lowest steps the ladder may give it
    order: int  # admission order: the ladder lowers the newest first
    steps: int = 0  # what its next chunks run (set by the ladder)
    why: Why | None = None  # why ``steps`` last changed
    chunks_left: int | None = None  # chunks until it ends by itself (None: until closed)
    periods: deque[float] = field(default_factory=lambda: deque(maxlen=KEPT_PERIODS))  # since the last change
    last_emitted: float | None = None
    last_steps: int = 0  # the steps of its latest emitted chunk


@dataclass(frozen=True)
class Admission:
    ok: bool
    changed: dict[str, int]  # sessions whose steps the ladder changed (new steps), the new one included
    reason: str = ""  # why not (ok False)
    retry_after_s: float | None = None  # when trying again can work, from the model


class CapacityModel:
    def __init__(self, config: CapacityConfig) -> None:
        self.config = config
        self.times = StageTimes(config.alpha)
        self.seats: dict[str, Seat] = {}
        self._order = 0
        # the seats as the period sees them, ``(seats per (steps, size), least media seconds)``: kept between
        # changes of the seats or their steps (``_changed``), so the per-chunk check costs the distinct settings
        # served, not the sessions (every chunk of every session checks: O(sessions^2) a round otherwise)
        self._mix: tuple[Counter[tuple[int, Size]], float] | None = None

    def _changed(self) -> None:
        """A seat came, went or changed its steps: the mix is computed again when next needed."""
        self._mix = None

    def _current_mix(self) -> tuple[Counter[tuple[int, Size]], float]:
        if self._mix is None:
            self._mix = (Counter((seat.steps, seat.size) for seat in self.seats.values()),
                         min((seat.media_s for seat in self.seats.values()), default=0.0))
        return self._mix

    # ------------------------------------------------------------------------------------------ prediction

    def period(self, plan: dict[str, int] | None = None, seats: list[Seat] | None = None) -> float | None:
        """The chunk period every session gets when ``seats`` (default: all) run ``plan``'s steps (default: their
        own); None when some stage time is unknown or there is no session."""
        if plan is None and seats is None:
            return self._current_period()
        seats = list(self.seats.values()) if seats is None else seats
        if not seats:
            return None
        busiest = 0.0
        for stage in STAGES:
            total = 0.0
            for seat in seats:
                steps = plan[seat.sid] if plan is not None else seat.steps
                t = self.times.get(stage, steps, seat.size)
                if t is None:
                    return None
                total += t
            busiest = max(busiest, total)
        return busiest

    def _current_period(self) -> float | None:
        """``period()`` of the seats as they run now, from their mix (the same sums, grouped by setting)."""
        mix, _ = self._current_mix()
        if not mix:
            return None
        busiest = 0.0
        for stage in STAGES:
            total = 0.0
            for (steps, size), count in mix.items():
                t = self.times.get(stage, steps, size)
                if t is None:
                    return None
                total += count * t
            busiest = max(busiest, total)
        return busiest

    def _fits(self, seats: list[Seat], plan: dict[str, int]) -> bool | None:
        period = self.period(plan, seats)
        if period is None:
            return None
        return all(seat.media_s >= period * (1 + self.config.margin) for seat in seats)

    def assign(self, seats: list[Seat]) -> tuple[dict[str, int], bool | None]:
        """The ladder (module rules): each seat's steps and whether that keeps real time (None: cannot tell)."""
        want = {seat.sid: seat.want for seat in seats}
        plan = dict(want)
        newest_first = sorted(seats, key=lambda s: -s.order)
        while True:
            fits = self._fits(seats, plan)
            if fits is not False or self.config.ladder == "off" or len(seats) == 1:  # alone: no one to make room for
                return plan, fits
            lowerable = [s for s in newest_first if plan[s.sid] > s.floor]
            if not lowerable:
                return (want if self.hopeless(seats) else plan), False
            for seat in lowerable if self.config.ladder == "all" else lowerable[:1]:
                plan[seat.sid] = _lower(plan[seat.sid], seat.floor)

    def hopeless(self, seats: list[Seat]) -> bool:
        """No session keeps real time even alone at its floor (the real model on a CPU): degrading would buy
        nothing, so the ladder leaves steps alone and admission counts sessions (``server.max_sessions``)."""
        return all(self._fits([s], {s.sid: s.floor}) is False for s in seats)

    # ------------------------------------------------------------------------------------------ events

    def admit(self, sid: str, size: Size, media_s: float, want: int, floor: int,
              chunks: int | None = None) -> Admission:  # fmt: skip
        """A session asks to open: admitted (with the ladder's changes) or refused with the reason and a hint."""
        floor = min(floor, want)
        seat = Seat(sid, size, media_s, want, floor, self._order, chunks_left=chunks)
        seats = [*self.seats.values(), seat]
        plan, fits = self.assign(seats)
        if fits is False and self.config.admission == "realtime" and not self.hopeless([seat]):
            period = self.period({s.sid: s.floor for s in seats}, seats) or 0.0
            return Admission(False, {}, (
                f"real time cannot hold for {len(seats)} sessions: even at their lowest steps the predicted chunk "
                f"period is {period:.3f} s for {min(s.media_s for s in seats):.3f} s of media "
                f"(margin {self.config.margin:g})"), self._retry_after(seat))
        if fits is None:  # unmeasured (no chunk yet, or a new frame size): the count rule admits, steps stay
            plan = {s.sid: s.steps or s.want for s in seats}
        self._order += 1
        self.seats[sid] = seat
        seat.steps = plan[sid]
        self._changed()
        return Admission(True, {sid: seat.steps, **self._apply(plan, skip=sid)})

    def remove(self, sid: str) -> dict[str, int]:
        """A session is gone: the others climb back as far as real time allows. Returns the changes."""
        if self.seats.pop(sid, None) is None:
            return {}
        self._changed()
        self._restart_periods()
        return self.rebalance(force=True)

    def ask(self, sid: str, want: int) -> dict[str, int]:
        """A session changes its best quality (its control's ``steps``); a floor above it comes down with it."""
        seat = self.seats.get(sid)
        if seat is None:
            return {}
        seat.want, seat.floor = want, min(seat.floor, want)
        changes = self.rebalance(force=True, asked=sid)
        return changes

    def rebalance(self, force: bool = False, asked: str | None = None) -> dict[str, int]:
        """Recompute the steps (``force``), or only when the current steps are predicted to miss real time (the
        measurements moved). Returns the sessions whose steps changed."""
        if not force:  # every chunk: no work per session here (``_mix``)
            period = self.period()
            if period is None or self._current_mix()[1] >= period:
                return {}
        seats = list(self.seats.values())
        plan, fits = self.assign(seats)
        if fits is None:
            if asked is not None and asked in plan:  # cannot predict: the asking session gets what it asked
                return self._apply({s.sid: s.steps for s in seats} | {asked: self.seats[asked].want}, asked=asked)
            return {}
        return self._apply(plan, asked=asked)

    def _apply(self, plan: dict[str, int], skip: str | None = None, asked: str | None = None) -> dict[str, int]:
        changed: dict[str, int] = {}
        for sid, steps in plan.items():
            seat = self.seats[sid]
            if sid == skip or steps == seat.steps:
                continue
            seat.why = "client" if sid == asked else "ladder_down" if steps < seat.steps else "ladder_up"
            seat.steps = steps
            changed[sid] = steps
            self._changed()
        if changed or skip is not None:
            self._restart_periods()
        return changed

    def _restart_periods(self) -> None:
        """The pipeline changed (steps or sessions): periods measured before say nothing of it now."""
        for seat in self.seats.values():
            seat.periods.clear()
            seat.last_emitted = None

    def on_chunk(self, sid: str, facts: ChunkFacts, warm: bool) -> None:
        """An emitted chunk of ``sid``: its stage times (when ``facts.steps`` is known) and its period."""
        seat = self.seats.get(sid)
        if seat is None:
            return
        if seat.chunks_left is not None:
            seat.chunks_left = max(0, seat.chunks_left - 1)
        if facts.steps and not warm:
            for stage in STAGES:
                busy = stage_busy(facts, stage)
                if busy is not None:
                    self.times.add(stage, facts.steps, seat.size, busy)
        emitted = facts.times.emitted
        if seat.last_emitted is not None and facts.steps == seat.last_steps and not warm:
            seat.periods.append(emitted - seat.last_emitted)
        seat.last_emitted, seat.last_steps = emitted, facts.steps

    def _retry_after(self, seat: Seat) -> float | None:
        """When the first session whose end makes room for ``seat`` ends (its chunks left times its period)."""
        period = self.period()
        if period is None:
            return None
        waits = []
        for other in self.seats.values():
            if other.chunks_left is None:
                continue
            rest = [s for s in self.seats.values() if s.sid != other.sid] + [seat]
            if self.assign(rest)[1]:
                waits.append(other.chunks_left * period)
        return min(waits) if waits else None

    # ------------------------------------------------------------------------------------------ reports

    def rtf(self, seat: Seat) -> tuple[float | None, float | None]:
        """(predicted, measured) real-time factor of a seat: media seconds per second of wall time."""
        period = self.period()
        predicted = None if period is None or period <= 0 else seat.media_s / period
        measured = seat.media_s / median(seat.periods) if seat.periods and median(seat.periods) > 0 else None
        return predicted, measured

    def headroom(self) -> float | None:
        """The share of the real-time budget left: ``1 - P (1 + margin) / media`` of the tightest session (>= 0:
        every session keeps real time with the margin); 1.0 with no session; None when it cannot be predicted."""
        if not self.seats:
            return 1.0
        period = self.period()
        if period is None:
            return None
        return 1.0 - period * (1 + self.config.margin) / min(s.media_s for s in self.seats.values())

    def stats(self, visible: set[str] | None = None) -> CapacityStats:
        period = self.period()
        sessions = {}
        for sid, seat in self.seats.items():
            if visible is not None and sid not in visible:
                continue
            predicted, measured = self.rtf(seat)
            sessions[sid] = SeatStats(steps=seat.steps, want_steps=seat.want, min_steps=seat.floor,
                                      steps_changed=seat.why, predicted_rtf=predicted, measured_rtf=measured,
                                      measured_periods=len(seat.periods))
        return CapacityStats(
            admission=self.config.admission,
            ladder=self.config.ladder,
            margin=self.config.margin,
            predicted_period_s=period,
            # what a router places by: only where sessions are admitted by real time (under count admission the
            # measured headroom is no rule this server keeps, and on a shared CPU it is other processes' noise)
            headroom=self.headroom() if self.config.admission == "realtime" else None,
            stage_s={f"{stage}/{steps}/{h}x{w}": t for (stage, steps, (h, w)), t in sorted(self.times.seconds.items())},
            sessions=sessions,
        )


def _lower(steps: int, floor: int) -> int:
    """The next quality preset below ``steps``, not below ``floor``."""
    below = [s for s in QUALITY_STEPS if s < steps and s >= floor]
    return below[0] if below else steps
