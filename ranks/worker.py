"""What every worker thread of a rank shares: the task loop, fatal-error handling and the heartbeat.

A role worker is a thread with its own ZeroMQ DEALER to the coordinator. It takes one task at a time (a typed
``ipc.protocol`` task, dispatched on its type), runs it and answers the completion of the task's phase with its
spans (``InitDone``, ``ChunkDone``, ``ReleaseDone``, ``TransferDone``). A failure inside a stage fails that task
(``TaskFailed``, and so that session only); a failure on the tensor plane (a peer died, a collective timed out)
or of a transfer is fatal for the rank: it answers ``TaskFailed(fatal=True)`` and exits non-zero at once, so the
job ends instead of hanging.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch
import zmq

from ipc import protocol
from ipc.protocol import Edge, Phase, Stage, WarmUp, WorkerSpan
from ipc.streams import RoleStreams
from ipc.tensor_plane import Groups, Mailbox
from ipc.transport import WorkerLink
from ranks.backend import Backend
from ranks.memory import cache_bytes
from ranks.warmup import StartGate, warm_stage
from runtime.config import LayoutConfig, TimeoutsConfig
from runtime.placement import CONTEXT_CARRIER, STAGES
from runtime.sizes import Size

log = logging.getLogger(__name__)

EXIT_FATAL = 3


class Fatal(Exception):
    """The rank cannot go on (tensor plane broken, coordinator gone)."""


@dataclass
class RankContext:
    """State shared by the worker threads of one process."""

    layout: LayoutConfig
    timeouts: TimeoutsConfig
    rank: int
    roles: list[str]
    endpoint: str
    zmq: zmq.Context
    groups: Groups
    backend: Backend
    streams: RoleStreams | None = None  # one CUDA stream per role thread (None: made from groups.device)
    sizes: tuple[Size, ...] = ()  # the frame sizes each stage thread warms its stage at before its hello
    start: StartGate | None = None  # the rank's start (``ranks.warmup``); None: no warm-up, the hellos go at once
    on_fatal: Callable[[str], None] | None = None  # on the coordinator's rank: its loop tells clients first
    room: int = -1  # bytes this rank can give to sessions (ranks.memory.room_bytes); -1: unlimited
    # (role, stage, session, height, width): compares a session's bytes with the memory model (ranks.memory)
    check_memory: Callable[[str, Any, str, int, int], None] | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    # each edge's tensors by (session, index): ``outbox`` on a broadcast edge's sender until its edge thread sends
    # them, ``inbox`` where they arrive (a receiver, or the sender's own rank for a local hand-off)
    outbox: dict[Edge, Mailbox] = field(default_factory=lambda: {edge: Mailbox() for edge in Edge})
    inbox: dict[Edge, Mailbox] = field(default_factory=lambda: edge_mailboxes())
    snapshots_dir: str = "out/snapshots"  # [snapshots] dir: where this rank writes and reads its snapshot files

    def __post_init__(self) -> None:
        if self.streams is None:
            self.streams = RoleStreams(self.groups.device)


def edge_mailboxes() -> dict[Edge, Mailbox]:
    """One mailbox per edge; a session's prompt context arrives in the one of the edge it travels over (its index
    is negative: never a chunk's)."""
    boxes = {edge: Mailbox() for edge in Edge}
    boxes[Edge.CONTEXT] = boxes[CONTEXT_CARRIER]
    return boxes


FATAL_GRACE_S = 2.0


def die(ctx: RankContext, message: str) -> None:
    """End the process with a non-zero code. On the coordinator's rank (``ctx.on_fatal`` set) the loop first gets
    ``FATAL_GRACE_S`` to tell every client (it exits by itself). Another rank, having reported the error, stays up
    for ``FATAL_GRACE_S`` first: a rank that lost a peer must not die before rank 0 has seen which rank died first
    (it names that one, then ends the job's ranks itself); heartbeats and deadlines cover a rank 0 that is gone."""
    log.error("fatal: %s", message)
    sys.stderr.flush()
    if ctx.on_fatal is not None:
        ctx.on_fatal(message)
    time.sleep(FATAL_GRACE_S)
    os._exit(EXIT_FATAL)


@contextmanager
def tensor_plane(what: str) -> Iterator[None]:
    """Errors inside are fatal: a broken edge or a collective past its deadline ends the rank."""
    try:
        yield
    except Exception as error:
        raise Fatal(f"{what}: {error}") from error


class Spans:
    """The spans of one task. On CUDA a span ends once the GPU finished what it launched (a sync of the thread's own
    stream, ``ipc.streams``: never another role's kernels): kernels run asynchronously, so without it a span would
    time the launches, and the next stage's time the work."""

    def __init__(self, streams: RoleStreams | None = None) -> None:
        self.items: list[WorkerSpan] = []
        self.streams = streams

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
            if self.streams is not None:
                self.streams.synchronize()
        finally:
            self.items.append(WorkerSpan(name, start, time.monotonic()))


Handler = Callable[[Any, Spans], None]  # (the task, its spans); raises to fail it


def completion(task: protocol.WorkerTask, stage: Stage | None, rank: int, role: str,
               spans: list[WorkerSpan]) -> protocol.Completion:
    """The answer to a task that succeeded: the completion of its phase."""
    common: dict[str, Any] = {"rank": rank, "role": role, "session": task.session, "spans": tuple(spans)}
    if task.phase is Phase.TRANSFER:
        return protocol.TransferDone(edge=type(task).edge, index=task.index, **common)  # type: ignore[union-attr]
    assert stage is not None, f"{role} runs stage tasks without a stage"
    if task.phase is Phase.INIT:
        return protocol.InitDone(stage=stage, **common)
    if task.phase is Phase.RELEASE:
        return protocol.ReleaseDone(stage=stage, **common)
    if task.phase is Phase.SAVE:  # the state is copied; its file follows from the rank's writer thread
        return protocol.SaveCaptured(stage=stage, snapshot=task.snapshot, **common)  # type: ignore[union-attr]
    return protocol.ChunkDone(stage=stage, index=task.index, **common)  # type: ignore[union-attr]


def serve(ctx: RankContext, role: str, stage: Stage | None, handlers: dict[type, Handler],
          answers: bool = True) -> None:
    """Run one role's task loop in the calling thread until shutdown; never returns on a fatal error. ``stage``:
    the stage whose tasks it runs (None for a transfer thread). ``answers=False``: a receiving end of a transfer
    whose sender answers for it; it reports failures only. First, on this thread's stream, a stage thread warms its
    stage up (``ranks.warmup``), and every thread waits for the rank's room (``StartGate``) before its hello."""
    if ctx.groups.device.type == "cuda":
        torch.cuda.set_device(ctx.groups.device)  # the current device is per thread; new threads start on cuda:0
    assert ctx.streams is not None
    with ctx.streams.enter(role):  # this thread's own CUDA stream for its whole life
        warmed: tuple[WarmUp, ...] = ()
        if ctx.start is not None:
            if stage is not None:  # here, in the thread that serves the stage: cuDNN's autotune cache is per thread
                own = ctx.groups.named(STAGES[stage].group)  # the stage's own group (the DiT's Ulysses group) or None
                warmed = warm_stage(ctx.backend, stage, ctx.sizes, ctx.groups.device, own)
                ctx.start.warmed(stage, warmed)
            if not ctx.start.wait_ready(ctx.stop):  # the rank's room, measured once every stage thread warmed
                return
        _serve_tasks(ctx, role, stage, handlers, answers, warmed)


def _serve_tasks(ctx: RankContext, role: str, stage: Stage | None, handlers: dict[type, Handler],
                 answers: bool, warmed: tuple[WarmUp, ...]) -> None:  # fmt: skip
    link = WorkerLink(ctx.zmq, ctx.endpoint, ctx.rank, role, ctx.room, warmed)  # its hello: its stage's warm-up
    try:
        while not ctx.stop.is_set():
            task = link.recv(timeout_s=0.1)
            if isinstance(task, protocol.Shutdown):
                link.send(protocol.ShutdownDone(rank=ctx.rank, role=role))
                break
            if task is None or isinstance(task, protocol.Ping):
                continue
            spans = Spans(ctx.streams)
            try:
                handler = handlers.get(type(task))
                if handler is None:  # the coordinator and this rank disagree on the layout: nothing can be trusted
                    raise Fatal(f"{role} does not run {type(task).__name__}")
                handler(task, spans)
            except Exception as error:
                # A transfer that failed leaves its edge out of step, whatever the cause: the rank cannot go on.
                fatal = isinstance(error, Fatal) or task.phase is Phase.TRANSFER
                text = str(error) if isinstance(error, Fatal) else f"{type(error).__name__}: {error}"
                link.send(protocol.TaskFailed(rank=ctx.rank, role=role, session=task.session, spans=tuple(spans.items),
                                              phase=task.phase, stage=stage, index=getattr(task, "index", -1),
                                              error=text, fatal=fatal, snapshot=getattr(task, "snapshot", "")))
                if fatal:
                    die(ctx, f"rank {ctx.rank} {role}: {text}")
                log.warning("rank %d %s %s failed: %s", ctx.rank, role, type(task).__name__, traceback.format_exc())
                continue
            if answers:
                link.send(completion(task, stage, ctx.rank, role, spans.items))
    finally:
        link.close()


def run_thread(ctx: RankContext, name: str, target: Callable[[], None]) -> threading.Thread:
    """A worker thread whose unexpected death is fatal for the rank."""

    def guarded() -> None:
        try:
            target()
        except Fatal as error:
            die(ctx, str(error))
        except Exception:
            die(ctx, f"thread {name} crashed:\n{traceback.format_exc()}")

    thread = threading.Thread(target=guarded, name=name, daemon=True)
    thread.start()
    return thread


def memory_facts() -> tuple[int, int, int]:
    rss = psutil.Process().memory_info().rss
    peak = rss
    try:
        import resource

        peak = max(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    except ImportError:  # pragma: no cover - not on Linux
        pass
    cuda = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    return rss, peak, cuda


def heartbeat(ctx: RankContext) -> None:
    """Answer the coordinator's pings with liveness, memory and clock facts; die when the coordinator is gone."""
    timeouts = ctx.timeouts
    if ctx.groups.device.type == "cuda":
        torch.cuda.set_device(ctx.groups.device)  # so memory_facts reads this rank's GPU
    if ctx.start is not None and not ctx.start.wait_ready(ctx.stop):  # its hello carries the rank's room
        return
    link = WorkerLink(ctx.zmq, ctx.endpoint, ctx.rank, "heartbeat", ctx.room)
    last_ping = time.monotonic()
    try:
        while not ctx.stop.is_set():
            message = link.recv(timeouts.heartbeat_s)
            now = time.monotonic()
            if isinstance(message, protocol.Ping):
                last_ping = now
                rss, peak, cuda = memory_facts()
                link.send(protocol.Beat(rank=ctx.rank, seq=message.seq, echo=message.sent, received=now,
                                        sent=time.monotonic(), rss=rss, peak_rss=peak, cuda_peak=cuda,
                                        room=ctx.room, cache_bytes=cache_bytes(ctx.backend)))
            elif isinstance(message, protocol.Shutdown):
                link.send(protocol.ShutdownDone(rank=ctx.rank, role="heartbeat"))
                return
            if now - last_ping > timeouts.rank_dead_s:
                die(ctx, f"rank {ctx.rank}: no ping from the coordinator for {timeouts.rank_dead_s:.0f} s")
    finally:
        link.close()
