"""The files of a snapshot as every side names them: one safetensors file per stage worker (``rank<r>-<role>``), its
entry in the manifest, and the error of a snapshot that cannot be saved or restored.

Below both readers: the stage workers write and load the files (``models.snapshot_io``), rank 0 writes and checks
the manifest that lists them (``runtime.snapshots``). Torch-free, so rank 0's runtime imports it without torch.
"""

from __future__ import annotations

import msgspec


class SnapshotError(ValueError):
    """A snapshot cannot be saved or restored; the message says what differs or what is wrong."""


def file_name(rank: int, role: str) -> str:
    return f"rank{rank}-{role}.safetensors"


class FileEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    rank: int
    role: str  # the stage whose state it holds
    name: str
    bytes: int
    sha256: str
