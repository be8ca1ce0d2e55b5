"""The snapshot folder as rank 0 counts it: the retention budget kept after each save, and the folder's stats.

Sans-io: the shell lists the folder off rank 0's loop (``ListSnapshots`` -> ``SnapshotsListed``: it reads every
manifest, 1.2 s for 1,000 snapshots on a busy CPU), and only with a budget. After a completed save, from that listing,
the oldest complete snapshots are picked for deletion until the rest fit (``over_budget``), never the one just
written nor those in use here; the caller asks the shell to delete them (``DropSnapshotFiles(expired=True)``). For
``stats`` the folder is listed again (``due``) when the last listing is older than ``STORED_STALE_S``; a stats reply
shows the last listing.
"""

from __future__ import annotations

import logging

from ipc.metrics_types import SnapshotFolder
from runtime.snapshots import SnapshotStore, Stored, over_budget

log = logging.getLogger(__name__)

STORED_STALE_S = 10.0  # the snapshot folder is listed again for stats when its last listing is older
LISTING_LOST_S = 60.0  # a listing asked for and never answered (the shell's bug) is asked for again after this


class FolderBudget:
    """The folder's complete snapshots as last listed, and when."""

    def __init__(self) -> None:
        self.stored: list[Stored] | None = None
        self.stored_at = 0.0
        self.warned = False  # the budget is smaller than one snapshot: said once
        self.asked_at: float | None = None  # a listing for stats asked of the shell and not answered yet

    def due(self, store: SnapshotStore, now: float) -> bool:
        """Whether to ask the shell for a listing now (``ListSnapshots("")``): with a budget, none in flight, and
        the last one stale."""
        if not store.budget.limited or (self.asked_at is not None and now - self.asked_at < LISTING_LOST_S):
            return False
        if self.stored is not None and now - self.stored_at <= STORED_STALE_S:
            return False
        self.asked_at = now
        return True

    def after_save(self, store: SnapshotStore, written: str, stored: list[Stored] | None, in_use: set[str],
                   now: float) -> list[str]:  # fmt: skip
        """The snapshots to delete after ``written`` was saved, oldest first, from the folder's listing ``stored``
        (made off the loop: ``ListSnapshots``; None: it could not be listed). Without a budget the folder is never
        listed: it may be large, and rank 0's loop serves every stream."""
        budget = store.budget
        if not written:  # a listing for stats: what it shows, nothing deleted
            self.asked_at = None
            if stored is not None:
                self.stored, self.stored_at = stored, now
            return []
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

    def stats(self, store: SnapshotStore) -> SnapshotFolder:
        """The folder as last listed (``count`` None until the first listing arrives)."""
        budget = store.budget
        if not budget.limited or self.stored is None:
            return SnapshotFolder(count=None, bytes=None, max_bytes=budget.max_bytes, max_count=budget.max_count)
        return SnapshotFolder(count=len(self.stored), bytes=sum(s.bytes for s in self.stored),
                              max_bytes=budget.max_bytes, max_count=budget.max_count)
