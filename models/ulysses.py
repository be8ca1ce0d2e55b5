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
        """This rank's rows of ``x [N, ...]`` after zero-padding ``N`` to a multiple of the ranks (only this rank's
        rows are built: a view where they are all real rows, else its rows and zeros, never the whole padded copy)."""
        if self.size == 1:
            return x
        n = x.shape[0]
        per = self.padded(n) // self.size
        begin, end = self.rank * per, (self.rank + 1) * per
        if end <= n:
            return x[begin:end]
        out = x.new_zeros(per, *x.shape[1:])
        if begin < n:
            out[: n - begin] = x[begin:]
        return out

    def gather(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """Inverse of ``shard``: all ranks get the first ``n`` rows of the concatenated shards."""
        if self.size == 1:
            return x[:n]
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts)[:n]

    def _exchange(self, send: torch.Tensor) -> torch.Tensor:
        """``send [R, ...]``: ``send[r]`` goes to rank ``r``; returns ``[R, ...]`` with what rank ``r`` sent here at
        index ``r``."""
        send = send.contiguous()  # first: empty_like keeps a transposed input's strides, which the collective ignores
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # gloo implements the single-tensor form
        return recv

    def _all_to_all(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Send ``chunks[r]`` to rank ``r``; return what rank ``r`` sent here at index ``r`` (equal shapes)."""
        return list(self._exchange(torch.stack(chunks)).unbind(0))

    def seq_to_heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """``[n_local, nh, hd]`` token shard -> ``[n, nh/R, hd]`` whole (unpadded) sequence, local heads."""
        if self.size == 1:
            return x[:n]
        n_local, nh = x.shape[:2]
        hl = self.local_heads(nh)
        send = x.reshape(n_local, self.size, hl, *x.shape[2:]).transpose(0, 1)  # [R, n_local, hl, hd], one copy
        recv = self._exchange(send)
        return recv.reshape(self.size * n_local, hl, *x.shape[2:])[:n]  # rank order = token order: a view

    def qkv_to_heads(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``seq_to_heads`` of q, k and v in one all-to-all (one message per rank pair instead of three). q, k and
        v are written once each into the send buffer (no stack, then a second one per rank), and the received
        buffer is the sequence already (no concatenation)."""
        if self.size == 1:
            return q[:n], k[:n], v[:n]
        n_local, nh = q.shape[:2]
        hl = self.local_heads(nh)
        rest = q.shape[2:]
        send = q.new_empty(self.size, n_local, 3, hl, *rest)  # [R, n_local, 3, hl, hd]
        for i, t in enumerate((q, k, v)):
            send[:, :, i] = t.reshape(n_local, self.size, hl, *rest).transpose(0, 1)
        whole = self._exchange(send).reshape(self.size * n_local, 3, hl, *rest)[:n]  # [n, 3, nh/R, hd]: a view
        return whole[:, 0], whole[:, 1], whole[:, 2]

    def heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, nh/R, hd]`` whole sequence, local heads -> ``[n_local, nh, hd]`` token shard, all heads."""
        if self.size == 1:
            return x
        n, hl = x.shape[:2]
        per = self.padded(n) // self.size
        send = x.new_empty(self.size, per, hl, *x.shape[2:])  # the padded rows only are zeroed, not a padded copy
        send.view(self.size * per, hl, *x.shape[2:])[:n] = x
        send.view(self.size * per, hl, *x.shape[2:])[n:] = 0
        recv = self._exchange(send)  # [R, per, hl, hd]: rank r's heads of this rank's tokens
        return recv.transpose(0, 1).reshape(per, self.size * hl, *x.shape[2:])  # heads of rank 0, 1, ...


class StandInUlysses(Ulysses):
    """Rank ``rank`` of a ``size``-rank Ulysses group on one device and without a process group: every all-to-all
    returns tensors of the shapes the real one returns (this rank's own chunks stand in for what the others would
    send), every gather the local shard repeated. One device then runs exactly one rank's compute, its ``nh/R``
    heads over the whole sequence, its token shard, its KV share and the copies around each collective, with no
    communication: the per-rank time of a layout (split7's SP = 5) that one GPU cannot hold. The values are not the
    real model's; only the shapes and the work are."""

    def __init__(self, size: int, rank: int = 0) -> None:
        super().__init__(None)
        assert 0 <= rank < size, f"rank {rank} of a {size}-rank group"
        self.size, self.rank = size, rank

    def gather(self, x: torch.Tensor, n: int) -> torch.Tensor:
        if self.size == 1:
            return x[:n]
        return torch.cat([x] * self.size)[:n]  # the real gather's concatenation, of this rank's rows

    def _exchange(self, send: torch.Tensor) -> torch.Tensor:
        return send.contiguous()  # the real path's send buffer, nothing sent: it stands in for what arrives

