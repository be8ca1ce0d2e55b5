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
    """``SnapshotError`` naming the first floating-point tensor of ``state`` holding a NaN or an infinity.

    By its sum, which a NaN or an infinity makes non-finite: about 2 GiB/s on a loaded CPU core, where
    ``isfinite(...).all()`` reads 0.1 GiB/s (a 4.3 GiB DiT file: 2 s, not 45). The sum overflows only past
    3.4e38 in float32 and bfloat16 (a state no model writes: refused too); float16's range is too small for that, so
    its sum is taken in float32."""
    for name, tensor in state.items():
        if not tensor.is_floating_point():
            continue
        total = tensor.sum(dtype=torch.float32) if tensor.dtype == torch.float16 else tensor.sum()
        if not bool(torch.isfinite(total)):
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
