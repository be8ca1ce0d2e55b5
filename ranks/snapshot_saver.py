"""A stage worker's side of a snapshot: the copy on the worker's thread, the file on a writer thread.

The worker thread runs ``SaveState`` in its task order (so the state is the one after every task sent before it),
copies the state to host memory and answers ``save_captured`` (rank 0 then lets the DiT go on). The copy goes to
this rank-role's ``Saver`` thread, which writes and hashes the file and answers ``save_written`` on its own ZeroMQ
link (a socket belongs to one thread), while the stage runs the session's next chunks.
"""

from __future__ import annotations

import logging
import queue
import threading

import torch

from ipc import protocol
from ipc.protocol import Stage
from ipc.transport import WorkerLink
from models import snapshot_io
from ranks import snapshot_checks
from ranks.worker import RankContext
from runtime.snapshots import SnapshotError, SnapshotStore

log = logging.getLogger(__name__)

PENDING_PREFIX = "pending."  # condition-stage file: conditions encoded ahead of the boundary, by chunk index
# host copies waiting for the writer besides the one it writes: each is a rank's whole session state (4.3 GiB per
# DiT rank at 480x832), so saves that come faster than the disk takes them fail instead of filling host memory
MAX_WAITING_WRITES = 1


class Saver:
    """One writer thread per stage worker of a rank, started at its first save."""

    def __init__(self, ctx: RankContext, stage: Stage) -> None:
        self.ctx, self.stage = ctx, stage
        self.store = SnapshotStore(ctx.snapshots_dir)
        self._queue: queue.Queue[tuple[protocol.SaveState, dict[str, torch.Tensor]]] = queue.Queue()
        self._thread: threading.Thread | None = None

    def ensure_room(self) -> None:
        """Refuse a save before its copy is made when the writer is this far behind (the save fails: ``save_failed``
        with this reason; the session streams on)."""
        waiting = self._queue.qsize()  # one producer (the stage's thread): no race with another submit
        if waiting >= MAX_WAITING_WRITES:
            raise SnapshotError(f"rank {self.ctx.rank} {self.stage.value}: {waiting} snapshot copies still wait for "
                                "the disk; save again once they are written")

    def submit(self, task: protocol.SaveState, state: dict[str, torch.Tensor]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"saver-{self.stage.value}", daemon=True)
            self._thread.start()
        self._queue.put((task, state))

    def _run(self) -> None:
        ctx = self.ctx
        link = WorkerLink(ctx.zmq, ctx.endpoint, ctx.rank, f"{self.stage.value}-saver")
        try:
            while not ctx.stop.is_set():
                try:
                    task, state = self._queue.get(timeout=0.1)
                except queue.Empty:
                    continue
                link.send(self._write(task, state))
        finally:
            link.close()

    def _write(self, task: protocol.SaveState, state: dict[str, torch.Tensor]) -> protocol.SaveWritten:
        """The answer for one save: its file, or why not. Any error is this save's only (a full disk, its folder
        gone, safetensors' own ``SafetensorError``): the thread lives on for the next save, and rank 0 deletes the
        failed save's folder once every writer has answered for it (``runtime.late_writes``)."""
        ctx = self.ctx
        common = {"rank": ctx.rank, "role": self.stage.value, "session": task.session, "stage": self.stage,
                  "snapshot": task.snapshot}
        try:
            entry, seconds = snapshot_io.write(self.store.folder(task.snapshot), ctx.rank, self.stage.value, state)
        except Exception as error:  # one save fails, never the writer thread
            log.warning("rank %d: snapshot %s not written: %s: %s", ctx.rank, task.snapshot, type(error).__name__,
                        error)
            return protocol.SaveWritten(error=f"rank {ctx.rank} {self.stage.value}: {type(error).__name__}: {error}",
                                        **common)
        return protocol.SaveWritten(name=entry.name, bytes=entry.bytes, sha256=entry.sha256, seconds=seconds,
                                    **common)


def load(ctx: RankContext, snapshot: str, stage: Stage) -> dict[str, torch.Tensor]:
    """This rank's state of ``stage`` in ``snapshot`` (hash checked, every tensor finite); a bad file raises
    ``SnapshotError``."""
    store = SnapshotStore(ctx.snapshots_dir)
    manifest = store.read(snapshot)  # the files it lists, each on disk at the size it lists
    state = snapshot_io.load(store.folder(snapshot), manifest.files, snapshot, ctx.rank, stage.value)
    snapshot_checks.check_finite(state, f"snapshot {snapshot}: rank {ctx.rank} {stage.value}")
    return state


def split_pending(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[int, torch.Tensor]]:
    """(the stage's own state, the conditions encoded ahead of the boundary by index) of a condition file."""
    own = {k: v for k, v in state.items() if not k.startswith(PENDING_PREFIX)}
    pending = {int(k[len(PENDING_PREFIX):]): v for k, v in state.items() if k.startswith(PENDING_PREFIX)}
    return own, pending
