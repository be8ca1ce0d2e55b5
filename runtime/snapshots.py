"""Saved sessions on rank 0: snapshot ids, the manifest, its validation, and the state machine of one save.

A snapshot is a folder ``[snapshots] dir/<id>/`` holding one safetensors file per stage worker (``rank<r>-<role>``:
tensors only, written by that rank, ``models.snapshot_io``) and ``manifest.json`` (this module's ``Manifest``,
msgspec JSON: never pickle), written by rank 0 last, once every file is on disk: a folder without a manifest is
a save that did not finish and is never restored.

The id is ``secrets.token_urlsafe(16)`` (unguessable: knowing an id is the right to restore it) and nothing else is
accepted as one, so an id can never name a path outside the folder. What a restore must match is the
``Identity`` (model, layout, DiT sequence-parallel degree) and a frame size this server serves; the manifest's
sizes must match the files on disk (a truncated file is refused here), and each rank checks its file's sha256
before it loads a byte of it (a corrupt or hand-made file fails the restore with the file named).

The save of a session (``PendingSave``) goes ``waiting`` (rank 0 holds the denoise of the boundary chunk ``k``, the
first chunk not yet dispatched to the DiT, until every task of the chunks before ``k`` is in its stage's queue) ->
``capturing`` (the save tasks are out, one per stage worker, and the hold ends at once: each worker takes its tasks
in the order rank 0 sent them, so its copy is the state after chunk ``k - 1``'s work and before chunk ``k``'s,
whatever runs meanwhile; the copy is all the stream waits for) -> ``writing`` (every worker copied its state; the
files are written off the stream) -> ``done`` (every file written and hashed: the manifest is written and the owner
answered), or ``failed`` from any state.
No I/O in the state machine; ``SnapshotStore`` does the little rank 0 writes and reads (the manifest).

The retention budget (``[snapshots] max_gb``, ``max_count``): after each completed save rank 0 lists the folder's
complete snapshots (``SnapshotStore.listing``: a folder named like an id whose manifest of this format reads back
with its files; anything else in the folder is never counted nor touched) and ``over_budget`` picks the oldest (by
``created``) to delete until the rest fit, skipping the ones it is told to keep: the snapshot just written and those
a restore on this server is still loading. The shell deletes them (manifest first: a restore then says "no such
snapshot", never reads half a folder).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from ipc.protocol import ChunkControl, Stage, intrinsics_problem, steps_problem
from models.snapshot_files import FileEntry, SnapshotError, file_name
from runtime.save_rate import SaveRate

if TYPE_CHECKING:
    from runtime.control_service import LiveControls
    from runtime.placement import Placement

FORMAT = 1  # the snapshot format; a manifest of another format is refused
MANIFEST = "manifest.json"
ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{22}")  # what secrets.token_urlsafe(16) gives, and nothing else
MAX_MANIFEST_BYTES = 1 << 20
ROLES = frozenset(stage.value for stage in Stage)  # the stage workers that write a file (a stage's worker: its name)


def new_snapshot_id() -> str:
    return secrets.token_urlsafe(16)


def check_id(text: str) -> str:
    """``text`` if it has the shape of a snapshot id, else ``SnapshotError`` (no path ever comes from a client)."""
    if not isinstance(text, str) or not ID_PATTERN.fullmatch(text):
        raise SnapshotError(f"{str(text)[:40]!r} is not a snapshot id (22 characters of A-Z a-z 0-9 _ -)")
    return text


class Identity(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """What a server must share with the one that saved a snapshot to restore it."""

    model: str  # model.kind, preset and checkpoint (``model_identity``)
    layout: str  # layout.name
    world_size: int
    condition: int  # the rank of each stage: a file belongs to the rank that wrote it
    decode: int
    dit: tuple[int, ...]  # the DiT group; its size is the sequence-parallel degree the KV ring is split by
    # the ranks of every other stage (one the fields above do not name), by its name; empty, and then not written
    # (a manifest's bytes as before), while the three stages are all there are
    stages: dict[str, tuple[int, ...]] = {}

    @classmethod
    def of(cls, model: str, layout: str, where: Placement) -> Identity:
        """This server's identity: its model and the placement of its stages (the layout's ranks of each)."""
        named = {name: where.ranks_of(stage) for stage, name in _RANK_FIELDS.items()}
        others = {stage.value: where.ranks_of(stage) for stage in Stage if stage not in _RANK_FIELDS}
        return cls(model=model, layout=layout, world_size=where.world_size, stages=others,
                   **{name: r if name in _GROUPS else r[0] for name, r in named.items()})  # type: ignore[arg-type]

    def ranks_of(self, stage: Stage) -> tuple[int, ...]:
        if stage not in _RANK_FIELDS:
            return tuple(self.stages.get(stage.value, ()))
        ranks = getattr(self, _RANK_FIELDS[stage])
        return tuple(ranks) if isinstance(ranks, tuple | list) else (ranks,)

    def parts(self) -> frozenset[tuple[int, str]]:
        """The (rank, stage worker) pairs that each write a file of a snapshot saved under this identity."""
        return frozenset((rank, stage.value) for stage in Stage for rank in self.ranks_of(stage))


# the field of ``Identity`` that holds a stage's ranks in format 1 (the others are in ``stages``); a stage of several
# ranks (a group) holds them all, in the placement's order, the others their one rank
_RANK_FIELDS: dict[Stage, str] = {Stage.CONDITION: "condition", Stage.DENOISE: "dit", Stage.DECODE: "decode"}
_GROUPS = frozenset({"dit"})


class Geometry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    height: int
    width: int
    chunk_latent_frames: int
    context_shape: tuple[int, ...]
    condition_shape: tuple[int, ...]
    latent_shape: tuple[int, ...]


class LiveState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A live session's control state at the boundary (``runtime.control_service``)."""

    held: tuple[str, ...]
    revision: int
    pause_when_idle: bool
    # the snapshots already cut for chunks from the boundary on (prefetched): the restored session applies them as
    # they were (taps and motion included), then cuts from its own client's input
    cut: tuple[ChunkControl, ...] = ()


def live_state(live: LiveControls | None, controls: Mapping[int, ChunkControl], chunk: int) -> LiveState | None:
    """A live session's input at the boundary ``chunk`` (``live``: its ``LiveControls``; ``controls``: the
    snapshots it cut, by chunk): its held keys and the snapshots it already cut for chunks from ``chunk`` on
    (accepted, not yet dispatched: the boundary chunk's denoise is held)."""
    if live is None:
        return None
    cut = tuple(controls[i] for i in range(chunk, live.next_index) if i in controls)
    return LiveState(held=tuple(sorted(live.held)), revision=live.revision, pause_when_idle=live.pause_when_idle,
                     cut=cut)


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    format: int
    id: str
    identity: Identity
    geometry: Geometry
    chunk: int  # the boundary: the restored session's first chunk and next control index
    seed: int
    prompt: str  # the text in force at the boundary (a ``set_prompt``'s, if any came before it)
    num_chunks: int | None  # the session's length (absolute chunk numbers); None: endless
    intrinsics: tuple[float, float, float, float] | None
    steps: int  # the denoising steps of the saved session's latest chunk (its quality)
    live: LiveState | None
    files: tuple[FileEntry, ...]
    bytes: int  # every file together
    pause_s: float  # what the save cost the stream: the longest copy of any rank (run before chunk ``chunk``)
    write_s: float  # the slowest rank's copy-to-file and hash
    created: float  # wall-clock seconds
    wait_s: float = 0.0  # from the save request to the boundary (no cost: the chunks before it ran on)
    # the prompt chunk ``chunk`` uses (``prompt`` is its text; the condition file holds its context) and its revision,
    # which the restored session's revisions continue from
    prompt_revision: int = 0
    want: int = 0  # the saved session's steps setting (its best quality; 0: ``steps``)
    floor: int = 0  # the lowest steps the ladder may give it (0: the restoring server's ``capacity.min_steps``)


MAX_CHUNK = 2**53 - 1  # a chunk index any client reads exactly (and msgpack carries)
MAX_REVISION = 2**31 - 1  # a prompt revision, as a live input's (the frame header's int32)


def numbers_problem(manifest: Manifest) -> str | None:
    """Why a manifest's numbers cannot start a session here (a hand-made or corrupt one), or None: the chunk and
    length in range and in order, the steps a quality preset, the prompt revision in range, the camera one a
    client could give."""
    if not 0 <= manifest.chunk <= MAX_CHUNK:
        return f"chunk {manifest.chunk} is not in 0..{MAX_CHUNK}"
    if manifest.num_chunks is not None and not manifest.chunk < manifest.num_chunks <= MAX_CHUNK:
        return f"a session of {manifest.num_chunks} chunks cannot resume at chunk {manifest.chunk}"
    if not -(2**63) <= manifest.seed <= 2**64 - 1:  # what msgpack carries to the ranks
        return f"seed {manifest.seed} is not a 64-bit number"
    if not 0 <= manifest.prompt_revision <= MAX_REVISION:
        return f"prompt revision {manifest.prompt_revision} is not in 0..{MAX_REVISION}"
    if manifest.intrinsics is not None:  # a camera the model can take, as a client's open must give
        why = intrinsics_problem(manifest.intrinsics)
        if why is not None:
            return why
    for name, steps in (("steps", manifest.steps), ("want", manifest.want or None), ("floor", manifest.floor or None)):
        why = steps_problem(steps)
        if why is not None:
            return f"{name}: {why}"
    return None


def model_identity(kind: str, preset: str, checkpoint_dir: str, weights_seed: int) -> str:
    return f"{kind}|{preset}|{checkpoint_dir or f'random:{weights_seed}'}"


def geometry_of(g: object) -> Geometry:
    """The manifest's geometry of a ``models.geometry.StreamGeometry`` (read by attribute: no torch here)."""
    return Geometry(height=g.height, width=g.width, chunk_latent_frames=g.chunk_latent_frames,  # type: ignore[attr-defined]
                    context_shape=tuple(g.context_shape), condition_shape=tuple(g.condition_shape),  # type: ignore[attr-defined]
                    latent_shape=tuple(g.latent_shape))  # type: ignore[attr-defined]


def refusal(manifest: Manifest, identity: Identity, geometry: Geometry | None) -> str | None:
    """Why this server cannot restore ``manifest`` (naming each difference), or None. ``geometry``: this server's
    geometry at the snapshot's frame size (None: it does not serve that size)."""
    if manifest.format != FORMAT:
        return f"snapshot format {manifest.format}, this server reads format {FORMAT}"
    saved, here = manifest.identity, identity
    differs = []
    if saved.model != here.model:
        differs.append(f"model {saved.model!r} (this server: {here.model!r})")
    if len(saved.dit) != len(here.dit):
        differs.append(f"DiT sequence-parallel degree {len(saved.dit)} (this server: {len(here.dit)})")
    for name in ("layout", "world_size", *_RANK_FIELDS.values(), "stages"):
        if getattr(saved, name) != getattr(here, name) and not (name == "dit" and len(saved.dit) != len(here.dit)):
            differs.append(f"layout {name} {getattr(saved, name)!r} (this server: {getattr(here, name)!r})")
    m = manifest.geometry
    if geometry is None:
        differs.append(f"frame size {m.width}x{m.height}, which this server does not serve")
    elif geometry != m:
        fields = [f for f in Geometry.__struct_fields__ if getattr(m, f) != getattr(geometry, f)]
        differs.append("geometry " + ", ".join(f"{f} {getattr(m, f)} (this server: {getattr(geometry, f)})"
                                               for f in fields))
    if not differs and {(f.rank, f.role) for f in manifest.files} != here.parts():
        differs.append("its files do not cover this layout's stage workers")
    return "; ".join(differs) if differs else None


GIB = 1 << 30


@dataclass(frozen=True)
class Budget:
    """What the folder may hold (``[snapshots] max_gb``, ``max_count``); 0: no limit."""

    max_bytes: int = 0
    max_count: int = 0

    @classmethod
    def of(cls, max_gb: float, max_count: int) -> Budget:
        """Of the validated config (``runtime.config``: finite and >= 0)."""
        return cls(max(1, int(max_gb * GIB)) if max_gb > 0 else 0, max_count)  # a tiny budget is one, never none

    @property
    def limited(self) -> bool:
        return self.max_bytes > 0 or self.max_count > 0

    def exceeded(self, total: int, count: int) -> bool:
        return (self.max_bytes > 0 and total > self.max_bytes) or (self.max_count > 0 and count > self.max_count)


@dataclass(frozen=True)
class Stored:
    """A complete snapshot in the folder, as the budget counts it."""

    id: str
    created: float  # its manifest's wall-clock time
    bytes: int  # its files (the manifest's ``bytes``; the sizes were checked against the disk when listed)


def over_budget(stored: Iterable[Stored], budget: Budget, keep: Collection[str]) -> list[str]:
    """The ids to delete, oldest first, until what is left fits ``budget``; never one in ``keep`` (the snapshot
    just written, those in use). What is left may still exceed it when the kept ones alone do."""
    ordered = sorted(stored, key=lambda s: (s.created, s.id))
    total, count = sum(s.bytes for s in ordered), len(ordered)
    doomed: list[str] = []
    for snapshot in ordered:
        if not budget.exceeded(total, count):
            break
        if snapshot.id in keep:
            continue
        doomed.append(snapshot.id)
        total, count = total - snapshot.bytes, count - 1
    return doomed


def remove_files(folder: Path) -> None:
    """A snapshot's folder without its manifest, removed; what cannot be removed is left (disk, never the server)."""
    shutil.rmtree(folder, ignore_errors=True)


class SnapshotStore:
    """The folder of snapshots as rank 0 sees it: it writes and reads manifests, never the tensors."""

    def __init__(self, root: str | Path, budget: Budget | None = None, rate: SaveRate | None = None) -> None:
        self.root = Path(root)
        self.budget = budget or Budget()
        self.rate = rate or SaveRate(0.0, 1)  # how often a session may save (``runtime.save_rate``); none: no limit

    def listing(self) -> list[Stored]:
        """The folder's complete snapshots of this format. A folder not named like an id, without a manifest (a
        save in progress or failed), with a manifest that does not read back or a file missing is not one: it is
        never counted, and so never deleted."""
        try:
            entries = list(self.root.iterdir())
        except OSError:  # no folder yet (nothing saved), or unreadable: nothing to count
            return []
        stored = []
        for entry in entries:
            try:
                if not ID_PATTERN.fullmatch(entry.name) or not (entry / MANIFEST).is_file():
                    continue
                manifest = self.read(entry.name)  # each file there, at the size it lists
            except (SnapshotError, OSError, ValueError):  # another format, hand-made, unreadable (EACCES, ESTALE on
                continue  # a shared filesystem), or being deleted by a sharing replica
            on_disk = sum(f.bytes for f in manifest.files)  # checked against the disk: never a hand-made total
            if manifest.format == FORMAT and manifest.bytes == on_disk:
                stored.append(Stored(manifest.id, manifest.created, on_disk))
        return stored

    def delete(self, snapshot: str) -> None:
        """Its manifest first (a restore from then on finds no such snapshot, never half a folder), then the rest;
        what cannot be deleted is left (it costs disk, never the server)."""
        remove_files(self.unlist(snapshot))

    def unlist(self, snapshot: str) -> Path:
        """Delete its manifest (quick: from then on it is no snapshot, nothing restores it) and give its folder, whose
        files (about 25 GiB at 480x832) the caller removes off its loop (``remove_files``)."""
        folder = self.folder(snapshot)
        (folder / MANIFEST).unlink(missing_ok=True)
        return folder

    def folder(self, snapshot: str) -> Path:
        return self.root / check_id(snapshot)

    def write(self, manifest: Manifest) -> Path:
        """The manifest, atomically (a reader sees none or all of it): the save is complete from here on."""
        folder = self.folder(manifest.id)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{MANIFEST}.tmp"
        tmp.write_bytes(msgspec.json.encode(manifest))
        os.replace(tmp, folder / MANIFEST)
        return folder / MANIFEST

    def read(self, snapshot: str) -> Manifest:
        """The manifest of ``snapshot``, checked against the files present (a missing or truncated file is
        refused here; their hashes are checked by the ranks that load them)."""
        folder = self.folder(snapshot)
        path = folder / MANIFEST
        if not path.is_file():  # the folder's path is the server's business, never named to a client
            raise SnapshotError(f"no snapshot {snapshot} (or its save did not finish)")
        size = path.stat().st_size  # before a byte is read: a hand-made manifest may be gigabytes
        if size > MAX_MANIFEST_BYTES:
            raise SnapshotError(f"the manifest of snapshot {snapshot} is {size} bytes: not one of ours")
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)  # it may have grown since: never more than the limit
        if len(data) > MAX_MANIFEST_BYTES:
            raise SnapshotError(f"the manifest of snapshot {snapshot} is over {MAX_MANIFEST_BYTES} bytes: not one "
                                "of ours")
        try:
            manifest = msgspec.json.decode(data, type=Manifest)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            raise SnapshotError(f"the manifest of snapshot {snapshot} is not valid: {error}") from None
        if manifest.id != snapshot:
            raise SnapshotError(f"the manifest in folder {snapshot} names snapshot {manifest.id}")
        why = numbers_problem(manifest)
        if why is not None:  # a shared folder is writable by others: its numbers are input like a client's
            raise SnapshotError(f"snapshot {snapshot}: {why}")
        for entry in manifest.files:  # names are checked before any is opened: none can lead out of the folder
            if entry.role not in ROLES or entry.rank < 0 or entry.name != file_name(entry.rank, entry.role):
                raise SnapshotError(f"snapshot {snapshot}: file name {entry.name!r} is not one of ours")
            file = folder / entry.name
            size = file.stat().st_size if file.is_file() else -1
            if size != entry.bytes:
                what = "is missing" if size < 0 else f"has {size} bytes, the manifest says {entry.bytes}"
                raise SnapshotError(f"snapshot {snapshot}: {entry.name} {what} (truncated or replaced)")
        return manifest


class SaveState(str, Enum):
    WAITING = "waiting"  # the boundary chunk's denoise is held; the save tasks wait for chunk k-1's decode dispatch
    CAPTURING = "capturing"  # the save tasks are out
    WRITING = "writing"  # every worker captured (the hold is over); files being written
    DONE = "done"
    FAILED = "failed"


Part = tuple[int, str]  # (rank, role) of a stage worker


@dataclass(frozen=True)
class SavedSession:
    """What rank 0 keeps of a session for its manifest, taken when the save is asked for."""

    geometry: Geometry
    seed: int
    num_chunks: int | None
    intrinsics: tuple[float, float, float, float] | None
    steps: int
    want: int
    floor: int


@dataclass(frozen=True)
class AtBoundary:
    """What the manifest takes of the session at the boundary chunk itself (when the save tasks leave)."""

    prompt: str
    prompt_revision: int
    live: LiveState | None


@dataclass
class PendingSave:
    """One save of one session (see the module docstring). Events return whether they completed a phase."""

    id: str
    session: str
    owner: bytes
    req: int
    chunk: int  # the boundary k
    parts: frozenset[Part]  # every stage worker that writes a file
    asked: float  # rank-0 time of the request
    state: SaveState = SaveState.WAITING
    captured: set[Part] = field(default_factory=set)
    files: dict[Part, FileEntry] = field(default_factory=dict)
    write_s: float = 0.0
    sent: float | None = None  # when the save tasks left (the boundary was reached; the hold ended)
    captured_at: float | None = None  # when the last worker's copy was reported
    capture_s: float = 0.0  # the longest copy of any worker: what a stage spent on the save instead of the stream
    error: str | None = None
    ended: set[Part] = field(default_factory=set)  # parts that will write nothing more: a writer's error, a refusal
    facts: SavedSession | None = None  # None only before the request's checks have passed
    boundary: AtBoundary | None = None  # set when the save tasks leave (``start``)

    def start(self, now: float) -> None:
        """The save tasks are out, behind every task of the chunks before the boundary: the hold ends."""
        self._expect(SaveState.WAITING)
        self.state, self.sent = SaveState.CAPTURING, now

    def on_captured(self, part: Part, now: float, seconds: float = 0.0) -> bool:
        """A worker copied its state in ``seconds``; True when it was the last."""
        self._expect(SaveState.CAPTURING)
        self._known(part)
        self.captured.add(part)
        self.capture_s = max(self.capture_s, seconds)
        if self.captured != self.parts:
            return False
        self.state, self.captured_at = SaveState.WRITING, now
        self._maybe_done()  # a file may have been reported before the last capture (different sockets)
        return True

    def on_written(self, entry: FileEntry, write_s: float) -> bool:
        """A worker's file is on disk; True when the save is complete (write the manifest)."""
        if self.state not in (SaveState.CAPTURING, SaveState.WRITING):
            raise SnapshotError(f"save {self.id} is {self.state.value}: no file is expected")
        part = (entry.rank, entry.role)
        self._known(part)
        self.files[part] = entry
        self.write_s = max(self.write_s, write_s)
        return self._maybe_done()

    def _maybe_done(self) -> bool:
        if self.state is SaveState.WRITING and set(self.files) == set(self.parts):
            self.state = SaveState.DONE
        return self.state is SaveState.DONE

    def fail(self, error: str) -> bool:
        """True the first time (answer the owner once); the hold is released by the caller."""
        if self.state in (SaveState.DONE, SaveState.FAILED):
            return False
        self.state, self.error = SaveState.FAILED, error
        return True

    def outstanding(self) -> frozenset[Part]:
        """The parts sent the save task that have not answered for their file yet (a writer may still write)."""
        if self.sent is None:
            return frozenset()
        return self.parts - set(self.files) - self.ended

    @property
    def holds(self) -> bool:
        """Whether the boundary chunk's denoise must still wait."""
        return self.state is SaveState.WAITING

    @property
    def pause_s(self) -> float:
        """What the save cost the stream: the longest copy, which its stage ran before the boundary chunk's work."""
        return self.capture_s

    @property
    def wait_s(self) -> float:
        """From the request to the boundary: the chunks before it finishing their denoise as they would anyway."""
        return 0.0 if self.sent is None else self.sent - self.asked

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files.values())

    def ordered_files(self) -> tuple[FileEntry, ...]:
        return tuple(self.files[p] for p in sorted(self.files))

    def _expect(self, state: SaveState) -> None:
        if self.state is not state:
            raise SnapshotError(f"save {self.id} is {self.state.value}, not {state.value}")

    def _known(self, part: Part) -> None:
        if part not in self.parts:
            raise SnapshotError(f"save {self.id}: rank {part[0]} {part[1]} is not one of its stage workers")


def read_manifest(store: SnapshotStore, snapshot: str) -> tuple[Manifest | None, str]:
    """The shell's ``ReadManifest``, on a thread off rank 0's loop: (the manifest, "") or (None, why not)."""
    try:
        return store.read(snapshot), ""
    except (SnapshotError, OSError, ValueError) as error:  # OSError: EACCES, ESTALE on a shared filesystem
        return None, str(error) if isinstance(error, SnapshotError) else f"snapshot {snapshot} cannot be read " \
            f"({type(error).__name__})"


def write_manifest(store: SnapshotStore, manifest: Manifest) -> str:
    """The shell's ``WriteManifest``: the manifest stamped with the wall clock and written; "" or why it was not."""
    try:
        store.write(msgspec.structs.replace(manifest, created=wall_clock()))
    except OSError as error:
        return str(error)
    return ""


def wall_clock() -> float:
    return time.time()
