"""The rank-0 scheduler: a pure state machine for the condition-prefetch pipeline (DESIGN.md sections 5, 6, 8).

Events come in (with the rank-0 time at which they happened), actions go out, executed by the coordinator in list
order. No sockets, threads, processes or clocks. Illegal events raise a ``SchedulerError`` and change nothing.
Every stage's chunk is one action, ``RunChunk(session, stage, index)``, answered by ``chunk_done``; what differs
between the stages (the queue a stage takes its next chunk from, the Join, Refill and Emission rules below) is that
stage's entry of ``_RULES``, at the end of the module.

Per session (``s``), with ``d`` the next chunk whose denoise has not started:

- Cursors. ``next_condition_index`` (next condition not yet submitted) and ``next_control_index`` (next control
  that may be accepted), both monotonic; always ``0 <= next_condition_index - next_control_index <= PREFETCH_DEPTH``
  with ``PREFETCH_DEPTH = 2``, an internal constant.
- Prefetch. In ``Mode.PREFETCH``, once every role's cache is initialised (condition, decode, denoise, one after
  another), conditions 0 and 1 (fewer for shorter sessions) are submitted before any control can be accepted.
- Admission of control[i]: ``i == next_control_index``; condition[i] submitted, or submittable now (the condition
  edge has room); the control edge has room. Otherwise ``AdmissionError`` naming the expected index, nothing
  changes. If condition[i] was not submitted (the window ran dry), accepting control[i] submits both at once.
  ``can_submit`` answers the same question and never submits.
- Live cut. ``control_wanted`` names the control a live session should be given now: as late as the DiT allows,
  i.e. only when control[i] is admissible, none of the session's controls waits and none of its chunks denoises
  (a snapshot cut earlier would only grow older before the model sees it).
- Join. Denoise of chunk i starts only with condition[i] encoded and control[i] accepted, and a free slot on the
  latent edge.
- Refill. When denoise of chunk i completes, conditions up to i + 2 are submitted while the window and the
  condition edge have room (normally exactly condition[i + 2]), so the next encode overlaps the current decode.
- Edges, per session: condition (submitted, not yet consumed by a denoise: queued, encoding or encoded) <=
  PREFETCH_DEPTH; control (accepted, denoise not started) <= ``Capacities.control``; latent (produced by the DiT and
  not yet taken by decode, plus the one a running denoise will produce) <= ``Capacities.latent``; output (decoded,
  not yet emitted, plus the one a running decode will produce) <= ``Capacities.output``.
- Roles. Each role (condition, denoise, decode) runs one task at a time across all sessions, cache init and release
  included. Among sessions with ready work a role is given round-robin (the search starts after the last session
  served on that role), so no session starves.
- Emission. Frames and their ``ChunkTimes`` leave strictly in index order per session, exactly once. The
  control-to-output clock of chunk i starts when control[i] is accepted; condition-only ingress never starts it.
- Failure. ``stage_failed`` fails that session only: ``SessionFailed`` (once, while it was live), then the close
  path with reason "failed"; the first error is reported again in ``SessionClosed.error``.
- Close (client, disconnect, failure, or by itself after the last chunk is emitted, reason "complete"): stop
  accepting; queued-but-not-started work is dropped; running tasks finish (their results are discarded, nothing is
  emitted after close); then the caches whose init was issued are released decode -> denoise -> condition, one after
  another, each through its role. A failed release poisons the session (its id can never be reopened) and is
  retried ``max_release_retries`` times before it is reported as leaked and the next release goes ahead.
- Save and restore. ``hold(s, True)`` keeps chunk ``d`` off the DiT (blocker "save") until ``hold(s, False)``: a
  save (``runtime.snapshots``) queues its tasks behind every task of the chunks before it. ``open(..., start=k)``
  starts every cursor at ``k`` (a session restored from a snapshot of chunk ``k``); ``num_chunks`` counts from 0.
- ``Mode.SERIAL`` (the old design, for the A/B benchmark): no prefetch; condition[i] is submitted together with
  control[i], and control[i + 1] is accepted only after chunk i was emitted.
- Boundedness: per-chunk records exist only while the chunk is in flight (at most PREFETCH_DEPTH + edges); closed
  sessions are forgotten, only poisoned ids remain as tombstones.

DiT idle causes (``DitIdle``): ``runtime.dit_idle`` tracks the segments; ``_denoise_blocker`` names each
session's blocker.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Final

from ipc.metrics_types import IdleCause
from runtime.dit_idle import IdleSegments
from runtime.ordering import InOrder, OrderingError, Verdict
from runtime.scheduler_types import (
    INIT_ORDER,
    RELEASE_ORDER,
    Action,
    AdmissionError,
    Capacities,
    ChunkTimes,
    DitIdle,
    EdgeOccupancy,
    Emit,
    IllegalEvent,
    InitCache,
    Mode,
    Release,
    RoleTask,
    RunChunk,
    SchedulerError,
    SessionClosed,
    SessionFailed,
    SessionIdTaken,
    SessionReady,
    Stage,
    TaskKind,
    UnknownSession,
)

__all__ = [
    "INIT_ORDER",
    "PREFETCH_DEPTH",
    "RELEASE_ORDER",
    "TRANSITIONS",
    "Action",
    "AdmissionError",
    "Capacities",
    "ChunkTimes",
    "DitIdle",
    "EdgeOccupancy",
    "Emit",
    "IllegalEvent",
    "InitCache",
    "Mode",
    "Release",
    "RoleTask",
    "RunChunk",
    "Scheduler",
    "SchedulerError",
    "SessionClosed",
    "SessionEvent",
    "SessionFailed",
    "SessionIdTaken",
    "SessionReady",
    "SessionState",
    "Stage",
    "TaskKind",
    "UnknownSession",
]

PREFETCH_DEPTH: Final = 2  # conditions submitted ahead of the control cursor; internal, never a setting


class SessionState(str, Enum):
    INITIALIZING = "initializing"  # caches being initialised, one role after another
    READY = "ready"  # accepting controls, running chunks
    CLOSING = "closing"  # not accepting; waiting for its running tasks to finish
    RELEASING = "releasing"  # releasing caches decode -> denoise -> condition
    CLOSED = "closed"  # terminal, forgotten: the id may be opened again
    POISONED = "poisoned"  # a release failed: retrying, then terminal; the id can never be opened again


class SessionEvent(str, Enum):
    INIT_DONE = "init_done"  # one role finished initialising its cache
    CACHES_READY = "caches_ready"  # the last role finished initialising
    CONTROL_ACCEPTED = "control_accepted"
    TASK_DONE = "task_done"  # condition, denoise or decode of a chunk finished
    CLOSE = "close"  # client request, disconnect or last chunk emitted
    STAGE_FAILED = "stage_failed"
    DRAINED = "drained"  # no task of the session runs on any role any more
    RELEASE_OK = "release_ok"
    RELEASE_FAILED = "release_failed"
    RELEASED_ALL = "released_all"  # the last release finished (or was given up as leaked)


_S, _E = SessionState, SessionEvent
# Every legal (state, event) pair and the state it leads to. Anything else raises IllegalEvent, changing nothing.
TRANSITIONS: Final[Mapping[tuple[SessionState, SessionEvent], SessionState]] = {
    (_S.INITIALIZING, _E.INIT_DONE): _S.INITIALIZING,
    (_S.INITIALIZING, _E.CACHES_READY): _S.READY,
    (_S.INITIALIZING, _E.CLOSE): _S.CLOSING,
    (_S.INITIALIZING, _E.STAGE_FAILED): _S.CLOSING,
    (_S.READY, _E.CONTROL_ACCEPTED): _S.READY,
    (_S.READY, _E.TASK_DONE): _S.READY,
    (_S.READY, _E.CLOSE): _S.CLOSING,
    (_S.READY, _E.STAGE_FAILED): _S.CLOSING,
    (_S.CLOSING, _E.INIT_DONE): _S.CLOSING,
    (_S.CLOSING, _E.TASK_DONE): _S.CLOSING,
    (_S.CLOSING, _E.CLOSE): _S.CLOSING,
    (_S.CLOSING, _E.STAGE_FAILED): _S.CLOSING,
    (_S.CLOSING, _E.DRAINED): _S.RELEASING,
    (_S.RELEASING, _E.CLOSE): _S.RELEASING,
    (_S.RELEASING, _E.STAGE_FAILED): _S.RELEASING,
    (_S.RELEASING, _E.RELEASE_OK): _S.RELEASING,
    (_S.RELEASING, _E.RELEASE_FAILED): _S.POISONED,
    (_S.RELEASING, _E.RELEASED_ALL): _S.CLOSED,
    (_S.POISONED, _E.CLOSE): _S.POISONED,
    (_S.POISONED, _E.STAGE_FAILED): _S.POISONED,
    (_S.POISONED, _E.RELEASE_OK): _S.POISONED,
    (_S.POISONED, _E.RELEASE_FAILED): _S.POISONED,
    (_S.POISONED, _E.RELEASED_ALL): _S.POISONED,
}


@dataclass
class _Chunk:
    """Times of an in-flight chunk; dropped once emitted or when the session closes."""

    condition_submitted: float
    control_accepted: float | None = None
    start: dict[Stage, float] = field(default_factory=dict)  # when each stage started its task of the chunk
    end: dict[Stage, float] = field(default_factory=dict)  # when each stage finished it

    def times(self, emitted: float) -> ChunkTimes:
        # All set by now: emission follows condition, denoise and decode of this chunk.
        start, end = self.start, self.end
        return ChunkTimes(
            control_accepted=self.control_accepted,
            condition_submitted=self.condition_submitted,
            condition_ready=end[Stage.CONDITION],
            denoise_start=start[Stage.DENOISE],
            denoise_end=end[Stage.DENOISE],
            decode_start=start[Stage.DECODE],
            decode_end=end[Stage.DECODE],
            emitted=emitted,
            condition_start=start.get(Stage.CONDITION),
        )


@dataclass(eq=False)
class _Session:
    id: str
    seq: int  # creation order, for round-robin
    num_chunks: int | None  # None: endless
    control_memory: int
    state: SessionState = SessionState.INITIALIZING
    init_todo: deque[Stage] = field(default_factory=lambda: deque(INIT_ORDER))
    inited: list[Stage] = field(default_factory=list)  # stages whose InitCache was issued
    next_condition: int = 0
    controls: InOrder = field(init=False)
    emission: InOrder = field(default_factory=InOrder)
    encode_queue: deque[int] = field(default_factory=deque)  # submitted, not started
    encoded: set[int] = field(default_factory=set)  # condition ready, not consumed
    accepted: set[int] = field(default_factory=set)  # control edge
    next_denoise: int = 0
    latents: deque[int] = field(default_factory=deque)  # waiting for decode
    outputs: set[int] = field(default_factory=set)  # decoded, not emitted
    chunks: dict[int, _Chunk] = field(default_factory=dict)
    reason: str | None = None
    error: str | None = None
    release_todo: deque[Stage] = field(default_factory=deque)
    release_failures: int = 0  # consecutive failures of release_todo[0]
    leaked: list[Stage] = field(default_factory=list)
    finished: bool = False  # SessionClosed was emitted (only poisoned tombstones keep this True)
    start: int = 0  # its first chunk (a restored session continues its snapshot's numbering)
    save_hold: bool = False  # a save holds the denoise of chunk next_denoise until its save tasks are queued before it

    def __post_init__(self) -> None:
        self.controls = InOrder(start=self.start, memory=self.control_memory)
        self.emission = InOrder(start=self.start)
        self.next_condition = self.next_denoise = self.start

    def in_range(self, index: int) -> bool:
        return self.num_chunks is None or index < self.num_chunks


class Scheduler:
    """See the module docstring for the rules. Every event method returns the actions to execute, in order."""

    def __init__(
        self,
        mode: Mode = Mode.PREFETCH,
        capacities: Capacities | None = None,
        max_release_retries: int = 3,
    ) -> None:
        if max_release_retries < 0:
            raise ValueError(f"max_release_retries must be >= 0, got {max_release_retries}")
        self.mode = Mode(mode)
        self.capacities = capacities if capacities is not None else Capacities()
        self._max_release_retries = max_release_retries
        self._sessions: dict[str, _Session] = {}  # creation order; includes poisoned tombstones
        self._seq = 0
        self._roles: dict[Stage, RoleTask | None] = {stage: None for stage in Stage}
        self._last_served: dict[Stage, int] = {stage: -1 for stage in Stage}  # round-robin pointer (a seq)
        self._idle = IdleSegments()  # the DiT's current idle segment (``runtime.dit_idle``)

    # ---- queries ----

    @property
    def idle(self) -> bool:
        """No live session and no task running on any role (poisoned tombstones do not count)."""
        return all(s.finished for s in self._sessions.values()) and all(t is None for t in self._roles.values())

    def sessions(self) -> tuple[str, ...]:
        """Ids of the sessions not yet closed, in creation order."""
        return tuple(s.id for s in self._sessions.values() if not s.finished)

    def session_state(self, session: str) -> SessionState:
        return self._get(session).state

    def next_control_index(self, session: str) -> int:
        return self._get(session).controls.expected

    def next_condition_index(self, session: str) -> int:
        return self._get(session).next_condition

    def next_denoise_index(self, session: str) -> int:
        """The first chunk whose denoise has not been dispatched (a save's boundary; a new prompt applies from it)."""
        return self._get(session).next_denoise

    def quiet_before_denoise(self, session: str) -> bool:
        """No denoise of the session runs and every latent it produced went to decode: a held session's stages all
        have every task before its boundary chunk in their queues (the moment a save's tasks may follow them)."""
        s = self._get(session)
        return not s.latents and not self._running(s, Stage.DENOISE, TaskKind.RUN)

    def next_emit_index(self, session: str) -> int:
        return self._get(session).emission.expected

    def edges(self, session: str) -> EdgeOccupancy:
        s = self._get(session)
        encoding = self._running(s, Stage.CONDITION, TaskKind.RUN)
        return EdgeOccupancy(
            condition=len(s.encode_queue) + len(s.encoded) + encoding,
            control=len(s.accepted),
            latent=len(s.latents) + self._running(s, Stage.DENOISE, TaskKind.RUN),
            output=len(s.outputs) + self._running(s, Stage.DECODE, TaskKind.RUN),
        )

    def can_submit(self, session: str, index: int) -> bool:
        """Would ``submit_control(session, index, ...)`` be accepted now? A pure query: it never submits."""
        return self._admission_error(self._get(session), index, None) is None

    def control_wanted(self, session: str) -> int | None:
        """The index whose control the DiT will take next from ``session``, at the moment to give it: control[i]
        can be accepted now, no control of the session waits for the DiT and none of its chunks is denoising.
        ``None`` otherwise. A pure query (the live-control cut: see the module docstring)."""
        s = self._get(session)
        if s.accepted or self._running(s, Stage.DENOISE, TaskKind.RUN):
            return None
        index = s.controls.expected
        return index if self._admission_error(s, index, None) is None else None

    # ---- events ----

    def open(self, session: str, num_chunks: int | None, now: float, start: int = 0) -> list[Action]:
        """Create a session and start initialising its caches (condition, then decode, then denoise). ``start``: its
        first chunk, control and emission index (a restored session's snapshot chunk; ``num_chunks`` counts from 0)."""
        if session in self._sessions:
            what = "poisoned (never reused)" if self._sessions[session].state is SessionState.POISONED else "open"
            raise SessionIdTaken(f"session {session!r} is {what}")
        if num_chunks is not None and (
            not isinstance(num_chunks, int) or isinstance(num_chunks, bool) or num_chunks < 1
        ):
            raise ValueError(f"num_chunks must be None (endless) or an int >= 1, got {num_chunks!r}")
        if start < 0 or (num_chunks is not None and start >= num_chunks):
            raise ValueError(f"a session of {num_chunks} chunks cannot start at chunk {start}")
        # Remember enough controls to recognise a retry of any that may still be in flight.
        memory = PREFETCH_DEPTH + self.capacities.control
        self._sessions[session] = _Session(id=session, seq=self._seq, num_chunks=num_chunks, control_memory=memory,
                                           start=start)
        self._seq += 1
        return self._finish_event(self._pump(now, []), now)

    def init_done(self, session: str, stage: Stage, now: float) -> list[Action]:
        s = self._get(session)
        self._expect_task(s, stage, TaskKind.INIT, None)
        ready = s.state is SessionState.INITIALIZING and len(s.init_todo) == 1
        self._move(s, SessionEvent.CACHES_READY if ready else SessionEvent.INIT_DONE)
        self._roles[stage] = None
        s.init_todo.popleft()
        out: list[Action] = []
        if ready and self.mode is Mode.PREFETCH:  # prefetch before any control can be accepted
            while s.next_condition < s.start + PREFETCH_DEPTH and s.in_range(s.next_condition):
                self._submit_condition(s, now)
        self._maybe_drained(s, out)
        self._pump(now, out)
        if ready:
            out.append(SessionReady(session))
        return self._finish_event(out, now)

    def submit_control(self, session: str, index: int, now: float, *, payload: Hashable = None) -> list[Action]:
        """Accept control[index] or raise ``AdmissionError`` (nothing changes).

        ``payload`` (optional, any hashable digest of the control) only lets a retry of an accepted control be
        reported as kind "duplicate" rather than "conflict"; both are rejected.
        """
        s = self._get(session)
        error = self._admission_error(s, index, payload)
        if error is not None:
            raise error
        self._move(s, SessionEvent.CONTROL_ACCEPTED)
        if s.next_condition == index:  # the window ran dry: condition[index] joins this ingress
            self._submit_condition(s, now)
        s.controls.accept(index, payload)
        s.accepted.add(index)
        s.chunks[index].control_accepted = now  # the latency anchor
        return self._finish_event(self._pump(now, []), now)

    def chunk_done(self, session: str, stage: Stage, index: int, now: float) -> list[Action]:
        """``stage`` finished chunk ``index`` (the ``RunChunk`` it was given): its result enters the next edge
        (the stage's ``done`` rule), unless the session is closing (the result is discarded)."""
        s = self._get(session)
        self._expect_task(s, stage, TaskKind.RUN, index)
        self._move(s, SessionEvent.TASK_DONE)
        self._roles[stage] = None
        out: list[Action] = []
        if s.state is SessionState.READY:
            s.chunks[index].end[stage] = now
            _RULES[stage].done(self, s, index, now, out)
        self._maybe_drained(s, out)
        return self._finish_event(self._pump(now, out), now)

    def hold(self, session: str, on: bool, now: float) -> list[Action]:
        """Hold (or let go) the denoise of the session's next chunk: a save captures its state meanwhile."""
        s = self._get(session)
        s.save_hold = on
        return self._finish_event(self._pump(now, []), now)

    def stage_failed(self, session: str, stage: Stage, index: int | None, error: str, now: float) -> list[Action]:
        """A role reports that its task for ``session`` failed (``index`` None: an init, or a notice about the
        session's cache while the role runs nothing of it). Only this session fails."""
        s = self._get(session)
        task = self._roles[stage]
        ours = task is not None and task.session == session
        if ours and task is not None and task.kind is TaskKind.RELEASE:
            return self.release_done(session, stage, False, now, error)
        if ours and task is not None and index is not None and (task.kind is not TaskKind.RUN or task.index != index):
            raise IllegalEvent(f"session {session!r}: {stage.value} is running {task}, not chunk {index}")
        if not ours and index is not None:
            raise IllegalEvent(f"session {session!r}: {stage.value} is not running chunk {index}")
        was_live = s.state in (SessionState.INITIALIZING, SessionState.READY)
        self._move(s, SessionEvent.STAGE_FAILED)
        if ours:
            self._roles[stage] = None
        message = f"{stage.value} failed" + ("" if index is None else f" on chunk {index}") + f": {error}"
        if s.error is None:
            s.error = message
        out: list[Action] = []
        if was_live:
            out.append(SessionFailed(session, message))
            self._begin_close(s, "failed", out)
        self._maybe_drained(s, out)
        return self._finish_event(self._pump(now, out), now)

    def close(self, session: str, reason: str, now: float) -> list[Action]:
        """Stop the session: drain, then release. Closing a session already closing is a no-op."""
        s = self._get(session)
        out: list[Action] = []
        if s.state in (SessionState.INITIALIZING, SessionState.READY):
            self._begin_close(s, reason, out)
        else:
            self._move(s, SessionEvent.CLOSE)  # no-op, or IllegalEvent for a state that cannot be closed
        return self._finish_event(self._pump(now, out), now)

    def release_done(self, session: str, stage: Stage, ok: bool, now: float, error: str | None = None) -> list[Action]:
        s = self._get(session)
        self._expect_task(s, stage, TaskKind.RELEASE, None)
        self._move(s, SessionEvent.RELEASE_OK if ok else SessionEvent.RELEASE_FAILED)
        self._roles[stage] = None
        if ok:
            s.release_todo.popleft()
            s.release_failures = 0
        else:
            s.release_failures += 1
            if s.release_failures > self._max_release_retries:  # give up on this cache; release the others
                s.leaked.append(s.release_todo.popleft())
                s.release_failures = 0
        out: list[Action] = []
        if not s.release_todo:
            self._finish_release(s, out)
        return self._finish_event(self._pump(now, out), now)

    # ---- internals: state ----

    def _get(self, session: str) -> _Session:
        s = self._sessions.get(session)
        if s is None:
            raise UnknownSession(session)
        return s

    def _move(self, s: _Session, event: SessionEvent) -> None:
        new = TRANSITIONS.get((s.state, event))
        if new is None or (s.finished and event is not SessionEvent.CLOSE):
            raise IllegalEvent(f"session {s.id!r}: event {event.value} is illegal in state {s.state.value}")
        s.state = new

    def _expect_task(self, s: _Session, stage: Stage, kind: TaskKind, index: int | None) -> None:
        task = self._roles[stage]
        if task != RoleTask(s.id, kind, index):
            what = kind.value if index is None else f"{kind.value} of chunk {index}"
            raise IllegalEvent(f"session {s.id!r}: {stage.value} is not running {what} (it runs {task})")

    def _running(self, s: _Session, stage: Stage, kind: TaskKind | None = None) -> int:
        task = self._roles[stage]
        return int(task is not None and task.session == s.id and (kind is None or task.kind is kind))

    def _condition_room(self, s: _Session) -> bool:
        """Can condition[next_condition_index] be submitted now (in range, window and condition edge)?"""
        return (
            s.in_range(s.next_condition)
            and s.next_condition - s.controls.expected < PREFETCH_DEPTH
            and self.edges(s.id).condition < PREFETCH_DEPTH
        )

    def _submit_condition(self, s: _Session, now: float) -> None:
        i = s.next_condition
        s.chunks[i] = _Chunk(condition_submitted=now)
        s.encode_queue.append(i)
        s.next_condition += 1

    def _admission_error(self, s: _Session, index: int, payload: Hashable) -> AdmissionError | None:
        expected = s.controls.expected

        def reject(kind: str, detail: str) -> AdmissionError:
            return AdmissionError(s.id, index, expected, kind, detail)

        if s.state is SessionState.INITIALIZING:
            return reject("not_ready", "the session's caches are still being initialised")
        if s.state is not SessionState.READY:
            return reject("closed", f"the session is {s.state.value}")
        try:
            verdict = s.controls.check(index, payload)
        except OrderingError as e:
            return reject(e.kind, str(e))
        if verdict is Verdict.DUPLICATE:
            return reject("duplicate", f"control[{index}] was already accepted")
        if not s.in_range(index):
            return reject("out_of_range", f"the session has {s.num_chunks} chunks")
        if self.mode is Mode.SERIAL and s.emission.expected < index:
            return reject("serial", f"chunk {index - 1} has not been emitted yet (serial mode)")
        if len(s.accepted) >= self.capacities.control:
            return reject("control_edge_full", f"{len(s.accepted)} controls wait for their denoise")
        if s.next_condition == index and not self._condition_room(s):
            return reject("condition_window_full", f"{PREFETCH_DEPTH} conditions wait for their denoise")
        return None

    # ---- internals: close and release ----

    def _begin_close(self, s: _Session, reason: str, out: list[Action]) -> None:
        """Stop accepting and drop every queued-but-not-started piece of work; running tasks finish."""
        self._move(s, SessionEvent.CLOSE)
        s.reason = reason
        # Keep only an init already running on its role (its init_done drains it); drop the ones not yet issued.
        s.init_todo = deque(stage for stage in list(s.init_todo)[:1] if self._running(s, stage, TaskKind.INIT))
        s.encode_queue.clear()
        s.encoded.clear()
        s.accepted.clear()
        s.latents.clear()
        s.outputs.clear()
        s.chunks.clear()
        self._maybe_drained(s, out)

    def _maybe_drained(self, s: _Session, out: list[Action]) -> None:
        if s.state is not SessionState.CLOSING or any(self._running(s, stage) for stage in Stage):
            return
        self._move(s, SessionEvent.DRAINED)
        s.init_todo.clear()
        s.release_todo = deque(stage for stage in RELEASE_ORDER if stage in s.inited)
        if not s.release_todo:
            self._finish_release(s, out)

    def _finish_release(self, s: _Session, out: list[Action]) -> None:
        self._move(s, SessionEvent.RELEASED_ALL)
        poisoned = s.state is SessionState.POISONED
        out.append(SessionClosed(s.id, s.reason or "closed", s.error, tuple(s.leaked), poisoned))
        s.finished = True
        if not poisoned:
            del self._sessions[s.id]  # forgotten: memory stays bounded; the id may be opened again

    # ---- internals: dispatch ----

    def _pump(self, now: float, out: list[Action]) -> list[Action]:
        """Give every free role its next task, downstream first (a decode frees a latent slot for the DiT)."""
        progress = True
        while progress:
            progress = False
            for stage in reversed(Stage):
                if self._roles[stage] is None and self._dispatch(stage, now, out):
                    progress = True
        return out

    def _dispatch(self, stage: Stage, now: float, out: list[Action]) -> bool:
        live = [s for s in self._sessions.values() if not s.finished]
        after = [s for s in live if s.seq > self._last_served[stage]]
        for s in after + [s for s in live if s.seq <= self._last_served[stage]]:
            task = self._ready_task(s, stage)
            if task is not None:
                self._last_served[stage] = s.seq
                self._start(s, stage, task, now, out)
                return True
        return False

    def _ready_task(self, s: _Session, stage: Stage) -> RoleTask | None:
        if s.state is SessionState.INITIALIZING:
            # One init at a time per session: the next one is issued after the previous init_done.
            if s.init_todo and s.init_todo[0] is stage and not any(self._running(s, st) for st in Stage):
                return RoleTask(s.id, TaskKind.INIT)
            return None
        if s.state in (SessionState.RELEASING, SessionState.POISONED):
            if s.release_todo and s.release_todo[0] is stage:
                return RoleTask(s.id, TaskKind.RELEASE)
            return None
        if s.state is not SessionState.READY:
            return None
        index = _RULES[stage].ready(self, s)
        return None if index is None else RoleTask(s.id, TaskKind.RUN, index)

    def _denoise_blocker(self, s: _Session) -> IdleCause | None:
        """Why chunk ``next_denoise`` of a READY session cannot start on the DiT now (None: it can)."""
        d = s.next_denoise
        if s.save_hold:
            return IdleCause.SAVE
        if d not in s.accepted:
            return IdleCause.CONTROL
        if d not in s.encoded:
            return IdleCause.CONDITION
        if len(s.latents) >= self.capacities.latent:
            return IdleCause.EDGE
        return None

    def _start(self, s: _Session, stage: Stage, task: RoleTask, now: float, out: list[Action]) -> None:
        if stage is Stage.DENOISE:
            self._idle.end(now, out)
        self._roles[stage] = task
        if task.kind is TaskKind.INIT:
            s.inited.append(stage)
            out.append(InitCache(s.id, stage))
        elif task.kind is TaskKind.RELEASE:
            out.append(Release(s.id, stage))
        else:
            assert task.index is not None
            _RULES[stage].take(self, s, task.index)
            s.chunks[task.index].start[stage] = now
            out.append(RunChunk(s.id, stage, task.index))

    # ---- internals: the stage rules (which chunk a stage takes next, and where its result goes) ----

    def _next_encode(self, s: _Session) -> int | None:
        return s.encode_queue[0] if s.encode_queue else None

    def _take_encode(self, s: _Session, index: int) -> None:
        taken = s.encode_queue.popleft()
        assert taken == index

    def _encoded(self, s: _Session, index: int, now: float, out: list[Action]) -> None:
        s.encoded.add(index)

    def _next_join(self, s: _Session) -> int | None:
        """The join: condition[d] encoded, control[d] accepted, room on the latent edge (``_denoise_blocker``)."""
        return s.next_denoise if self._denoise_blocker(s) is None else None

    def _take_join(self, s: _Session, index: int) -> None:
        assert index == s.next_denoise
        s.encoded.remove(index)
        s.accepted.remove(index)
        s.next_denoise += 1

    def _denoised(self, s: _Session, index: int, now: float, out: list[Action]) -> None:
        s.latents.append(index)
        if self.mode is Mode.PREFETCH:  # refill after denoise: the next encode overlaps this decode
            while s.next_condition <= index + PREFETCH_DEPTH and self._condition_room(s):
                self._submit_condition(s, now)

    def _next_latent(self, s: _Session) -> int | None:
        """The oldest latent, while the output edge has room."""
        return s.latents[0] if s.latents and len(s.outputs) < self.capacities.output else None

    def _take_latent(self, s: _Session, index: int) -> None:
        taken = s.latents.popleft()
        assert taken == index

    def _decoded(self, s: _Session, index: int, now: float, out: list[Action]) -> None:
        """Emission: every decoded chunk next in index order leaves, exactly once; the last one closes."""
        s.outputs.add(index)
        while s.emission.expected in s.outputs:
            i = s.emission.expected
            verdict = s.emission.accept(i)
            assert verdict is Verdict.ACCEPTED  # exactly once, in order
            s.outputs.discard(i)
            out.append(Emit(s.id, i, s.chunks.pop(i).times(now)))
        if s.num_chunks is not None and s.emission.expected == s.num_chunks:
            self._begin_close(s, "complete", out)

    # ---- internals: DiT idle ----

    def _finish_event(self, out: list[Action], now: float) -> list[Action]:
        """Track the DiT idle segment after an event (the DiT's state and the blockers may have changed)."""
        if self._roles[Stage.DENOISE] is None:
            blocked = tuple((s.id, cause) for s in self._sessions.values()
                            if s.state is SessionState.READY and s.in_range(s.next_denoise)
                            and (cause := self._denoise_blocker(s)) is not None)
            self._idle.observe(blocked, now, out)
        return out


@dataclass(frozen=True)
class _Rules:
    """The rules of one stage's chunks in a READY session (the rest of the scheduler treats every stage alike)."""

    ready: Callable[[Scheduler, _Session], int | None]  # the chunk it may start now (None: none)
    take: Callable[[Scheduler, _Session, int], None]  # that chunk leaves the stage's input edge as it starts
    done: Callable[[Scheduler, _Session, int, float, list[Action]], None]  # its result enters the next edge


_RULES: Final[Mapping[Stage, _Rules]] = {
    Stage.CONDITION: _Rules(Scheduler._next_encode, Scheduler._take_encode, Scheduler._encoded),
    Stage.DENOISE: _Rules(Scheduler._next_join, Scheduler._take_join, Scheduler._denoised),
    Stage.DECODE: _Rules(Scheduler._next_latent, Scheduler._take_latent, Scheduler._decoded),
}
