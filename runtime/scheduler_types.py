"""Vocabulary of the scheduler (runtime/scheduler.py): modes, stages, capacities, errors, actions, times.

Plain data, no rules: every frozen dataclass here is a value the scheduler returns or takes. ``Stage`` and
``ChunkTimes`` are wire values (``ipc.protocol``): the stage names and a chunk's times keep one shape from the
scheduler to the client's trace file. The rules (cursors,
windows, admission, join, emission, close) live in ``runtime.scheduler``, which re-exports every name below.

Invariants of the values: ``Capacities`` fields are ints >= 1; actions are immutable; ``ChunkTimes`` are rank-0
times passed in with the events, never read from a clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Final

from ipc.metrics_types import IdleCause
from ipc.protocol import ChunkTimes, Stage


class Mode(str, Enum):
    PREFETCH = "prefetch"  # the pipeline: conditions prefetched, joined with controls as they arrive
    SERIAL = "serial"  # the old design: condition and control together, one chunk at a time


# ``Stage`` lists the stages in pipeline order (each chunk goes condition -> denoise -> decode).
# every stage's init in pipeline order, the DiT's last: it takes the condition's context
INIT_ORDER: Final = (*(stage for stage in Stage if stage is not Stage.DENOISE), Stage.DENOISE)
RELEASE_ORDER: Final = tuple(reversed(Stage))  # downstream first: decode -> denoise -> condition


@dataclass(frozen=True)
class Capacities:
    """Per-session edge capacities (the condition edge is bounded by ``PREFETCH_DEPTH``)."""

    control: int = 2  # accepted controls whose denoise has not started
    latent: int = 1  # latents not yet taken by decode, counting the one a running denoise will produce
    output: int = 2  # decoded frames not yet emitted, counting the one a running decode will produce

    def __post_init__(self) -> None:
        for name in ("control", "latent", "output"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Capacities.{name} must be an int >= 1, got {value!r}")


class SchedulerError(Exception):
    """Base of every error the scheduler raises; when one is raised, nothing changed."""


class UnknownSession(SchedulerError):
    def __init__(self, session: str) -> None:
        self.session = session
        super().__init__(f"unknown session {session!r} (never opened, or closed and forgotten)")


class SessionIdTaken(SchedulerError):
    """``open`` of an id that is live, or poisoned (a poisoned id is never reused)."""


class IllegalEvent(SchedulerError):
    """An event not legal in the session's state, or a completion for a task that is not running."""


_RETRYABLE: Final = frozenset({"not_ready", "serial", "control_edge_full", "condition_window_full"})


class AdmissionError(SchedulerError):
    """control[index] was not accepted. ``kind`` says why; ``retryable`` kinds may succeed later unchanged."""

    def __init__(self, session: str, index: int, expected_index: int, kind: str, detail: str) -> None:
        self.session = session
        self.index = index
        self.expected_index = expected_index
        self.kind = kind
        super().__init__(
            f"session {session!r}: control[{index}] rejected ({kind}): {detail}; expected index {expected_index}"
        )

    @property
    def retryable(self) -> bool:
        return self.kind in _RETRYABLE


# ---- actions (what the coordinator must do, in list order) ----


@dataclass(frozen=True)
class InitCache:
    session: str
    stage: Stage


@dataclass(frozen=True)
class RunChunk:
    """Run chunk ``index`` of the session on ``stage`` (its tasks: ``runtime.placement``'s stage table)."""

    session: str
    stage: Stage
    index: int


@dataclass(frozen=True)
class Emit:
    session: str
    index: int
    times: ChunkTimes


@dataclass(frozen=True)
class SessionReady:
    session: str


@dataclass(frozen=True)
class Release:
    session: str
    stage: Stage


@dataclass(frozen=True)
class SessionClosed:
    session: str
    reason: str
    error: str | None  # set if a stage failed
    leaked: tuple[Stage, ...]  # releases given up after the retries
    poisoned: bool = False  # a release failed at least once: the id is never reused


@dataclass(frozen=True)
class SessionFailed:
    session: str
    error: str


@dataclass(frozen=True)
class DitIdle:
    start: float
    end: float
    cause: IdleCause  # the most internal blocker over all sessions
    blocked: tuple[tuple[str, IdleCause], ...] = ()  # (session, its own cause) for every session with a chunk waiting


Action = (
    InitCache
    | RunChunk
    | Emit
    | SessionReady
    | Release
    | SessionClosed
    | SessionFailed
    | DitIdle
)


class TaskKind(str, Enum):
    INIT = "init"
    RUN = "run"
    RELEASE = "release"


@dataclass(frozen=True)
class RoleTask:
    """The one task a role is running."""

    session: str
    kind: TaskKind
    index: int | None = None  # the chunk, for RUN tasks


@dataclass(frozen=True)
class EdgeOccupancy:
    condition: int
    control: int
    latent: int
    output: int
