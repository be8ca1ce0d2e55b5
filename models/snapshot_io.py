"""One stage worker's part of a snapshot: its session state as one safetensors file (tensors only, never pickle).

``capture`` copies a stage's ``state_dict`` to host memory (the only part of a save on the critical path: the DiT
waits for it; ``HostStaging`` makes that one wait on pinned, reused buffers); ``write`` puts the copy on disk under a
temporary name, hashes it and renames it, on a side thread while the session streams on; ``load`` checks the file's
sha256 against the manifest before it parses a byte.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from models.snapshot_files import FileEntry, SnapshotError, file_name

HASH_BLOCK = 1 << 22


Layout = tuple[tuple[str, tuple[int, ...], torch.dtype], ...]


@dataclass
class StagingStats:
    """What the captures did, counted (tests and logs read it): tensors copied, host buffers allocated (pinned or
    not), captures that found a free set of buffers to reuse, and the events waited on (one per device capture)."""

    captures: int = 0
    copies: int = 0
    allocations: int = 0
    reused: int = 0
    events: int = 0


class HostStaging:
    """Host buffers for one stage thread's captures, reused from save to save.

    A capture of device tensors copies each of them with ``non_blocking=True`` into a page-locked (pinned) buffer of
    its shape and dtype, records one event on the thread's current stream after the last copy and waits on that
    event alone: the stage stalls for the device-to-host copy time, not for ~80 synchronous copies through pageable
    memory with a staging bounce each. Host tensors (the CPU path) are copied into ordinary buffers the same way.

    A set of buffers serves one layout (names, shapes, dtypes: one per session size). It is reused only once nothing
    outside this object still refers to its tensors or their storage (the saver thread writes a capture while the
    session streams on, and may hold it until its next task), so a copy handed out is never overwritten. At most
    ``max_sets`` sets are kept (pinned memory is the host's scarcest kind): a capture that finds none free beyond
    that gets buffers of its own that are not kept.
    """

    def __init__(self, max_sets: int = 2) -> None:
        self.max_sets = max_sets
        self._sets: list[tuple[Layout, dict[str, torch.Tensor]]] = []  # oldest first
        self.stats = StagingStats()

    def capture(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        layout: Layout = tuple((name, tuple(t.shape), t.dtype) for name, t in state.items())
        device = next((t.device for t in state.values() if t.device.type == "cuda"), None)
        buffers = self._free_set(layout)
        if buffers is None:
            buffers = {name: self._new_buffer(t, device is not None) for name, t in state.items()}
            self.stats.allocations += len(buffers)
            self._keep(layout, buffers)
        else:
            self.stats.reused += 1
        for name, tensor in state.items():
            buffers[name].copy_(tensor.detach(), non_blocking=device is not None)
        self.stats.copies += len(state)
        self.stats.captures += 1
        if device is not None:  # one wait for every copy of this capture, on the stream that queued them
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(device))
            done.synchronize()
            self.stats.events += 1
        return dict(buffers)  # a new mapping: the caller may add or drop keys without touching the kept set

    @staticmethod
    def _new_buffer(like: torch.Tensor, pinned: bool) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pinned)

    @staticmethod
    def _in_use(buffers: dict[str, torch.Tensor]) -> bool:
        # free when the only references are the kept mapping's (plus the loop's and getrefcount's own), and no
        # view of a buffer's storage lives elsewhere (two storage references: the buffer's and the one made to ask)
        return any(sys.getrefcount(t) > 3 or torch._C._storage_Use_Count(t.untyped_storage()._cdata) > 2
                   for t in buffers.values())  # fmt: skip

    def _free_set(self, layout: Layout) -> dict[str, torch.Tensor] | None:
        for i, (kept_layout, buffers) in enumerate(self._sets):
            if kept_layout == layout and not self._in_use(buffers):
                self._sets.append(self._sets.pop(i))  # most recently used last
                return buffers
        return None

    def _keep(self, layout: Layout, buffers: dict[str, torch.Tensor]) -> None:
        self._sets.append((layout, buffers))
        while len(self._sets) > self.max_sets:  # drop the oldest set nobody holds; a held one leaves with its holder
            free = next((i for i, (_, b) in enumerate(self._sets) if not self._in_use(b)), None)
            self._sets.pop(0 if free is None else free)


def capture(state: dict[str, torch.Tensor], staging: HostStaging | None = None) -> dict[str, torch.Tensor]:
    """A host copy of ``state`` that later work on the device can no longer change: through ``staging``'s reused
    pinned buffers when given (the stage threads), else freshly allocated host tensors."""
    if staging is not None:
        return staging.capture(state)
    return {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in state.items()}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def write(folder: Path, rank: int, role: str, tensors: dict[str, torch.Tensor]) -> tuple[FileEntry, float]:
    """The file of (rank, role) in ``folder`` and the seconds it took (write and hash)."""
    started = time.monotonic()
    folder.mkdir(parents=True, exist_ok=True)
    name = file_name(rank, role)
    tmp = folder / f".{name}.tmp"
    save_file(tensors, str(tmp))
    digest = sha256_of(tmp)
    os.replace(tmp, folder / name)
    entry = FileEntry(rank=rank, role=role, name=name, bytes=(folder / name).stat().st_size, sha256=digest)
    return entry, time.monotonic() - started


def load(folder: Path, files: Iterable[FileEntry], snapshot: str, rank: int, role: str) -> dict[str, torch.Tensor]:
    """The state (rank, role) saved in ``snapshot`` (its ``folder`` and the ``files`` its manifest lists, checked
    against the disk by the caller: ``runtime.snapshots.SnapshotStore.read``), its hash checked first."""
    entries = [f for f in files if (f.rank, f.role) == (rank, role)]
    if not entries:
        raise SnapshotError(f"snapshot {snapshot} holds no state of rank {rank} {role}")
    path = folder / entries[0].name
    try:
        digest = sha256_of(path)
    except OSError as error:  # deleted meanwhile (another replica's budget): named without the server's folder
        why = error.strerror or type(error).__name__
        raise SnapshotError(f"snapshot {snapshot}: {entries[0].name} cannot be read ({why})") from None
    if digest != entries[0].sha256:
        raise SnapshotError(f"snapshot {snapshot}: {entries[0].name} is corrupt (sha256 {digest[:12]}..., the "
                            f"manifest says {entries[0].sha256[:12]}...)")
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as error:
        raise SnapshotError(f"snapshot {snapshot}: {entries[0].name} is not a safetensors file: {error}") from None


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())
