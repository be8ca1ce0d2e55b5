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


def _inv_freq(pairs: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Angular frequencies ``theta^(-2j/n)`` of one part, float64 ``[pairs]``, computed on ``device``."""
    n = 2 * pairs
    return 1.0 / torch.pow(10000.0, torch.arange(0, n, 2, dtype=torch.float64, device=device) / n)


def rope_angles(head_dim: int, frames: int, rows: int, cols: int, start_frame: int,
                device: torch.device | str = "cpu") -> torch.Tensor:  # fmt: skip
    """Rotation angles of every token of a (frames, rows, cols) grid, float64 ``[N, hd/2]``, built on ``device``
    (once per chunk: no host copy on the DiT's path).

    Tokens are ordered (frame, row, column), row-major; frame positions start at ``start_frame``.
    """
    pt, ph, pw = rope_split(head_dim)

    def positions(start: int, count: int, pairs: int) -> torch.Tensor:
        pos = torch.arange(start, start + count, dtype=torch.float64, device=device)
        return pos[:, None] * _inv_freq(pairs, device)

    ft, fh, fw = positions(start_frame, frames, pt), positions(0, rows, ph), positions(0, cols, pw)
    grid = torch.cat(
        [
            ft[:, None, None, :].expand(frames, rows, cols, pt),
            fh[None, :, None, :].expand(frames, rows, cols, ph),
            fw[None, None, :, :].expand(frames, rows, cols, pw),
        ],
        dim=-1,
    )  # [F, R, C, hd/2]
    return grid.reshape(frames * rows * cols, head_dim // 2)


def rope_freqs(angles: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """Unit rotations ``exp(i * angle)`` as complex128 ``[N, 1, hd/2]``, ready to broadcast over heads."""
    freqs = torch.polar(torch.ones_like(angles), angles)[:, None, :]
    return freqs if device is None else freqs.to(device)


def rope_rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [N, heads, hd]`` (pairs ``x[2i] + i*x[2i+1]``) by ``freqs`` and return the result in the rotation's
    own real precision, not cast back: the caller's cast then happens where the result is stored (a key is cast on
    its way into the KV ring, in the same copy), instead of in a pass of its own.

    The precision follows the table: a complex128 table rotates float32/64 inputs in float64 (the reference's path);
    a complex64 table (what a bf16 model builds), or any bf16/fp16 input, rotates in float32 with the table rounded
    once (hand a complex64 ``freqs`` to skip that conversion). So a bf16 model's q/k may arrive here still in float32
    from their RMS norm (no round trip through bf16 in between): the rotation is then one complex multiply. Against
    the reference's float64 rotation of bf16 values the result can differ by one bf16 step in rare ties, far inside
    bf16's own error.

    ``freqs`` may also be the table's real view ``[N, 1, hd/2, 2]`` (``torch.view_as_real``: cos, sin): the same
    rotation written as real multiply-adds in the table's precision, which the compiled block fuses with the q/k norm,
    the cast and the ring write (inductor does not fuse complex arithmetic).
    """
    n, heads, hd = x.shape
    if not freqs.is_complex():
        assert freqs.shape == (n, 1, hd // 2, 2), f"rope table {tuple(freqs.shape)} does not fit x {tuple(x.shape)}"
        # (re, im) -> (re cos - im sin, im cos + re sin) as one elementwise expression of x and its pairs swapped: no
        # stack of two halves, which would make the compiled block store the rotation before the ring write reads it
        pairs = x.to(freqs.dtype).reshape(n, heads, hd // 2, 2)
        cos, sin = freqs[..., :1], freqs[..., 1:]
        sign = torch.tensor([-1.0, 1.0], dtype=freqs.dtype, device=freqs.device)
        return (pairs * cos + pairs.flip(-1) * sign * sin).reshape(n, heads, hd)
    assert freqs.shape == (n, 1, hd // 2), f"rope table {tuple(freqs.shape)} does not fit x {tuple(x.shape)}"
    wide = x.dtype in (torch.float32, torch.float64) and freqs.dtype == torch.complex128
    real = torch.float64 if wide else torch.float32
    xc = torch.view_as_complex(x.to(real).reshape(n, heads, hd // 2, 2))
    out = xc * (freqs if wide or freqs.dtype == torch.complex64 else freqs.to(torch.complex64))
    return torch.view_as_real(out).reshape(n, heads, hd)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``rope_rotate`` cast to ``dtype`` (default: the dtype of ``x``)."""
    return rope_rotate(x, freqs).to(x.dtype if dtype is None else dtype)
