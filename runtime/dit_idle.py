"""The DiT's idle segments (``DitIdle``), for the scheduler: a pure tracker with ``now`` passed in.

While the DiT runs nothing, the cause is re-evaluated after every event from the sessions that still have a chunk to
denoise, each blocked by its first missing dependency (held by a save -> "save"; control[d] not accepted ->
"control"; condition[d] not encoded -> "condition"; latent edge full -> "edge"; the scheduler names each session's).
Across sessions the most internal blocker wins: "save" over "edge" over "condition" over "control"; with no such
session the cause is "no_session". Each segment also lists every waiting session with its own blocker
(``blocked``), so a session's metrics count only the idle time it waited through, with its own cause. An idle
interval is split at the events where its cause or a session's blocker changes; each segment is emitted as soon as
it ends (at the change, or just before the action that makes the DiT busy again: any DiT task, cache init and
release included). Zero-length segments are not emitted. Time starts with the first event: the DiT is idle from
then until its first task.
"""

from __future__ import annotations

from ipc.metrics_types import IdleCause
from runtime.scheduler_types import Action, DitIdle

Blocked = tuple[tuple[str, IdleCause], ...]  # (session, its own blocker) for every session with a chunk waiting

# the most internal blocker first: the one a segment is charged to when sessions wait for different things
PRECEDENCE = (IdleCause.SAVE, IdleCause.EDGE, IdleCause.CONDITION, IdleCause.CONTROL)


def overall_cause(blocked: Blocked) -> IdleCause:
    causes = {cause for _, cause in blocked}
    return next((cause for cause in PRECEDENCE if cause in causes), IdleCause.NO_SESSION)


class IdleSegments:
    """The open idle segment: when it began and what it is charged to (None: the DiT is busy)."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.cause: tuple[IdleCause, Blocked] | None = None

    def observe(self, blocked: Blocked, now: float, out: list[Action]) -> None:
        """The DiT is idle after an event with these sessions waiting: a changed cause ends the segment."""
        cause = (overall_cause(blocked), blocked)
        if self.since is None:
            self.since, self.cause = now, cause
        elif cause != self.cause:
            if now > self.since and self.cause is not None:
                out.append(DitIdle(self.since, now, *self.cause))
                self.since = now
            self.cause = cause

    def end(self, now: float, out: list[Action]) -> None:
        """The DiT is about to run: the open segment ends (and is emitted unless it lasted no time)."""
        if self.since is not None and self.cause is not None and now > self.since:
            out.append(DitIdle(self.since, now, *self.cause))
        self.since, self.cause = None, None
