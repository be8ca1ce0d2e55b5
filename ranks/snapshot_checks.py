"""The tensors of a snapshot file, checked before any of them is used (issue 33 point 6).

A snapshot folder may be shared and writable by others, and a file's sha256 only proves it is the file the manifest
names, not that rank 0 wrote it: every tensor read from it is untrusted input. A file whose tensors are not finite is
refused by every rank that loads one (a NaN in a KV cache would poison every later chunk of the session). The
condition rank's file is checked against the session's geometry as well, because its tensors leave the rank on a
collective: the prompt context and the conditions encoded ahead of the boundary (``pending.<chunk>``) are broadcast
to the DiT group with the shape and dtype rank 0 announced, and a tensor of another shape there is an assertion on
one rank while the others wait in the broadcast: the whole job ends. Checked at the stage's init instead, a bad file
fails that restore only (an init enters no collective).
"""

from __future__ import annotations

import torch

from models.geometry import StreamGeometry
from runtime.snapshots import SnapshotError


def check_finite(state: dict[str, torch.Tensor], what: str) -> None:
    """``SnapshotError`` naming the first floating-point tensor of ``state`` holding a NaN or an infinity."""
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise SnapshotError(f"{what}: tensor {name!r} holds values that are not finite")


def _check_wire(tensor: torch.Tensor | None, shape: tuple[int, ...], name: str, what: str) -> None:
    if tensor is None:
        raise SnapshotError(f"{what}: no tensor {name!r}")
    if not tensor.is_floating_point() or tuple(tensor.shape) != tuple(shape):
        raise SnapshotError(f"{what}: tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}; this session "
                            f"takes a floating-point tensor of shape {tuple(shape)}")


def check_condition(own: dict[str, torch.Tensor], pending: dict[int, torch.Tensor], geometry: StreamGeometry,
                    what: str) -> None:  # fmt: skip
    """The condition rank's file (split by ``snapshot_saver.split_pending``) fits a session of ``geometry`` (its
    frame size): the context and each pending condition have the shapes their broadcasts announce."""
    _check_wire(own.get("context"), geometry.context_shape, "context", what)
    for index, condition in sorted(pending.items()):
        if index < 0:
            raise SnapshotError(f"{what}: a condition of chunk {index}")
        _check_wire(condition, geometry.condition_shape, f"pending.{index}", what)
