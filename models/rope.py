"""3D rotary position embedding of the Wan DiT, computed in float64.

The ``hd/2`` complex pairs of a head (``x[2i] + i*x[2i+1]``) are split into three parts for
(time, row, column): ``[hd/2 - 2*(hd/2//3), hd/2//3, hd/2//3]`` pairs. A part with ``n = 2*pairs`` real
dims rotates pair ``j`` by ``pos * theta^(-2j/n)``.

Positions policy. The reference indexes a table of 1024 positions with the *absolute* latent frame index
of the stream, so a stream longer than 1024 latent frames would index past the table and fail. We compute
the angles directly (``pos * inv_freq`` in float64, bit-identical to the table entries for positions the
table has) and therefore never crash: past ``rope_positions`` the time positions simply keep growing.
Attention only sees position *differences* through RoPE, so this is the natural extrapolation of the
table; the one effect is that the distance between the sink frames and the current chunk keeps growing
beyond anything seen in training. ``DiTConfig.rope_positions`` is kept as the documented training range.
"""

from __future__ import annotations

import torch


def rope_split(head_dim: int) -> tuple[int, int, int]:
    """Number of complex pairs for (time, row, column)."""
    assert head_dim % 2 == 0, f"head_dim {head_dim} must be even"
    half = head_dim // 2
    third = half // 3
    return half - 2 * third, third, third


def _inv_freq(pairs: int) -> torch.Tensor:
    """Angular frequencies ``theta^(-2j/n)`` of one part, float64 ``[pairs]``."""
    n = 2 * pairs
    return 1.0 / torch.pow(10000.0, torch.arange(0, n, 2, dtype=torch.float64) / n)


def rope_angles(head_dim: int, frames: int, rows: int, cols: int, start_frame: int) -> torch.Tensor:
    """Rotation angles of every token of a (frames, rows, cols) grid, float64 ``[N, hd/2]``.

    Tokens are ordered (frame, row, column), row-major; frame positions start at ``start_frame``.
    """
    pt, ph, pw = rope_split(head_dim)
    ft = torch.arange(start_frame, start_frame + frames, dtype=torch.float64)[:, None] * _inv_freq(pt)  # [F, pt]
    fh = torch.arange(rows, dtype=torch.float64)[:, None] * _inv_freq(ph)  # [R, ph]
    fw = torch.arange(cols, dtype=torch.float64)[:, None] * _inv_freq(pw)  # [C, pw]
    grid = torch.cat(
        [
            ft[:, None, None, :].expand(frames, rows, cols, pt),
            fh[None, :, None, :].expand(frames, rows, cols, ph),
            fw[None, None, :, :].expand(frames, rows, cols, pw),
        ],
        dim=-1,
    )  # [F, R, C, hd/2]
    return grid.reshape(frames * rows * cols, head_dim // 2)


def rope_cos_sin(angles: torch.Tensor, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` float64 ``[N, 1, hd/2]`` ready to broadcast over heads."""
    return torch.cos(angles)[:, None, :].to(device), torch.sin(angles)[:, None, :].to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [N, heads, hd]`` in float64 (the reference's float32 path); a bf16/fp16 ``x`` rotates in float32
    with the float64 tables rounded once, which is exact after the rounding back to bf16 and a quarter of the
    memory traffic. The result has the dtype of ``x``."""
    n, heads, hd = x.shape
    assert cos.shape == (n, 1, hd // 2), f"rope table {tuple(cos.shape)} does not fit x {tuple(x.shape)}"
    compute = torch.float64 if x.dtype in (torch.float32, torch.float64) else torch.float32
    cos, sin = cos.to(compute), sin.to(compute)
    xd = x.to(compute).reshape(n, heads, hd // 2, 2)
    re, im = xd[..., 0], xd[..., 1]  # [N, heads, hd/2]
    out = torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1)  # [N, heads, hd/2, 2]
    return out.reshape(n, heads, hd).to(x.dtype)
