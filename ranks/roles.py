"""The loop of each role: thin I/O shells around the stages of ``models/``.

Every role thread runs on its own CUDA stream (``ipc.streams``, entered by ``serve``); tensors cross threads only
through the rank's mailboxes, which carry the event recorded where each was produced.

Each task names its tensors' shapes and dtypes (``TensorSpec``), so no worker reads a global geometry: sessions may
have frames of different sizes. Which thread owns which process group (one thread per group per rank):
- ``condition`` group: the condition-edge thread of every member (the condition rank and the DiT ranks);
- ``latent`` group: the DiT leader's denoise worker sends, the decode rank's latent-receiver thread receives;
- ``frames`` group: the decode worker sends, the coordinator rank's frames-receiver thread receives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final

import numpy as np
import torch

from ipc import protocol
from ipc import tensor_plane as tp
from ipc.protocol import Edge, Stage, TensorSpec
from models import snapshot_io
from models.stages import SessionInputError, SessionSpec
from ranks import snapshot_checks, snapshot_saver
from ranks.worker import Fatal, RankContext, Spans, heartbeat, serve, tensor_plane
from runtime.placement import CONDITION_EDGE, FRAMES_RECEIVER, HEARTBEAT, LATENT_RECEIVER
from runtime.prompts import MAX_PENDING

CONTEXT_INDEX = protocol.context_index(0)  # mailbox index of a session's prompt context (later revisions: below)
STEADY_CHUNK = 1  # a session's VAE caches are at their steady size once this chunk is done (ranks.memory)
SPATIAL_STRIDE = 8  # frame pixels per condition pixel
PREFETCH_KEPT = 2  # conditions kept per session for a save: the scheduler's prefetch depth (runtime.scheduler)


def dtype_of(spec: TensorSpec) -> torch.dtype:
    dtype = getattr(torch, spec.dtype, None)
    assert isinstance(dtype, torch.dtype), f"unknown dtype {spec.dtype!r}"
    return dtype


def zeros(spec: TensorSpec) -> torch.Tensor:
    return torch.zeros(tuple(spec.shape), dtype=dtype_of(spec))


def condition_worker(ctx: RankContext) -> None:
    stage = ctx.backend.condition
    assert stage is not None
    # Per session, the latest conditions encoded (by reference, at most the prefetch depth): a save's boundary
    # chunk may already have its condition encoded, and the encoder state moved past it. A restored session
    # takes those from its snapshot (``replay``) before the stage encodes again.
    recent: dict[str, dict[int, torch.Tensor]] = {}
    replay: dict[str, dict[int, torch.Tensor]] = {}
    saver = snapshot_saver.Saver(ctx, Stage.CONDITION)
    staging = snapshot_io.HostStaging()  # this thread's pinned buffers, reused from save to save
    # Per session, the contexts of its latest ``set_prompt`` revisions (by reference): a save names the revision its
    # boundary chunk uses, which may be any of those not yet superseded (at most MAX_PENDING wait behind it).
    prompts: dict[str, dict[int, torch.Tensor]] = {}

    def init(task: protocol.InitCondition, spans: Spans) -> None:
        if task.restore:
            state, pending = snapshot_saver.split_pending(snapshot_saver.load(ctx, task.restore, Stage.CONDITION))
            snapshot_checks.check_condition(state, pending, ctx.backend.geometry.with_size(task.height, task.width),
                                            f"snapshot {task.restore}: rank {ctx.rank} condition")  # before a broadcast
            with spans.span("condition.init"):
                context = stage.load_state(SessionSpec(task.session, task.seed, task.prompt, None, task.height,
                                                       task.width), state)
            replay[task.session] = pending
            ctx.outbox[Edge.CONTEXT].put((task.session, CONTEXT_INDEX), context)
            return
        image = torch.from_numpy(np.frombuffer(task.image, dtype=np.uint8).copy()).view(
            task.image_height, task.image_width, 3)  # the start image at its own size; the stage resizes it
        with spans.span("condition.init"):
            context = stage.open(SessionSpec(task.session, task.seed, task.prompt, image, task.height, task.width))
        ctx.outbox[Edge.CONTEXT].put((task.session, CONTEXT_INDEX), context)

    def reprompt(task: protocol.EncodePrompt, spans: Spans) -> None:
        """A ``set_prompt``'s context, for its broadcast (announced once this task is answered)."""
        with spans.span("condition.prompt"):
            context = stage.context(task.prompt)
        ctx.outbox[Edge.CONTEXT].put((task.session, task.index), context)
        kept = prompts.setdefault(task.session, {})
        kept[protocol.revision_of(task.index)] = context
        for old in sorted(kept)[:-(MAX_PENDING + 1)]:
            del kept[old]

    def encode(task: protocol.ConditionChunk, spans: Spans) -> None:
        with spans.span("condition"):
            saved = replay.get(task.session, {}).pop(task.index, None)
            condition = stage.encode(task.session, task.index) if saved is None else saved.to(ctx.groups.device)
        kept = recent.setdefault(task.session, {})
        kept[task.index] = condition
        for old in [i for i in kept if i <= task.index - PREFETCH_KEPT]:
            del kept[old]
        ctx.outbox[Edge.CONDITION].put((task.session, task.index), condition)
        if task.index == STEADY_CHUNK and ctx.check_memory is not None:  # the encoder cache and its snapshot
            h, w = condition.shape[-2:]
            ctx.check_memory("condition", stage, task.session, h * SPATIAL_STRIDE, w * SPATIAL_STRIDE)

    def save(task: protocol.SaveState, spans: Spans) -> None:
        saver.ensure_room()
        with spans.span("condition.save"):
            state = dict(stage.state_dict(task.session))
            kept = prompts.get(task.session, {})
            if task.prompt_revision in kept:  # else the boundary uses the stage's own: the open's or restored one
                state["context"] = kept[task.prompt_revision]
                for old in [r for r in kept if r < task.prompt_revision]:  # revisions only grow
                    del kept[old]
            for index, condition in recent.get(task.session, {}).items():
                if index >= task.chunk:  # encoded for the boundary chunk or later, not yet denoised
                    state[f"{snapshot_saver.PENDING_PREFIX}{index}"] = condition
            for index, condition in replay.get(task.session, {}).items():  # a restored session saved again at once
                state[f"{snapshot_saver.PENDING_PREFIX}{index}"] = condition
            copy = snapshot_io.capture(state, staging)
        saver.submit(task, copy)

    def release(task: protocol.Release, spans: Spans) -> None:
        with spans.span("condition.release"):
            stage.release(task.session)
        recent.pop(task.session, None)
        replay.pop(task.session, None)
        prompts.pop(task.session, None)
        ctx.outbox[Edge.CONDITION].drop_session(task.session)
        ctx.outbox[Edge.CONTEXT].drop_session(task.session)

    serve(ctx, Stage.CONDITION.value, Stage.CONDITION,
          {protocol.InitCondition: init, protocol.ConditionChunk: encode, protocol.Release: release,
           protocol.EncodePrompt: reprompt, protocol.SaveState: save})


def condition_edge(ctx: RankContext) -> None:
    """One per rank of the condition group, owning that group: the condition rank broadcasts each session's
    prompt context and each chunk's condition as soon as it is encoded; DiT ranks receive them into their
    mailbox. So the transfer overlaps the DiT's current chunk instead of delaying its next one. The coordinator
    announces every transfer to all members in the same order, so the broadcasts pair up; the source answers."""
    lay = ctx.layout
    source, dit = ctx.rank == lay.condition, ctx.rank in lay.dit

    def move(task: protocol.BroadcastContext | protocol.BroadcastCondition, spans: Spans) -> None:
        context = isinstance(task, protocol.BroadcastContext)
        key = (task.session, task.index)  # a context's index is negative (its revision), a condition's its chunk
        shape, dtype = tuple(task.tensor.shape), dtype_of(task.tensor)
        with tensor_plane(f"{task.edge.value} of {task.session}/{task.index}"):  # the peers wait: a miss is fatal
            tensor = None
            if source:
                box = ctx.outbox[Edge.CONTEXT if context else Edge.CONDITION]
                try:
                    tensor = box.take(key, ctx.timeouts.stage_s)
                except tp.Dropped:  # released meanwhile: the peers still wait, send zeros they will discard
                    tensor = zeros(task.tensor)
            # on this thread's own stream: the span ends when this transfer did, not the rank's compute; a sent
            # condition waited (on the GPU) only for the event of its encode, taken from the mailbox
            with spans.span(f"transfer:{task.edge.value}"):
                tensor = tp.broadcast(tensor, shape, dtype, lay.condition, ctx.groups,
                                      ctx.groups.of_edge(Edge.CONDITION))
        if dit:
            ctx.inbox[task.edge].put(key, tensor)

    serve(ctx, CONDITION_EDGE, None, {protocol.BroadcastContext: move, protocol.BroadcastCondition: move},
          answers=source)


def _dit_input(ctx: RankContext, session: str, index: int) -> torch.Tensor:
    with tensor_plane(f"{'context' if index < 0 else 'condition'} of {session}/{index} never arrived"):
        return ctx.inbox[Edge.CONTEXT if index < 0 else Edge.CONDITION].take((session, index), ctx.timeouts.stage_s)


def denoise_worker(ctx: RankContext) -> None:
    stage = ctx.backend.denoise
    lay = ctx.layout
    leader = ctx.rank == lay.dit_leader
    group_ranks = len(lay.dit)
    assert stage is not None
    prompts: dict[str, int] = {}  # session -> the prompt revision its text cache holds

    saver = snapshot_saver.Saver(ctx, Stage.DENOISE)
    staging = snapshot_io.HostStaging()  # this thread's pinned buffers, reused from save to save

    def init(task: protocol.InitDenoise, spans: Spans) -> None:
        context = _dit_input(ctx, task.session, CONTEXT_INDEX)
        spec = SessionSpec(task.session, task.seed, task.prompt, height=task.height, width=task.width,
                           intrinsics=task.intrinsics)
        # A bad file is found before the stage is touched, on every rank alike (each checks its own hash); a
        # load_state is local to the rank: the group enters no collective in an init.
        state = snapshot_saver.load(ctx, task.restore, Stage.DENOISE) if task.restore else None
        with spans.span("denoise.init"):
            if state is None:
                stage.open(spec, context)
            else:
                stage.load_state(spec, context, state)  # on the host: each stage moves what it keeps
        prompts[task.session] = task.prompt_revision  # a restored session's: the snapshot's revision
        if ctx.check_memory is not None:  # the KV ring and text cache are whole once open
            ctx.check_memory("denoise", stage, task.session, task.height, task.width)

    def switch_prompt(task: protocol.DenoiseChunk) -> None:
        """The first chunk of a newer prompt revision: its context (waited for: the broadcast may still be moving)
        replaces the session's text before the passes; contexts of revisions it superseded are dropped unused."""
        current = prompts.get(task.session, 0)
        if task.prompt_revision == current:
            return
        context = _dit_input(ctx, task.session, protocol.context_index(task.prompt_revision))
        for skipped in range(current + 1, task.prompt_revision):  # announced earlier, on this edge: already here
            ctx.inbox[Edge.CONTEXT].discard((task.session, protocol.context_index(skipped)))
        stage.set_context(task.session, context)
        prompts[task.session] = task.prompt_revision

    def denoise(task: protocol.DenoiseChunk, spans: Spans) -> None:
        condition = _dit_input(ctx, task.session, task.index)
        failure: Exception | None = None
        try:
            with spans.span("denoise"):
                switch_prompt(task)
                latent = stage.denoise(task.session, task.index, condition, task.control, task.steps)
        except SessionInputError as error:  # found before the collectives, alike on every rank: the group is whole
            failure, latent = error, zeros(task.latent)
        except Exception as error:
            if group_ranks > 1:  # the other ranks are inside a collective with this one: the group can only end
                raise Fatal(f"denoise of {task.session}/{task.index} on a {group_ranks}-rank DiT group: "
                            f"{type(error).__name__}: {error}") from error
            failure, latent = error, zeros(task.latent)  # one DiT rank: fail just the session
        if leader:
            deliver_latent(task, spans, latent.to(dtype_of(task.latent)))
        if failure is not None:
            raise failure

    def deliver_latent(task: protocol.DenoiseChunk, spans: Spans, latent: torch.Tensor) -> None:
        """The announced transfer always happens (zeros after a failure), so the edge stays in step."""
        if lay.decode == ctx.rank:
            ctx.inbox[Edge.LATENT].put((task.session, task.index), latent)
        else:
            with spans.span("transfer:latent"), tensor_plane(f"send latent {task.session}/{task.index}"):
                tp.send(latent, lay.decode, ctx.groups, ctx.groups.of_edge(Edge.LATENT))

    def save(task: protocol.SaveState, spans: Spans) -> None:
        saver.ensure_room()
        with spans.span("denoise.save"):
            copy = snapshot_io.capture(stage.state_dict(task.session), staging)
        saver.submit(task, copy)

    def release(task: protocol.Release, spans: Spans) -> None:
        with spans.span("denoise.release"):
            stage.release(task.session)
        ctx.inbox[Edge.CONDITION].drop_session(task.session)  # conditions for chunks it never reached, its contexts
        prompts.pop(task.session, None)

    # Every DiT rank answers: its spans reach the timeline, its init and release are joined by the coordinator.
    serve(ctx, Stage.DENOISE.value, Stage.DENOISE,
          {protocol.InitDenoise: init, protocol.DenoiseChunk: denoise, protocol.Release: release,
           protocol.SaveState: save})


def latent_receiver(ctx: RankContext) -> None:
    """On a decode rank that is not the DiT leader: posts the receive for each announced latent."""

    def receive(task: protocol.ReceiveLatent, spans: Spans) -> None:
        with spans.span("transfer:latent"), tensor_plane(f"receive latent {task.session}/{task.index}"):
            latent = tp.recv(tuple(task.tensor.shape), dtype_of(task.tensor), ctx.layout.dit_leader, ctx.groups,
                             ctx.groups.of_edge(Edge.LATENT))
        ctx.inbox[Edge.LATENT].put((task.session, task.index), latent)

    serve(ctx, LATENT_RECEIVER, None, {protocol.ReceiveLatent: receive}, answers=False)  # the leader answers


def decode_worker(ctx: RankContext) -> None:
    stage = ctx.backend.decode
    lay = ctx.layout
    assert stage is not None

    saver = snapshot_saver.Saver(ctx, Stage.DECODE)
    staging = snapshot_io.HostStaging()  # this thread's pinned buffers, reused from save to save

    def init(task: protocol.InitDecode, spans: Spans) -> None:
        spec = SessionSpec(task.session, 0, "", height=task.height, width=task.width)
        state = snapshot_saver.load(ctx, task.restore, Stage.DECODE) if task.restore else None
        with spans.span("decode.init"):
            if state is None:
                stage.open(spec)
            else:
                stage.load_state(spec, state)

    def save(task: protocol.SaveState, spans: Spans) -> None:
        saver.ensure_room()
        with spans.span("decode.save"):
            copy = snapshot_io.capture(stage.state_dict(task.session), staging)
        saver.submit(task, copy)

    def decode(task: protocol.DecodeChunk, spans: Spans) -> None:
        with tensor_plane(f"latent {task.session}/{task.index} never arrived"):
            latent = ctx.inbox[Edge.LATENT].take((task.session, task.index), ctx.timeouts.stage_s)
        failure: Exception | None = None
        try:
            with spans.span("decode"):
                frames = stage.decode(task.session, task.index, latent)
        except Exception as error:  # the session fails; the announced transfer still happens (zeros)
            failure, frames = error, zeros(task.frames)
        frames = frames.to(torch.uint8).contiguous()
        if failure is None and task.index == STEADY_CHUNK and ctx.check_memory is not None:
            ctx.check_memory("decode", stage, task.session, *task.frames.shape[1:3])
        if lay.coordinator == ctx.rank:  # the copy to the host on this thread's stream, behind this decode only
            ctx.inbox[Edge.FRAMES].put((task.session, task.index), frames.cpu())
        else:
            with spans.span("transfer:frames"), tensor_plane(f"send frames {task.session}/{task.index}"):
                tp.send(frames, lay.coordinator, ctx.groups, ctx.groups.of_edge(Edge.FRAMES))
        if failure is not None:
            raise failure

    def release(task: protocol.Release, spans: Spans) -> None:
        with spans.span("decode.release"):
            stage.release(task.session)
        ctx.inbox[Edge.LATENT].drop_session(task.session)

    serve(ctx, Stage.DECODE.value, Stage.DECODE,
          {protocol.InitDecode: init, protocol.DecodeChunk: decode, protocol.Release: release,
           protocol.SaveState: save})


def frames_receiver(ctx: RankContext) -> None:
    """On the coordinator rank when decode lives elsewhere: receives each announced chunk of frames."""

    def receive(task: protocol.ReceiveFrames, spans: Spans) -> None:
        with spans.span("transfer:frames"), tensor_plane(f"receive frames {task.session}/{task.index}"):
            frames = tp.recv(tuple(task.tensor.shape), torch.uint8, ctx.layout.decode, ctx.groups,
                             ctx.groups.of_edge(Edge.FRAMES))
            frames = frames.cpu()  # on this thread's stream (the side stream of the transfer), not a stage's
        ctx.inbox[Edge.FRAMES].put((task.session, task.index), frames)

    serve(ctx, FRAMES_RECEIVER, None, {protocol.ReceiveFrames: receive})


# The body of each worker thread, by role (``runtime.placement.Placement.threads_on`` says which a rank runs).
THREADS: Final[Mapping[str, Callable[[RankContext], None]]] = {
    Stage.CONDITION.value: condition_worker,
    CONDITION_EDGE: condition_edge,
    Stage.DENOISE.value: denoise_worker,
    LATENT_RECEIVER: latent_receiver,
    Stage.DECODE.value: decode_worker,
    FRAMES_RECEIVER: frames_receiver,
    HEARTBEAT: heartbeat,
}
