"""Ulysses sequence parallelism over a process group handed in by the caller.

The tokens of a chunk are sharded across the ``R`` ranks of the DiT group (padded to a multiple of ``R``);
everything per token (embeddings, camera, cross-attention, FFN, head) runs on the local shard. Around the
self-attention one all-to-all (q, k and v together) scatters heads and gathers the sequence
(``[n, nh, hd] -> [N_pad, nh/R, hd]``), so each rank attends over the whole sequence for its ``nh/R`` heads
(and its KV cache holds only those heads); a second all-to-all brings the outputs back to the token shards.
The q/k RMS norm runs over the full width before the split, exactly as in one process. ``Ulysses(None)`` is
the one-rank identity.

``attend_overlapped`` is the same computation with the local heads in groups, every exchange started with
``async_op=True``: group i+1's q/k/v are in flight while group i attends, and group i's output travels back while
group i+1 attends (``model.overlap_all_to_all``). The collectives run on the process group's own stream (NCCL) or
threads (gloo), so no stream of our own is needed and the CPU runs the same code the GPU does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

GroupAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, slice], torch.Tensor]


@dataclass
class InFlight:
    """One all-to-all under way: ``wait()`` returns the received buffer once it is complete."""

    recv: torch.Tensor
    send: torch.Tensor | None = None  # held until the exchange ends: the collective reads it asynchronously
    work: dist.Work | None = None  # None: nothing was sent (already complete)

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        self.work, self.send = None, None
        return self.recv


def head_groups(local_heads: int) -> list[slice]:
    """The local heads in two groups for the overlapped exchange (the first the larger for an odd count: split7's 8
    heads -> 4 + 4, aggregated8's 5 -> 3 + 2): two already hide one group's exchange behind the other's attention,
    and every group more is one more pair of collectives and an attention call with fewer query tiles."""
    if local_heads < 2:
        return [slice(0, local_heads)]
    half = (local_heads + 1) // 2
    return [slice(0, half), slice(half, local_heads)]


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

    def _start(self, send: torch.Tensor) -> InFlight:
        """Start sending ``send [R, ...]``: ``send[r]`` goes to rank ``r``; the result holds ``[R, ...]`` with what
        rank ``r`` sent here at index ``r``."""
        send = send.contiguous()  # first: empty_like keeps a transposed input's strides, which the collective ignores
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)  # gloo has the single-tensor form
        return InFlight(recv, send, work)

    def _exchange(self, send: torch.Tensor) -> torch.Tensor:
        return self._start(send).wait()

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
        heads = slice(0, self.local_heads(q.shape[1]))
        return self._qkv_received(self._exchange(self._qkv_send(q, k, v, heads)), n)

    def _qkv_send(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: slice) -> torch.Tensor:
        """The send buffer ``[R, n_local, 3, g, hd]`` of local heads ``heads`` (of every rank's share)."""
        n_local, nh = q.shape[:2]
        hl, rest = self.local_heads(nh), q.shape[2:]
        send = q.new_empty(self.size, n_local, 3, heads.stop - heads.start, *rest)
        for i, t in enumerate((q, k, v)):
            send[:, :, i] = t.reshape(n_local, self.size, hl, *rest)[:, :, heads].transpose(0, 1)
        return send

    def _qkv_received(self, recv: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``[n, g, hd]`` of the received ``[R, n_local, 3, g, hd]``: rank order = token order, views."""
        whole = recv.reshape(recv.shape[0] * recv.shape[1], *recv.shape[2:])[:n]
        return whole[:, 0], whole[:, 1], whole[:, 2]

    def heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, nh/R, hd]`` whole sequence, local heads -> ``[n_local, nh, hd]`` token shard, all heads."""
        if self.size == 1:
            return x
        recv = self._exchange(self._seq_send(x))  # [R, per, hl, hd]: rank r's heads of this rank's tokens
        return recv.transpose(0, 1).reshape(recv.shape[1], -1, *x.shape[2:])  # heads of rank 0, 1, ...

    def _seq_send(self, x: torch.Tensor) -> torch.Tensor:
        """The send buffer ``[R, per, g, hd]`` of ``x [n, g, hd]``: the padded rows only are zeroed, not a padded
        copy made."""
        n, g = x.shape[:2]
        per = self.padded(n) // self.size
        send = x.new_empty(self.size, per, g, *x.shape[2:])
        send.view(self.size * per, g, *x.shape[2:])[:n] = x
        send.view(self.size * per, g, *x.shape[2:])[n:] = 0
        return send

    def attend_overlapped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int,
                          attend: GroupAttention) -> torch.Tensor:  # fmt: skip
        """``heads_to_seq(attend(*qkv_to_heads(q, k, v, n), all local heads))`` with the local heads in groups
        (``head_groups``): every group's q/k/v exchange starts at once, and each group's output starts back as soon as
        it is attended, so the exchanges run while the other groups attend. ``attend(q, k, v, heads)`` gets
        ``[n, g, hd]`` of local heads ``heads``; the collectives are issued in the same order on every rank."""
        if self.size == 1:
            return attend(q[:n], k[:n], v[:n], slice(0, q.shape[1]))
        groups = head_groups(self.local_heads(q.shape[1]))
        incoming = [self._start(self._qkv_send(q, k, v, heads)) for heads in groups]
        outgoing = []
        for heads in groups:
            received = incoming.pop(0).wait()  # dropped after its group: its buffer goes as soon as it was attended
            outgoing.append(self._start(self._seq_send(attend(*self._qkv_received(received, n), heads))))
        return self._seq_assembled([pending.wait() for pending in outgoing], groups)

    def _seq_assembled(self, received: list[torch.Tensor], groups: list[slice]) -> torch.Tensor:
        """``[per, nh, hd]`` token shard from each group's ``[R, per, g, hd]``: rank r's heads in order, each group at
        its place (one copy per group, as ``heads_to_seq``'s one reshape)."""
        first = received[0]
        per, rest = first.shape[1], first.shape[3:]
        out = first.new_empty(per, self.size, groups[-1].stop, *rest)
        for heads, recv in zip(groups, received):
            out[:, :, heads] = recv.transpose(0, 1)
        return out.view(per, -1, *rest)


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

    def _start(self, send: torch.Tensor) -> InFlight:
        return InFlight(send.contiguous())  # the real path's send buffer, nothing sent: it stands in for what arrives

