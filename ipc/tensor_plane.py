"""The tensor plane: torch.distributed process groups, one per logical edge, and the moves along them.

All groups are created once at start-up by every rank, in one fixed order, each with an explicit timeout
(``new_group``'s default is 30 minutes, not the world's). Their members follow from the stage table
(``runtime.placement.group_members``, which the launcher hands to ``build_groups``): a stage's own group, then the
out edge of each stage. Each group is used from one thread per rank only:

- ``dit``: the DiT ranks (Ulysses all-to-all), used by the denoise worker thread;
- ``condition``: the condition rank plus the DiT ranks; the condition rank broadcasts the session's prompt
  context and each chunk's condition. Used by the condition-edge thread of every member;
- ``latent``: DiT leader -> decode rank (absent when they are the same rank: local hand-off);
- ``frames``: decode rank -> coordinator rank (absent when the same rank);
- ``control``: every rank, gloo, for start-up agreement (endpoint exchange) only.

A gloo send waits for its matching receive; each edge has exactly one sender, so two ranks never both send
first. Every transfer is announced on the control plane before it happens, so the receiver knows shape and
dtype; only contiguous tensors travel.

Several NCCL groups on one GPU. The decode rank receives latents and sends frames from two threads at once, and
rank 0 broadcasts conditions while it receives frames; NCCL documents that operations of different communicators
in flight on one device can deadlock when their order differs across ranks, because a posted NCCL kernel spins
until its peer arrives. Why our pattern is safe:

1. every transfer is posted only once the data it moves cannot depend on a later transfer of the posting rank:
   a condition moves after its encode finished, a latent is awaited when its denoise was dispatched with its
   condition and control already on the DiT ranks, frames are awaited when their decode was dispatched with its
   latent already there. So a spinning kernel's peer always completes without this rank posting anything new: no
   cycle of waits can form across ranks, whatever the interleaving of the groups;
2. each group is used by one thread, in the coordinator's announcement order, on that thread's own CUDA stream
   (``ipc.streams``: every role thread has one), so transfers never queue behind a stage's kernels nor a transfer
   of another group, and a sent tensor waits only for the event recorded where it was produced;
3. NCCL point-to-point kernels occupy a few SMs each, so kernels of different communicators are co-resident and
   progress concurrently (no kernel waits for another to be scheduled);
4. nothing on a transfer thread synchronises the whole device (no ``torch.cuda.synchronize``, no
   ``empty_cache``), and no stage does so by surprise while serving: the launcher loads CUDA modules eagerly
   (``CUDA_MODULE_LOADING=EAGER``; a lazy first launch may wait for the device to drain) and every stage ran at every
   served frame size before the port opened (``ranks.warmup``: cuDNN autotuning syncs the device). A device-wide
   wait behind a spinning kernel is the hazard that remains (an allocator retry after an OOM), and every group has a
   timeout, so even then the job ends with an error naming the transfer instead of hanging.

``scripts/bench_gpu.py`` exercises two groups used concurrently from two threads per GPU when several GPUs are
present.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ipc.protocol import Edge
from ipc.streams import Handoff, hand_off, take_over

# A group to make: its name (a ``Groups`` field), its ranks, and whether it is a stage's own group (made even with one
# rank) rather than an edge between stages (local when it has one rank). The launcher takes them from the stage table
# (``runtime.placement.group_members``), in their creation order.
GroupMembers = tuple[str, list[int], bool]


@dataclass(frozen=True)
class Groups:
    """The process groups this rank belongs to (None where it is not a member or the edge is local)."""

    rank: int
    device: torch.device
    control: Any
    made: Mapping[str, Any] = field(default_factory=dict)  # by the stage table's names, in creation order

    def named(self, name: str | None) -> Any | None:
        """The group called ``name`` (a stage's ``group`` in the stage table), None for no name or no member."""
        return None if name is None else self.made.get(name)

    def of_edge(self, edge: Edge) -> Any | None:
        """The group a stage's out edge moves its tensors on (the prompt context: the condition's)."""
        return self.made.get(edge.value)


def build_groups(members: list[GroupMembers], world_size: int, backend: str, timeout_s: float,
                 device: torch.device) -> Groups:  # fmt: skip
    """Create every group, in the order of ``members`` (the same on every rank). Call once, after
    ``init_process_group``."""
    rank = dist.get_rank()
    timeout = timedelta(seconds=timeout_s)
    control = dist.new_group(list(range(world_size)), timeout=timeout, backend="gloo")
    made: dict[str, Any] = {}
    for name, ranks, own in members:
        if len(ranks) == 1 and not own:
            made[name] = None  # local hand-off; every rank skips it alike, so the order stays the same
            continue
        group = dist.new_group(ranks, timeout=timeout, backend=backend)
        made[name] = group if rank in ranks else None
    return Groups(rank=rank, device=device, control=control, made=made)


def handshake(groups: Groups) -> list[str]:
    """One tiny all-reduce on every group this rank belongs to, in their creation order (every rank walks the same
    order, so each blocking step has all its members), from the main thread before any role thread starts: every
    NCCL communicator (and its buffers) exists before the warm-up, before the rank's room is measured, and before
    two threads of a rank could use two groups at once (a communicator made lazily mid-session by one role thread,
    while another thread of the rank waits in a collective for a peer, can deadlock a co-located rank). The names
    of the groups, in order."""
    made = []
    for name in ("control", *groups.made):
        group = groups.control if name == "control" else groups.made.get(name)
        if group is None:
            continue
        device = torch.device("cpu") if name == "control" else groups.device  # control is gloo everywhere
        dist.all_reduce(torch.ones(1, device=device), group=group)
        made.append(name)
    if groups.device.type == "cuda":
        torch.cuda.synchronize(groups.device)
    return made


def broadcast(tensor: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, src: int, groups: Groups,
              group: Any) -> torch.Tensor:
    """Broadcast from global rank ``src``; ``tensor`` is given on the source, allocated elsewhere."""
    if groups.rank == src:
        assert tensor is not None and tuple(tensor.shape) == shape, (None if tensor is None else tensor.shape, shape)
        buffer = tensor.to(groups.device, dtype).contiguous()
    else:
        buffer = torch.empty(shape, dtype=dtype, device=groups.device)
    dist.broadcast(buffer, src=src, group=group)
    return buffer


def send(tensor: torch.Tensor, dst: int, groups: Groups, group: Any) -> None:
    dist.send(tensor.to(groups.device).contiguous(), dst=dst, group=group)


def recv(shape: tuple[int, ...], dtype: torch.dtype, src: int, groups: Groups, group: Any) -> torch.Tensor:
    buffer = torch.empty(shape, dtype=dtype, device=groups.device)
    dist.recv(buffer, src=src, group=group)
    return buffer


class Dropped(LookupError):
    """The session's tensors were dropped (released); what is waited for will never come."""


class Mailbox:
    """A thread-safe keyed hand-off between two threads of one rank, with deadlines on the taking side.

    ``put`` is called by the producing thread and ``take`` by the consuming one: a CUDA tensor travels with the event
    recorded on the producer's stream, which the consumer's stream waits for (``ipc.streams``); anything else as is.

    Once a session is dropped, late puts for it are discarded and takes fail with ``Dropped`` at once, so a
    transfer that lands after the release leaks nothing (the memory of dropped ids is bounded)."""

    REMEMBERED = 4096

    def __init__(self) -> None:
        self._items: dict[tuple[str, int], Handoff] = {}
        self._dropped: OrderedDict[str, None] = OrderedDict()
        self._cond = threading.Condition()

    def put(self, key: tuple[str, int], value: Any) -> None:
        with self._cond:
            if key[0] in self._dropped:
                return
            self._items[key] = hand_off(value)
            self._cond.notify_all()

    def take(self, key: tuple[str, int], timeout_s: float) -> Any:
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._items or key[0] in self._dropped, timeout=timeout_s):
                raise TimeoutError(f"no tensor for session {key[0]!r} chunk {key[1]} within {timeout_s:.0f} s")
            if key not in self._items:
                raise Dropped(f"session {key[0]!r} was released")
            handoff = self._items.pop(key)
        return take_over(handoff)

    def discard(self, key: tuple[str, int]) -> bool:
        """Drop one item nobody will take (a superseded prompt context); whether it was there."""
        with self._cond:
            return self._items.pop(key, None) is not None

    def drop_session(self, session: str) -> int:
        with self._cond:
            keys = [k for k in self._items if k[0] == session]
            for k in keys:
                del self._items[k]
            self._dropped[session] = None
            if len(self._dropped) > self.REMEMBERED:
                self._dropped.popitem(last=False)
            self._cond.notify_all()
            return len(keys)

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)
