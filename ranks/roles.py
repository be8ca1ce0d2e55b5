"""The loop of each role: thin I/O shells around the stages of ``models/``.

Which thread owns which process group (one thread per group per rank):
- ``condition`` group: the condition-edge thread of every member (the condition rank and the DiT ranks);
- ``latent`` group: the DiT leader's worker sends, the decode rank's latent-receiver thread receives;
- ``frames`` group: the decode worker sends, the coordinator rank's frames-receiver thread receives.
"""

from __future__ import annotations

import numpy as np
import torch

from ipc import protocol
from ipc import tensor_plane as tp
from models.controls import ChunkControl
from models.stages import SessionSpec
from ranks.worker import Fatal, RankContext, Spans, serve, tensor_plane

CONTEXT_INDEX = -1  # mailbox index of a session's prompt context


def _deadline(ctx: RankContext) -> float:
    return ctx.config.timeouts.stage_s


def condition_worker(ctx: RankContext) -> None:
    stage = ctx.backend.condition
    geometry = ctx.backend.geometry
    assert stage is not None

    def init(task: protocol.Task, spans: Spans) -> None:
        image = torch.from_numpy(np.frombuffer(task.image, dtype=np.uint8).copy()).view(
            geometry.height, geometry.width, 3)
        with spans.span("condition.init"):
            context = stage.open(SessionSpec(task.session, task.seed, task.prompt, image))
        ctx.contexts.put((task.session, CONTEXT_INDEX), context.to(geometry.dtype))

    def encode(task: protocol.Task, spans: Spans) -> None:
        with spans.span("encode"):
            condition = stage.encode(task.session, task.index)
        ctx.conditions.put((task.session, task.index), condition.to(geometry.dtype))

    def release(task: protocol.Task, spans: Spans) -> dict[str, object]:
        with spans.span("condition.release"):
            stage.release(task.session)
        dropped = ctx.conditions.drop_session(task.session) + ctx.contexts.drop_session(task.session)
        return {"released": "encode", "dropped_tensors": dropped}

    serve(ctx, "condition", {"init": init, "encode": encode, "release": release})


def condition_edge(ctx: RankContext) -> None:
    """One per rank of the condition group, owning that group: the condition rank broadcasts each session's
    prompt context and each chunk's condition as soon as it is encoded; DiT ranks receive them into their
    mailbox. So the transfer overlaps the DiT's current chunk instead of delaying its next one. The coordinator
    announces every transfer to all members in the same order, so the broadcasts pair up."""
    geometry = ctx.backend.geometry
    lay = ctx.config.layout
    source, dit = ctx.rank == lay.condition, ctx.rank in lay.dit

    def move(kind: str, task: protocol.Task, spans: Spans) -> dict[str, object]:
        key = (task.session, CONTEXT_INDEX if kind == "context" else task.index)
        shape = tuple(geometry.context_shape if kind == "context" else geometry.condition_shape)
        with tensor_plane(f"{kind} of {task.session}/{task.index}"):  # the peers already wait: a miss is fatal
            tensor = None
            if source:
                box = ctx.contexts if kind == "context" else ctx.conditions
                try:
                    tensor = box.take(key, _deadline(ctx))
                except tp.Dropped:  # released meanwhile: the peers still wait, send zeros they will discard
                    tensor = torch.zeros(shape, dtype=geometry.dtype)
            with spans.span(f"{'send' if source else 'recv'}_{kind}"), tp.side_stream(ctx.groups.device):
                tensor = tp.broadcast(tensor, shape, geometry.dtype, lay.condition, ctx.groups, ctx.groups.condition)
        if dit:
            ctx.dit_inputs.put(key, tensor)
        return {} if source else {"silent": True}  # the source's answer carries the transfer span

    serve(ctx, "condition_edge", {"edge_context": lambda t, sp: move("context", t, sp),
                                  "edge_condition": lambda t, sp: move("condition", t, sp)})


def _dit_input(ctx: RankContext, session: str, index: int) -> torch.Tensor:
    with tensor_plane(f"{'context' if index == CONTEXT_INDEX else 'condition'} of {session}/{index} never arrived"):
        return ctx.dit_inputs.take((session, index), _deadline(ctx))


def dit_worker(ctx: RankContext) -> None:
    stage = ctx.backend.denoise
    geometry = ctx.backend.geometry
    lay = ctx.config.layout
    leader = ctx.rank == lay.dit_leader
    group_ranks = len(lay.dit)
    assert stage is not None

    def init(task: protocol.Task, spans: Spans) -> dict[str, object]:
        context = _dit_input(ctx, task.session, CONTEXT_INDEX)
        with spans.span("denoise.init"):
            stage.open(SessionSpec(task.session, task.seed, task.prompt), context)
        return {} if leader else {"silent": True}

    def denoise(task: protocol.Task, spans: Spans) -> dict[str, object]:
        condition = _dit_input(ctx, task.session, task.index)
        control = ChunkControl.from_wire(task.control)
        failure: Exception | None = None
        try:
            with spans.span("denoise"):
                latent = stage.denoise(task.session, task.index, condition, control)
        except Exception as error:
            if group_ranks > 1:  # the other ranks are inside a collective with this one: the group can only end
                raise Fatal(f"denoise of {task.session}/{task.index} on a {group_ranks}-rank DiT group: "
                            f"{type(error).__name__}: {error}") from error
            failure, latent = error, torch.zeros(geometry.latent_shape)  # one DiT rank: fail just the session
        if leader:
            deliver_latent(task, spans, latent.to(geometry.dtype))
        if failure is not None:
            raise failure
        return {}  # every rank's spans put it on the timeline; only the leader's answer moves the schedule

    def deliver_latent(task: protocol.Task, spans: Spans, latent: torch.Tensor) -> None:
        """The announced transfer always happens (zeros after a failure), so the edge stays in step."""
        if lay.decode == ctx.rank:
            ctx.latents.put((task.session, task.index), latent)
        else:
            with spans.span("send_latent"), tensor_plane(f"send latent {task.session}/{task.index}"):
                tp.send(latent, lay.decode, ctx.groups, ctx.groups.latent)

    def release(task: protocol.Task, spans: Spans) -> dict[str, object]:
        with spans.span("denoise.release"):
            stage.release(task.session)
        ctx.dit_inputs.drop_session(task.session)  # conditions broadcast for chunks the session never reached
        return {"released": "denoise"}  # every DiT rank answers: each holds its own shard of the caches

    serve(ctx, "dit", {"init": init, "denoise": denoise, "release": release})


def latent_receiver(ctx: RankContext) -> None:
    """On a decode rank that is not the DiT leader: posts the receive for each announced latent."""
    geometry = ctx.backend.geometry
    lay = ctx.config.layout

    def expect_latent(task: protocol.Task, spans: Spans) -> dict[str, object]:
        with spans.span("recv_latent"), tensor_plane(f"receive latent {task.session}/{task.index}"), \
                tp.side_stream(ctx.groups.device):
            latent = tp.recv(tuple(geometry.latent_shape), geometry.dtype, lay.dit_leader, ctx.groups,
                             ctx.groups.latent)
        ctx.latents.put((task.session, task.index), latent)
        return {"silent": True}

    serve(ctx, "latent_receiver", {"expect_latent": expect_latent})


def decode_worker(ctx: RankContext) -> None:
    stage = ctx.backend.decode
    geometry = ctx.backend.geometry
    lay = ctx.config.layout
    assert stage is not None

    def init(task: protocol.Task, spans: Spans) -> None:
        with spans.span("decode.init"):
            stage.open(task.session)

    def decode(task: protocol.Task, spans: Spans) -> None:
        with tensor_plane(f"latent {task.session}/{task.index} never arrived"):
            latent = ctx.latents.take((task.session, task.index), _deadline(ctx))
        failure: Exception | None = None
        try:
            with spans.span("decode"):
                frames = stage.decode(task.session, task.index, latent)
        except Exception as error:  # the session fails; the announced transfer still happens (zeros)
            failure, frames = error, torch.zeros(geometry.frames_shape(task.index), dtype=torch.uint8)
        frames = frames.to(torch.uint8).contiguous()
        if lay.coordinator == ctx.rank:
            ctx.frames.put((task.session, task.index), frames.cpu())
        else:
            with spans.span("send_frames"), tensor_plane(f"send frames {task.session}/{task.index}"):
                tp.send(frames, lay.coordinator, ctx.groups, ctx.groups.frames)
        if failure is not None:
            raise failure

    def release(task: protocol.Task, spans: Spans) -> dict[str, object]:
        with spans.span("decode.release"):
            stage.release(task.session)
        return {"released": "decode", "dropped_tensors": ctx.latents.drop_session(task.session)}

    serve(ctx, "decode", {"init": init, "decode": decode, "release": release})


def frames_receiver(ctx: RankContext) -> None:
    """On the coordinator rank when decode lives elsewhere: receives each announced chunk of frames."""
    geometry = ctx.backend.geometry
    lay = ctx.config.layout

    def expect_frames(task: protocol.Task, spans: Spans) -> None:
        with spans.span("recv_frames"), tensor_plane(f"receive frames {task.session}/{task.index}"), \
                tp.side_stream(ctx.groups.device):
            frames = tp.recv(geometry.frames_shape(task.index), torch.uint8, lay.decode, ctx.groups,
                             ctx.groups.frames)
        ctx.frames.put((task.session, task.index), frames.cpu())

    serve(ctx, "frames", {"expect_frames": expect_frames})
