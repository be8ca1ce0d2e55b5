"""Failed saves whose stage workers may still be writing: their folder is deleted once the last writer is done.

A save fails as soon as one part of it fails (a rank's copy refused, a writer's disk error, the session closed, the
save timed out), while the other stage workers' writer threads may still be writing their files into the save's
folder. Deleting the folder then pulls it from under them (a writer's error, and a late file that recreates the
folder and is never deleted); keeping it for ever fills the disk. So rank 0 remembers, per failed save, the parts
that were sent the save task and have not answered for their file yet, and asks the shell to delete the folder when
the last one answers: its ``save_written`` (a file or an error) or, for a worker that refused before copying, its
``task_failed``. Every writer answers every task it was given (``ranks.snapshot_saver`` survives any error of one
save), so the wait ends; a writer that never answers (its rank is gone: the job ends anyway) is given up after
``wait_s`` and the folder deleted then.

Sans-io: the caller passes ``now`` and emits ``DropSnapshotFiles`` for each id returned.
"""

from __future__ import annotations

from dataclasses import dataclass

Part = tuple[int, str]  # (rank, role) of a stage worker, as ``runtime.snapshots.Part``


@dataclass
class _Waiting:
    session: str
    parts: set[Part]  # still to answer
    since: float


class LateWrites:
    """The failed saves still being written, by snapshot id, oldest first."""

    def __init__(self, wait_s: float, limit: int = 4096) -> None:
        self.wait_s = wait_s  # a writer silent this long after the failure is given up: its folder is deleted
        self.limit = limit  # at most this many remembered (each is a few dozen bytes); the oldest is given up first
        self._waiting: dict[str, _Waiting] = {}

    def __contains__(self, snapshot: object) -> bool:
        return snapshot in self._waiting

    def __len__(self) -> int:
        return len(self._waiting)

    def failed(self, snapshot: str, session: str, outstanding: frozenset[Part] | set[Part], now: float) -> list[str]:
        """A save failed with ``outstanding`` parts still to answer: the ids whose folder to delete now (this one
        when nothing is outstanding, and any given up to stay within ``limit``)."""
        if not outstanding:
            return [snapshot]
        self._waiting[snapshot] = _Waiting(session, set(outstanding), now)
        doomed = []
        while len(self._waiting) > self.limit:
            oldest = next(iter(self._waiting))
            del self._waiting[oldest]
            doomed.append(oldest)
        return doomed

    def answered(self, snapshot: str, part: Part) -> bool:
        """A writer's ``save_written`` for a failed save: True when it was the last (delete the folder now)."""
        waiting = self._waiting.get(snapshot)
        if waiting is None:
            return False
        waiting.parts.discard(part)
        if waiting.parts:
            return False
        del self._waiting[snapshot]
        return True

    def refused(self, session: str, part: Part, snapshot: str = "") -> tuple[bool, str | None]:
        """A worker's ``task_failed`` of a save of ``session``: it belongs to the failed save it names (``snapshot``)
        or, from a worker that names none, to the oldest failed save still waiting for that part (a worker runs its
        tasks in order). (whether it was one of them, the id whose folder to delete now or None)."""
        for failed, waiting in self._waiting.items():
            if waiting.session == session and part in waiting.parts and snapshot in ("", failed):
                return True, failed if self.answered(failed, part) else None
        return False, None

    def expired(self, now: float) -> list[str]:
        """The saves whose writers stayed silent ``wait_s`` since the failure: given up, their folders deleted."""
        doomed = [s for s, w in self._waiting.items() if now - w.since > self.wait_s]
        for snapshot in doomed:
            del self._waiting[snapshot]
        return doomed
