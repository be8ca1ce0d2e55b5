"""Ulysses sequence parallelism over a process group handed in by the caller.

The tokens of a chunk are sharded across the ``R`` ranks of the DiT group (padded to a multiple of ``R``);
everything per token (embeddings, camera, cross-attention, FFN, head) runs on the local shard. Around the
self-attention one all-to-all (q, k and v together) scatters heads and gathers the sequence
(``[n, nh, hd] -> [N_pad, nh/R, hd]``), so each rank attends over the whole sequence for its ``nh/R`` heads
(and its KV cache holds only those heads); a second all-to-all brings the outputs back to the token shards.
The q/k RMS norm runs over the full width before the split, exactly as in one process. ``Ulysses(None)`` is
the one-rank identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Ulysses:
    """Token sharding and the two all-to-alls for one process group (or ``None`` for one rank)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)

    def padded(self, n: int) -> int:
        return -(-n // self.size) * self.size

    def local_heads(self, heads: int) -> int:
        assert heads % self.size == 0, f"num_heads {heads} must be divisible by the DiT ranks {self.size}"
        return heads // self.size

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``x [N, ...]`` after zero-padding ``N`` to a multiple of the ranks."""
        if self.size == 1:
            return x
        n = x.shape[0]
        pad = self.padded(n) - n
        if pad:
            x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
        per = x.shape[0] // self.size
        return x[self.rank * per : (self.rank + 1) * per]

    def gather(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """Inverse of ``shard``: all ranks get the first ``n`` rows of the concatenated shards."""
        if self.size == 1:
            return x[:n]
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts)[:n]

    def _all_to_all(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Send ``chunks[r]`` to rank ``r``; return what rank ``r`` sent here at index ``r`` (equal shapes)."""
        send = torch.stack(chunks)  # [R, ...] contiguous
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # gloo implements the single-tensor form
        return list(recv.unbind(0))

    def seq_to_heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """``[n_local, nh, hd]`` token shard -> ``[n, nh/R, hd]`` whole (unpadded) sequence, local heads."""
        if self.size == 1:
            return x[:n]
        hl = self.local_heads(x.shape[1])
        received = self._all_to_all([x[:, r * hl : (r + 1) * hl] for r in range(self.size)])
        return torch.cat(received)[:n]  # rank order = token order

    def qkv_to_heads(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``seq_to_heads`` of q, k and v in one all-to-all (one message per rank pair instead of three)."""
        if self.size == 1:
            return q[:n], k[:n], v[:n]
        x = torch.stack([q, k, v], dim=1)  # [n_local, 3, nh, hd]
        hl = self.local_heads(x.shape[2])
        received = self._all_to_all([x[:, :, r * hl : (r + 1) * hl] for r in range(self.size)])
        whole = torch.cat(received)[:n]  # [n, 3, nh/R, hd]; rank order = token order
        return whole[:, 0], whole[:, 1], whole[:, 2]

    def heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, nh/R, hd]`` whole sequence, local heads -> ``[n_local, nh, hd]`` token shard, all heads."""
        if self.size == 1:
            return x
        n = x.shape[0]
        x = torch.cat([x, x.new_zeros(self.padded(n) - n, *x.shape[1:])])
        per = x.shape[0] // self.size
        received = self._all_to_all([x[r * per : (r + 1) * per] for r in range(self.size)])
        return torch.cat(received, dim=1)  # heads of rank 0, 1, ...
