"""Per-session caches of the DiT: the rolling self-attention KV cache with sink frames, and the text cache.

Rolling window (one ``KVCache`` per layer), ``S = window_frames * fs`` token slots, counters ``global_end``
(absolute end of what has been written) and ``local_end`` (end of the valid slots). A call with
``current_start`` and ``N`` new tokens, ``e = current_start + N``:

- append with eviction when ``e > global_end`` and ``N + local_end > S``: ``ev = N + local_end - S`` tokens
  leave, the ``sink = sink_frames * fs`` first slots never move, slots ``[sink + ev, local_end)`` shift down
  to ``[sink, local_end - ev)``; ``local_end += (e - global_end) - ev``;
- otherwise ``local_end += e - global_end`` (0 for the later calls of the same chunk, which overwrite);
- the new keys/values go to ``[local_end - N, local_end)``; attention reads slots ``[0, local_end)``.

Keys are stored after RoPE, so a cached key keeps the position it was written with. Each DiT rank holds
only its own heads (``heads`` is the local head count under Ulysses).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KVCache:
    """Rolling self-attention cache of one layer: keys/values ``[heads, S, hd]``."""

    def __init__(
        self, slots: int, sink_tokens: int, heads: int, head_dim: int, device: torch.device | str, dtype: torch.dtype
    ) -> None:
        assert 0 <= sink_tokens < slots, f"sink {sink_tokens} must be smaller than the window {slots}"
        self.slots, self.sink = slots, sink_tokens
        self.k = torch.zeros(heads, slots, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros(heads, slots, head_dim, device=device, dtype=dtype)
        self.global_end = 0
        self.local_end = 0
        self.evicted = 0  # tokens evicted by the last append (for traces)

    def update(self, k: torch.Tensor, v: torch.Tensor, current_start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v [heads, N, hd]`` of tokens starting at ``current_start``; return the window to attend."""
        n = k.shape[1]
        assert n <= self.slots - self.sink, f"{n} new tokens do not fit a window of {self.slots} with {self.sink} sink"
        end = current_start + n
        assert end >= self.global_end, f"chunk ending at {end} is behind the cache end {self.global_end}"
        # Tokens that become new slots: the whole chunk on its first call, none when it is rewritten. A gap
        # (a skipped chunk that was never written) adds only the chunk itself; positions stay absolute.
        new = min(end - self.global_end, n)
        self.evicted = 0
        if new > 0 and n + self.local_end > self.slots:
            ev = n + self.local_end - self.slots
            keep = self.local_end - ev - self.sink
            src = slice(self.sink + ev, self.sink + ev + keep)
            dst = slice(self.sink, self.sink + keep)
            self.k[:, dst] = self.k[:, src].clone()
            self.v[:, dst] = self.v[:, src].clone()
            self.local_end = self.local_end + new - ev
            self.evicted = ev
        else:
            self.local_end = self.local_end + new
        self.k[:, self.local_end - n : self.local_end] = k
        self.v[:, self.local_end - n : self.local_end] = v
        self.global_end = end
        return self.k[:, : self.local_end], self.v[:, : self.local_end]


@dataclass
class TextCache:
    """Cross-attention keys/values of every block for one session, each ``[heads, text_len, hd]``."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]


def new_kv_caches(
    layers: int,
    window_frames: int,
    sink_frames: int,
    tokens_per_frame: int,
    heads: int,
    head_dim: int,
    device: torch.device | str,
    dtype: torch.dtype,
) -> list[KVCache]:
    """One rolling cache per layer for a session (``heads`` is the rank's local head count)."""
    assert window_frames > 0, "the streaming cache needs a finite window (local_attn_size > 0)"
    return [
        KVCache(window_frames * tokens_per_frame, sink_frames * tokens_per_frame, heads, head_dim, device, dtype)
        for _ in range(layers)
    ]
