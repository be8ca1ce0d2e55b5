"""Saves on rank 0, as a part of each session (``runtime.parts``): save, advance, progress, finish, fail, the
restore's read, the folder's budget. Sans-io: the manifest is read (``ReadManifest``), written (``WriteManifest``)
and the folder listed (``ListSnapshots``) by the shell, off this state; the answers come back as events.

A save holds the denoise of the session's boundary chunk k (the first not dispatched) until every task of the
chunks before k is in its stage's queue (``advance``); then the save tasks go out and the hold ends: each worker
runs its tasks in the order they were sent, so it copies the state between k-1 and k. Its files reported, the
manifest is written; only then does the snapshot exist (``Saved``). A failed save's files are deleted once no
writer writes there any more (``runtime.late_writes``).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator

from ipc import protocol
from ipc.error_codes import ErrorCode
from ipc.protocol import clip
from runtime.capacity import Seat
from runtime.config import ServerConfig
from runtime.core_types import (
    ClientError,
    DropSnapshotFiles,
    ListSnapshots,
    ManifestWritten,
    ReadManifest,
    SnapshotsListed,
    ToWorker,
    WriteManifest,
)
from runtime.late_writes import LateWrites
from runtime.parts import Answer, Hold, Part, ToOwner
from runtime.placement import Placement, identity
from runtime.scheduler import SessionState
from runtime.session import Session
from runtime.snapshot_folder import FolderBudget
from runtime.snapshots import (
    FORMAT,
    AtBoundary,
    FileEntry,
    Identity,
    Manifest,
    PendingSave,
    SavedSession,
    SaveState,
    SnapshotError,
    SnapshotStore,
    check_id,
    geometry_of,
    live_state,
    new_snapshot_id,
)

log = logging.getLogger(__name__)

BUSY_RETRY_S = 5.0  # hint to clients refused at the session limit (and to an over-eager restore)
LATE_WRITE_WAITS = 3  # a failed save's writer may be 2 writes behind (``MAX_WAITING_WRITES``): stage_s each


class Saves(Part):
    """Every save and restore read of rank 0 (see the module docstring); per session: its save in flight and its
    latest snapshot (what the budget keeps while the session runs)."""

    def __init__(self, store: SnapshotStore, identity: Identity, where: Placement, server: ServerConfig,
                 stage_s: float) -> None:  # fmt: skip
        self.store, self.identity, self.where, self.server, self.stage_s = store, identity, where, server, stage_s
        self.pending: dict[str, PendingSave] = {}  # by session: one save at a time each
        self.writing: dict[str, PendingSave] = {}  # by snapshot: saves whose manifest the shell is writing
        self.latest: dict[str, str] = {}  # by open session: its latest snapshot ("" before its first)
        # failed saves whose writers may still write: each folder is deleted once the last is done with it
        self.late_writes = LateWrites(LATE_WRITE_WAITS * stage_s)
        self.folder = FolderBudget()  # the folder's complete snapshots as last listed (``stats``, the budget)
        self.reading: dict[int, tuple[bytes, protocol.Open]] = {}  # restores whose manifest is being read
        self.tickets: Iterator[int] = itertools.count()
        self.last: set[str] = set()  # sessions whose save in flight is their last here (a drain's): kept held

    # ---- lifecycle

    def opened(self, sid: str, now: float) -> list[Answer]:
        self.latest[sid] = ""
        return []

    def closed(self, sid: str, now: float, reason: str = "") -> list[Answer]:
        self.latest.pop(sid, None)
        self.last.discard(sid)
        save = self.pending.get(sid)
        if save is None:
            return []
        return self.failed(save, f"the session closed ({reason}) before its save finished", now)

    def dropped(self, sid: str, now: float) -> list[Answer]:
        """Its owner is answered and what its ranks wrote is deleted, as on a close; its hold is never let go
        (nothing of a dropped session runs again)."""
        self.latest.pop(sid, None)
        self.last.discard(sid)
        save = self.pending.pop(sid, None)
        out = [] if save is None else self.failed(save, "the session failed and was dropped", now)
        return [answer for answer in out if not isinstance(answer, Hold)]

    # ---- a save

    def save(self, session: Session, who: bytes, message: protocol.Save, state: SessionState, chunk: int,
             seat: Seat | None, steps: int, now: float, last: bool = False) -> list[Answer]:  # fmt: skip
        """Start a save of ``session`` at boundary ``chunk`` (the first not dispatched); the hold starts now.
        ``last`` (a drain's): not rate-limited, and the hold stays once the save's tasks are out."""
        sid = session.id
        if state is not SessionState.READY:
            raise ClientError(ErrorCode.NOT_READY if state is SessionState.INITIALIZING else ErrorCode.CLOSING,
                              f"session {sid} is {state.value}: only a running session can be saved")
        if sid in self.pending:
            raise ClientError(ErrorCode.BUSY, f"a save of session {sid} is in progress; its saved reply follows",
                              retry_after_s=BUSY_RETRY_S)
        if session.num_chunks is not None and chunk >= session.num_chunks:
            raise ClientError(ErrorCode.BAD_REQUEST, f"session {sid} has started its last chunk: nothing left to save")
        wait = None if last else self.store.rate.take(session.save_credit, now)  # 25 GiB a save at 480x832
        if wait is not None:
            raise ClientError(ErrorCode.BUSY, f"session {sid} saved as often as this server allows "
                              f"(snapshots.save_burst, saves_per_minute); the next save in {wait:.1f} s",
                              retry_after_s=wait)
        parts = self.identity.parts()  # every stage worker of the placement writes its file
        save = PendingSave(new_snapshot_id(), sid, who, message.req, chunk, parts, now)
        save.facts = SavedSession(  # the session as it is at the request (its prompt and input: at ``start``)
            geometry=geometry_of(session.geometry), seed=session.seed, num_chunks=session.num_chunks,
            intrinsics=session.intrinsics, steps=session.last_steps or steps,
            want=seat.want if seat is not None else 0, floor=seat.floor if seat is not None else 0)
        self.pending[sid] = save
        if last:
            self.last.add(sid)
        log.info("session %s: saving snapshot %s at chunk %d", sid, save.id, chunk)
        return [Hold(sid, True)]

    def waiting(self) -> list[str]:
        """The sessions whose save waits for its boundary (``advance`` each)."""
        return [sid for sid, save in self.pending.items() if save.state is SaveState.WAITING]

    def advance(self, sid: str, session: Session | None, quiet: bool, now: float) -> list[Answer]:
        """``session`` (None: gone or closing) is ``quiet`` before its boundary denoise: the save tasks go out."""
        save = self.pending[sid]
        if session is None:
            return self.failed(save, "the session closed before its save started", now)
        if not quiet:
            return []
        save.start(now)
        # the boundary chunk keeps the text in force now: the one the condition rank's file holds
        revision, text = session.prompts.pin(save.chunk)
        save.boundary = AtBoundary(prompt=text, prompt_revision=revision,
                                   live=live_state(session.live, session.controls, save.chunk))
        task = protocol.SaveState(session=sid, snapshot=save.id, chunk=save.chunk, prompt_revision=revision)
        held = [] if sid in self.last else [Hold(sid, False)]  # a last save's boundary is never denoised here
        return [*(ToWorker(identity(rank, role), task) for rank, role in sorted(save.parts)), *held]

    def progress(self, message: protocol.SaveCaptured | protocol.SaveWritten, now: float) -> list[Answer]:
        save = self.pending.get(message.session)
        part = (message.rank, message.stage.value)
        if save is None or save.id != message.snapshot:  # a late answer to a save that failed
            if isinstance(message, protocol.SaveWritten) and self.late_writes.answered(message.snapshot, part):
                return [DropSnapshotFiles(message.snapshot)]  # its last writer is done: nothing writes there now
            return []
        if isinstance(message, protocol.SaveCaptured):
            save.on_captured(part, now, sum(span.end - span.start for span in message.spans))
        elif message.error:
            save.ended.add(part)
            return self.failed(save, message.error, now)
        else:
            save.on_written(FileEntry(rank=message.rank, role=message.stage.value, name=message.name,
                                      bytes=message.bytes, sha256=message.sha256), message.seconds)
        return self._finish(save) if save.state is SaveState.DONE else []

    def _finish(self, save: PendingSave) -> list[Answer]:
        """Every file is on disk: the shell writes the manifest (``created`` stamped there) and answers."""
        facts, boundary = save.facts, save.boundary
        assert facts is not None and boundary is not None  # every file written: the save started
        manifest = Manifest(format=FORMAT, id=save.id, identity=self.identity, geometry=facts.geometry,
                            chunk=save.chunk, seed=facts.seed, prompt=boundary.prompt,
                            prompt_revision=boundary.prompt_revision, want=facts.want, floor=facts.floor,
                            num_chunks=facts.num_chunks, intrinsics=facts.intrinsics, steps=facts.steps,
                            live=boundary.live, files=save.ordered_files(), bytes=save.bytes, pause_s=save.pause_s,
                            write_s=save.write_s, created=0.0, wait_s=save.wait_s)
        del self.pending[save.session]
        self.writing[save.id] = save
        return [WriteManifest(manifest)]

    def written(self, event: ManifestWritten) -> list[Answer]:
        """The manifest is written (the save exists from here on), or it could not be."""
        save = self.writing.pop(event.snapshot)
        if event.error:
            self.last.discard(save.session)  # a later save of the session (its client's) lets its hold go again
            error = protocol.Error(req=save.req, session=save.session, code=ErrorCode.SAVE_FAILED,
                                   message=clip(f"the manifest could not be written: {event.error}"))
            return [DropSnapshotFiles(save.id),  # its ranks' files, never restorable without it: never kept
                    ToOwner(save.session, error, save.owner)]
        log.info("session %s: snapshot %s at chunk %d, %d bytes, pause %.3f s, write %.3f s", save.session, save.id,
                 save.chunk, save.bytes, save.pause_s, save.write_s)
        out: list[Answer] = [ToOwner(save.session, protocol.Saved(
            req=save.req, session=save.session, snapshot=save.id, chunk=save.chunk, bytes=save.bytes,
            pause_s=save.pause_s, write_s=save.write_s, files=len(save.files), wait_s=save.wait_s), save.owner)]
        if save.session in self.latest:  # still open
            self.latest[save.session] = save.id
        if self.store.budget.limited:  # the folder is listed off the loop, then the budget kept
            out.append(ListSnapshots(save.id))
        return out

    def failed(self, save: PendingSave, error: str, now: float) -> list[Answer]:
        holding = save.holds
        if not save.fail(error):
            return []
        self.pending.pop(save.session, None)
        self.last.discard(save.session)  # a later save of the session (its client's) lets its hold go again
        # what its ranks wrote is never restorable, never kept: deleted once no writer writes there any more
        out: list[Answer] = [DropSnapshotFiles(snapshot) for snapshot in
                             self.late_writes.failed(save.id, save.session, save.outstanding(), now)]
        log.warning("session %s: save %s failed: %s", save.session, save.id, error)
        if holding:
            out.append(Hold(save.session, False))
        out.append(ToOwner(save.session, protocol.Error(req=save.req, session=save.session, code=ErrorCode.SAVE_FAILED,
                                                        message=clip(f"save of session {save.session} failed: "
                                                                     f"{error}")), save.owner))
        return out

    def refused(self, failed: protocol.TaskFailed, now: float) -> list[Answer]:
        """A worker refused a save task (before its copy: it writes nothing): a failed save's, or the current."""
        part = (failed.rank, failed.role)
        older, doomed = self.late_writes.refused(failed.session, part, failed.snapshot)
        out: list[Answer] = [] if doomed is None else [DropSnapshotFiles(doomed)]
        save = self.pending.get(failed.session)
        if not older and save is not None and part in save.outstanding():
            save.ended.add(part)
            out += self.failed(save, f"rank {failed.rank} {failed.role}: {failed.error}", now)
        return out

    # ---- timers and the folder

    def tick(self, now: float) -> list[Answer]:
        out: list[Answer] = []
        for save in list(self.pending.values()):
            if now - save.asked > self.stage_s:  # a save never holds a stream, nor its slot, for ever
                out += self.failed(save, f"the ranks did not save the state within {self.stage_s:.0f} s", now)
        out += [DropSnapshotFiles(s) for s in self.late_writes.expired(now)]  # a writer that never answered
        if self.folder.due(self.store, now):  # for stats: the shell lists the folder off the loop
            out.append(ListSnapshots(""))
        return out

    def listed(self, event: SnapshotsListed, restoring: set[str], now: float) -> list[Answer]:
        """The folder as listed: the budget deletes the oldest snapshots over it, never one in use (``restoring``:
        what a restore still reads; its ranks load their files at init, so until it is ``opened`` or gone)."""
        in_use = restoring | {snapshot for snapshot in self.latest.values() if snapshot}
        in_use |= {message.restore for _, message in self.reading.values() if message.restore}  # manifest being read
        stored = None if event.stored is None else list(event.stored)
        return [DropSnapshotFiles(snapshot, expired=True)
                for snapshot in self.folder.after_save(self.store, event.written, stored, in_use, now)]

    # ---- a restore's read

    def read(self, who: bytes, message: protocol.Open) -> list[Answer]:
        """Open a session from a snapshot: its manifest is read off the loop (a shared folder may hold anything)."""
        try:
            snapshot = check_id(message.restore or "")
        except SnapshotError as error:
            raise ClientError(ErrorCode.BAD_SNAPSHOT, str(error)) from None
        if len(self.reading) >= self.server.max_sessions:  # reads are quick: more waiting is a flood
            raise ClientError(ErrorCode.BUSY, "too many restores are being read", retry_after_s=BUSY_RETRY_S)
        ticket = next(self.tickets)
        self.reading[ticket] = (who, message)
        return [ReadManifest(ticket, snapshot)]
