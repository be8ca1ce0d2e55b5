"""The loop of each role: thin I/O shells around the stages of ``models/``.

Which thread owns which process group (one thread per group per rank):
- ``condition`` group: the DiT worker on DiT ranks; on a condition rank outside the DiT group, the
  condition-sender thread (so a long encode never delays the broadcast the DiT is waiting for);
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
from ranks.worker import RankContext, Spans, serve, tensor_plane

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


def _send_from_condition_rank(ctx: RankContext, op: str, session: str, index: int, spans: Spans) -> torch.Tensor:
    """Broadcast the context or condition from the condition rank over the condition group (source side)."""
    geometry = ctx.backend.geometry
    box, key = (ctx.contexts, (session, CONTEXT_INDEX)) if op == "context" else (ctx.conditions, (session, index))
    shape = geometry.context_shape if op == "context" else geometry.condition_shape
    lay = ctx.config.layout
    with tensor_plane(f"broadcast {op} of {session}/{index}"):  # the DiT ranks already wait: a miss is fatal
        tensor = box.take(key, _deadline(ctx))
        with spans.span(f"send_{op}"):
            tp.broadcast(tensor, tuple(shape), geometry.dtype, lay.condition, ctx.groups, ctx.groups.condition)
    if op == "context":  # the context stays for reuse until release; conditions are consumed
        box.put(key, tensor)
    return tensor


def condition_sender(ctx: RankContext) -> None:
    """On a condition rank outside the DiT group: serves the broadcasts the DiT ranks wait for."""

    def send_context(task: protocol.Task, spans: Spans) -> dict[str, object]:
        _send_from_condition_rank(ctx, "context", task.session, task.index, spans)
        return {"silent": True}

    def send_condition(task: protocol.Task, spans: Spans) -> dict[str, object]:
        _send_from_condition_rank(ctx, "condition", task.session, task.index, spans)
        return {"silent": True}

    serve(ctx, "condition_sender", {"send_context": send_context, "send_condition": send_condition})


def _receive_on_dit(ctx: RankContext, op: str, session: str, index: int, spans: Spans) -> torch.Tensor:
    lay = ctx.config.layout
    if ctx.rank == lay.condition:
        return _send_from_condition_rank(ctx, op, session, index, spans)
    geometry = ctx.backend.geometry
    shape = geometry.context_shape if op == "context" else geometry.condition_shape
    with spans.span(f"recv_{op}"), tensor_plane(f"receive {op} of {session}/{index}"):
        return tp.broadcast(None, tuple(shape), geometry.dtype, lay.condition, ctx.groups, ctx.groups.condition)


def dit_worker(ctx: RankContext) -> None:
    stage = ctx.backend.denoise
    geometry = ctx.backend.geometry
    lay = ctx.config.layout
    leader = ctx.rank == lay.dit_leader
    assert stage is not None
    cached_latents: dict[tuple[str, int], torch.Tensor] = {}  # world-cache hook: filled by a world cache

    def init(task: protocol.Task, spans: Spans) -> dict[str, object]:
        context = _receive_on_dit(ctx, "context", task.session, task.index, spans)
        with spans.span("denoise.init"):
            stage.open(SessionSpec(task.session, task.seed, task.prompt), context)
        return {} if leader else {"silent": True}

    def denoise(task: protocol.Task, spans: Spans) -> dict[str, object]:
        condition = _receive_on_dit(ctx, "condition", task.session, task.index, spans)
        control = ChunkControl.from_wire(task.control)
        if task.cached:
            with spans.span("denoise.cached"):
                latent = cached_latents.pop((task.session, task.index))
                stage.skip(task.session, task.index, control, latent=latent, condition=condition)
        else:
            with spans.span("denoise"):
                latent = stage.denoise(task.session, task.index, condition, control)
        if not leader:
            return {}  # its spans put every DiT rank on the timeline; only the leader's answer moves the schedule
        latent = latent.to(geometry.dtype)
        if lay.decode == ctx.rank:
            ctx.latents.put((task.session, task.index), latent)
        else:
            with spans.span("send_latent"), tensor_plane(f"send latent {task.session}/{task.index}"):
                tp.send(latent, lay.decode, ctx.groups, ctx.groups.latent)
        return {}

    def release(task: protocol.Task, spans: Spans) -> dict[str, object]:
        with spans.span("denoise.release"):
            stage.release(task.session)
        return {"released": "denoise"}  # every DiT rank answers: each holds its own shard of the caches

    serve(ctx, "dit", {"init": init, "denoise": denoise, "release": release})


def latent_receiver(ctx: RankContext) -> None:
    """On a decode rank that is not the DiT leader: posts the receive for each announced latent."""
    geometry = ctx.backend.geometry
    lay = ctx.config.layout

    def expect_latent(task: protocol.Task, spans: Spans) -> dict[str, object]:
        with spans.span("recv_latent"), tensor_plane(f"receive latent {task.session}/{task.index}"):
            latent = tp.recv(tuple(geometry.latent_shape), geometry.dtype, lay.dit_leader, ctx.groups,
                             ctx.groups.latent)
        ctx.latents.put((task.session, task.index), latent)
        return {"silent": True}

    serve(ctx, "latent_receiver", {"expect_latent": expect_latent})


def decode_worker(ctx: RankContext) -> None:
    stage = ctx.backend.decode
    lay = ctx.config.layout
    assert stage is not None

    def init(task: protocol.Task, spans: Spans) -> None:
        with spans.span("decode.init"):
            stage.open(task.session)

    def decode(task: protocol.Task, spans: Spans) -> None:
        with tensor_plane(f"latent {task.session}/{task.index} never arrived"):
            latent = ctx.latents.take((task.session, task.index), _deadline(ctx))
        with spans.span("decode"):
            frames = stage.decode(task.session, task.index, latent)
        frames = frames.to("cpu", torch.uint8).contiguous()
        if lay.coordinator == ctx.rank:
            ctx.frames.put((task.session, task.index), frames)
        else:
            with spans.span("send_frames"), tensor_plane(f"send frames {task.session}/{task.index}"):
                tp.send(frames, lay.coordinator, ctx.groups, ctx.groups.frames)

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
        with spans.span("recv_frames"), tensor_plane(f"receive frames {task.session}/{task.index}"):
            frames = tp.recv(geometry.frames_shape(task.index), torch.uint8, lay.decode, ctx.groups,
                             ctx.groups.frames)
        ctx.frames.put((task.session, task.index), frames.cpu())

    serve(ctx, "frames", {"expect_frames": expect_frames})
