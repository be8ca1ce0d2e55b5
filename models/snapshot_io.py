"""One stage worker's part of a snapshot: its session state as one safetensors file (tensors only, never pickle).

``capture`` copies a stage's ``state_dict`` to host memory (the only part of a save on the critical path: the DiT
waits for it); ``write`` puts the copy on disk under a temporary name, hashes it and renames it, on a side thread
while the session streams on; ``load`` checks the file's sha256 against the manifest before it parses a byte.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from runtime.snapshots import FileEntry, SnapshotError, SnapshotStore, file_name

HASH_BLOCK = 1 << 22


def capture(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A host copy of ``state`` that later work on the device can no longer change."""
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


def load(store: SnapshotStore, snapshot: str, rank: int, role: str) -> dict[str, torch.Tensor]:
    """The state (rank, role) saved in ``snapshot``, its manifest and hash checked first."""
    manifest = store.read(snapshot)
    entries = [f for f in manifest.files if (f.rank, f.role) == (rank, role)]
    if not entries:
        raise SnapshotError(f"snapshot {snapshot} holds no state of rank {rank} {role}")
    path = store.folder(snapshot) / entries[0].name
    digest = sha256_of(path)
    if digest != entries[0].sha256:
        raise SnapshotError(f"snapshot {snapshot}: {entries[0].name} is corrupt (sha256 {digest[:12]}..., the "
                            f"manifest says {entries[0].sha256[:12]}...)")
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as error:
        raise SnapshotError(f"snapshot {snapshot}: {entries[0].name} is not a safetensors file: {error}") from None


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())
