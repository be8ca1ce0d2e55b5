"""Per-session caches of the DiT: the rolling self-attention KV cache with sink frames, and the text cache.

Semantics (the reference, ``shared/fixtures/golden/README.md`` section 6): a window of ``S = kv_window * fs``
token slots; the ``sink = kv_sink * fs`` first tokens of the stream stay forever; when a chunk's first call
does not fit, the oldest non-sink tokens leave; the chunk's later calls (the other denoising passes and the t = 0
refresh) rewrite the same tokens; attention reads every valid token. Keys are stored after RoPE, so a cached key
keeps the position it was written with.

Layout (ours). The reference shifts the kept tokens down on every eviction (a copy of the whole window per layer
and per chunk: ~23 GB of memory traffic per v1 chunk at 480x832). Here the non-sink part of the window is a ring:
a new chunk is written in place over exactly the slots of the tokens it evicts, nothing else moves. Attention is
unmasked and every position is already encoded in the keys, so the order of the slots does not matter: the valid
slots are always the prefix ``[0, filled)`` and the result equals the reference's up to float summation order.

One ``KVCache`` serves every layer of a session: the slot bookkeeping is computed once per DiT call (``begin``)
and each layer writes its keys/values through it (``write``). Each DiT rank holds only its own heads (``heads``
is the local head count under Ulysses).

Compiled blocks and CUDA graphs (``models.compiled``) need the write to be the same code for every chunk: ``begin(...,
indexed=True)`` also fills a per-session slot index (token -> slot, on the device, at one address for the session's
life) and each layer writes with ``index_copy_`` through it. Only that index changes from chunk to chunk; the valid
prefix length ``filled`` changes while the window fills and then stays at the whole window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.dit_config import KV_POLICIES, DiTConfig, KVPolicy


class KVCache:
    """Self-attention cache of one session: per layer keys/values ``[heads, S, hd]`` and one ring; its ``policy``
    (``DiTConfig.kv_policy``) decides whether a chunk that does not fit evicts the oldest non-sink tokens."""

    def __init__(self, layers: int, slots: int, sink_tokens: int, heads: int, head_dim: int,
                 device: torch.device | str, dtype: torch.dtype,
                 policy: KVPolicy = KV_POLICIES["rolling"]) -> None:  # fmt: skip
        assert 0 <= sink_tokens < slots, f"sink {sink_tokens} must be smaller than the window {slots}"
        self.slots, self.sink = slots, sink_tokens
        self.policy = policy
        self.k = [torch.zeros(heads, slots, head_dim, device=device, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(heads, slots, head_dim, device=device, dtype=dtype) for _ in range(layers)]
        self.global_end = 0  # absolute end of the tokens written so far
        self.filled = 0  # valid slots: always the prefix [0, filled)
        self.oldest = sink_tokens  # slot of the oldest non-sink token (the next one to evict)
        self.evicted = 0  # tokens evicted by the last new chunk (for traces)
        self.positions = torch.full((slots,), -1, dtype=torch.int64)  # absolute token of each slot (CPU, traces)
        # The current chunk's slots as (first slot, first token of the chunk, count) runs: one run while the window
        # fills and whenever the ring does not wrap, at most three (free tail, ring end, ring start). Slices, not an
        # index tensor: no host-to-device copy on the DiT's path and plain copy kernels.
        self._runs: list[tuple[int, int, int]] = []
        self._slots: torch.Tensor | None = None  # the indexed form of _runs: slot of each of the call's tokens
        self.replay: object = None  # the session's captured CUDA graphs (models.compiled): they go with the cache

    @property
    def local_end(self) -> int:
        """The reference's local end counter: how many slots hold valid tokens."""
        return self.filled

    @property
    def steady(self) -> bool:
        """The window is full and every new chunk evicts: from here on only the slot index moves (what compiled
        CUDA graphs need, ``models.compiled``)."""
        return self.policy.evicts and self.filled == self.slots

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def begin(self, current_start: int, n: int, indexed: bool = False) -> None:
        """Place a call's ``n`` tokens starting at absolute token ``current_start``: a new chunk gets slots (evicting
        the oldest non-sink tokens if the window is full); a rewrite of the current chunk keeps its slots.
        ``indexed``: the layers will write through the slot index (compiled), so fill it now, outside any graph."""
        assert n <= self.slots - self.sink, f"{n} new tokens do not fit a window of {self.slots} with {self.sink} sink"
        end = current_start + n
        if end == self.global_end and sum(count for _, _, count in self._runs) == n:
            if indexed and self._slots is None:
                self._fill_slot_index()
            return  # a later pass of the same chunk: same slots
        assert current_start == self.global_end, (
            f"a chunk starting at token {current_start} does not continue the cache (which ends at {self.global_end})")
        runs: list[tuple[int, int, int]] = []
        take = min(self.slots - self.filled, n)  # free slots first (while the window fills) ...
        if take < n and not self.policy.evicts:
            raise ValueError(f"the {self.policy.name} KV cache holds {self.slots} tokens; "
                             f"tokens {current_start}..{end} do not fit")
        if take:
            runs.append((self.filled, 0, take))
        ring, done = self.slots - self.sink, take
        while done < n:  # ... then the slots of the oldest non-sink tokens, in age order, wrapping once at most
            start = self.sink + (self.oldest - self.sink + done - take) % ring
            count = min(n - done, self.slots - start)
            runs.append((start, done, count))
            done += count
        self.evicted = n - take
        self.oldest = self.sink + (self.oldest - self.sink + self.evicted) % ring
        self.filled += take
        self.global_end = end
        self._runs = runs
        for slot, first, count in runs:
            self.positions[slot : slot + count] = torch.arange(current_start + first, current_start + first + count)
        if indexed or self._slots is not None:
            self._fill_slot_index()

    def _fill_slot_index(self) -> None:
        """The slots of the current call's tokens in token order, copied into the session's one index tensor (made on
        the device from ranges: no host copy)."""
        device = self.k[0].device
        index = torch.cat([torch.arange(slot, slot + count, device=device) for slot, _, count in self._runs])
        if self._slots is None or self._slots.shape != index.shape:
            self._slots = torch.empty_like(index)
        self._slots.copy_(index)

    def layer(self, layer: int) -> LayerKV:
        """What layer ``layer`` of the call placed by ``begin`` writes and reads (indexed when ``begin`` was)."""
        assert self._runs, "begin() places a call's tokens before its layers write"
        return LayerKV(self.k[layer], self.v[layer], self.filled, self._slots, tuple(self._runs))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v [heads, n, hd]`` of the call placed by ``begin``; return the valid window ``[heads, L, hd]``."""
        return self.layer(layer).write(k, v)

    def cached_frames(self, tokens_per_frame: int) -> list[int]:
        """Absolute latent frames held now, ascending (what the reference's trace lists)."""
        valid = self.positions[: self.filled]
        return sorted({int(p) // tokens_per_frame for p in valid.tolist()})


@dataclass(frozen=True)
class LayerKV:
    """One layer's keys/values ``[heads, S, hd]`` for one call: where the call's tokens go and how many slots are
    valid. With a slot index the write is one ``index_copy_`` whatever the ring's position (the code a compiled block
    traces once); without, it copies the runs of slices (the eager reference)."""

    k: torch.Tensor
    v: torch.Tensor
    filled: int
    slots: torch.Tensor | None = None
    runs: tuple[tuple[int, int, int], ...] = ()

    def write(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v [heads, n, hd]``; return the valid window ``[heads, filled, hd]``."""
        if self.slots is not None:
            self.k.index_copy_(1, self.slots, k.to(self.k.dtype))
            self.v.index_copy_(1, self.slots, v.to(self.v.dtype))
        else:
            for slot, first, count in self.runs:
                self.k[:, slot : slot + count] = k[:, first : first + count]
                self.v[:, slot : slot + count] = v[:, first : first + count]
        return self.k[:, : self.filled], self.v[:, : self.filled]


@dataclass
class TextCache:
    """Cross-attention keys/values of every block for one session, each ``[heads, text_len, hd]``."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]


def new_kv_cache(cfg: DiTConfig, tokens_per_frame: int, heads: int, device: torch.device | str,
                 dtype: torch.dtype) -> KVCache:  # fmt: skip
    """The cache of a session as ``cfg`` sets it (layers, window, sink, policy); ``heads`` is the rank's local head
    count."""
    return KVCache(cfg.num_layers, cfg.kv_window * tokens_per_frame, cfg.kv_sink * tokens_per_frame, heads,
                   cfg.head_dim, device, dtype, cfg.policy)  # fmt: skip


def kv_cache_bytes(layers: int, kv_window: int, tokens_per_frame: int, heads: int, head_dim: int,
                   dtype: torch.dtype) -> int:  # fmt: skip
    """Bytes of one session's cache on one rank: keys and values of every layer over the whole window."""
    return 2 * layers * heads * kv_window * tokens_per_frame * head_dim * torch.finfo(dtype).bits // 8
