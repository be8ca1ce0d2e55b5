"""The snapshot folder as rank 0 counts it: the retention budget kept after each save, and the folder's stats.

Moved out of the coordinator core as it was (``runtime.core`` calls it; the listing still runs on rank 0's loop, as
before, and only with a budget). After a completed save it lists the folder's complete snapshots
(``SnapshotStore.listing``) and picks the oldest to delete until the rest fit (``over_budget``), never the one just
written nor those in use here; the caller asks the shell to delete them (``DropSnapshotFiles(expired=True)``).
"""

from __future__ import annotations

import logging

from ipc.metrics_types import SnapshotFolder
from runtime.snapshots import SnapshotStore, Stored, over_budget

log = logging.getLogger(__name__)

STORED_STALE_S = 10.0  # a stats reply lists the snapshot folder again when its last listing is older


class FolderBudget:
    """The folder's complete snapshots as last listed, and when."""

    def __init__(self) -> None:
        self.stored: list[Stored] | None = None
        self.stored_at = 0.0
        self.warned = False  # the budget is smaller than one snapshot: said once

    def after_save(self, store: SnapshotStore, written: str, stored: list[Stored] | None, in_use: set[str],
                   now: float) -> list[str]:  # fmt: skip
        """The snapshots to delete after ``written`` was saved, oldest first, from the folder's listing ``stored``
        (made off the loop: ``ListSnapshots``; None: it could not be listed). Without a budget the folder is never
        listed: it may be large, and rank 0's loop serves every stream."""
        budget = store.budget
        if stored is None or not budget.limited:
            return []
        self.stored_at = now
        doomed = over_budget(stored, budget, {written, *in_use})
        gone = set(doomed)
        self.stored = [s for s in stored if s.id not in gone]
        if doomed:
            log.info("snapshot budget: deleted %d snapshots (%s); %d left, %d bytes", len(doomed), ", ".join(doomed),
                     len(self.stored), sum(s.bytes for s in self.stored))
        size = next((s.bytes for s in stored if s.id == written), 0)
        if budget.max_bytes and size > budget.max_bytes and not self.warned:
            self.warned = True
            log.warning("snapshots.max_gb = %.3f GiB is smaller than one snapshot (%s: %.3f GiB): each save keeps only "
                        "itself; raise the budget", budget.max_bytes / 2**30, written, size / 2**30)
        return doomed

    def list(self, store: SnapshotStore, now: float) -> list[Stored] | None:
        """The folder's complete snapshots (the store reads their manifests); None when it cannot be listed (a save
        that succeeded, or a stats request, never fails for it)."""
        try:
            listed = store.listing()
        except Exception:
            log.exception("the snapshot folder %s could not be listed", store.root)
            return None
        self.stored, self.stored_at = listed, now
        return listed

    def stats(self, store: SnapshotStore, now: float) -> SnapshotFolder:
        """The folder as last listed; listed again when that is older than ``STORED_STALE_S`` (replicas sharing it
        save too, and a ``stats`` a second must not read every manifest each time)."""
        budget = store.budget
        if not budget.limited:
            return SnapshotFolder(count=None, bytes=None)
        if self.stored is None or now - self.stored_at > STORED_STALE_S:
            self.list(store, now)
        stored = self.stored or []
        return SnapshotFolder(count=len(stored), bytes=sum(s.bytes for s in stored), max_bytes=budget.max_bytes,
                              max_count=budget.max_count)
