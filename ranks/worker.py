"""What every worker thread of a rank shares: the task loop, fatal-error handling and the heartbeat.

A role worker is a thread with its own ZeroMQ DEALER to the coordinator. It takes one task at a time, runs it
and answers ``Done`` with its spans. A failure inside a stage fails that task (and so that session only); a
failure on the tensor plane (a peer died, a collective timed out) is fatal for the rank: it exits non-zero
at once, so the job ends instead of hanging.
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
from ipc.tensor_plane import Groups, Mailbox
from ipc.transport import WorkerLink
from ranks.backend import Backend
from runtime.config import Config

log = logging.getLogger(__name__)

EXIT_FATAL = 3


class Fatal(Exception):
    """The rank cannot go on (tensor plane broken, coordinator gone)."""


@dataclass
class RankContext:
    """State shared by the worker threads of one process."""

    config: Config
    rank: int
    roles: list[str]
    endpoint: str
    zmq: zmq.Context
    groups: Groups
    backend: Backend
    stop: threading.Event = field(default_factory=threading.Event)
    conditions: Mailbox = field(default_factory=Mailbox)  # (session, index) -> condition, on the condition rank
    contexts: Mailbox = field(default_factory=Mailbox)  # (session, -1) -> prompt context, on the condition rank
    dit_inputs: Mailbox = field(default_factory=Mailbox)  # contexts and conditions received, on DiT ranks
    latents: Mailbox = field(default_factory=Mailbox)  # (session, index) -> latent, on the decode rank
    frames: Mailbox = field(default_factory=Mailbox)  # (session, index) -> frames, on the coordinator rank


FATAL_HOOK: list[Callable[[str], None]] = []  # set on the coordinator's rank: tells clients before the end
FATAL_GRACE_S = 2.0


def die(message: str) -> None:
    """End the process now with a non-zero code: peers notice through their deadlines and heartbeats. On the
    coordinator's rank the loop first gets ``FATAL_GRACE_S`` to tell every client (it exits by itself)."""
    log.error("fatal: %s", message)
    sys.stderr.flush()
    if FATAL_HOOK:
        FATAL_HOOK[0](message)
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
    def __init__(self) -> None:
        self.items: list[list[Any]] = []

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.items.append([name, start, time.monotonic()])


Handler = Callable[[protocol.Task, Spans], dict[str, Any] | None]


def serve(ctx: RankContext, role: str, handlers: dict[str, Handler]) -> None:
    """Run one role's task loop in the calling thread until shutdown; never returns on a fatal error."""
    if ctx.groups.device.type == "cuda":
        torch.cuda.set_device(ctx.groups.device)  # the current device is per thread; new threads start on cuda:0
    link = WorkerLink(ctx.zmq, ctx.endpoint, ctx.rank, role)
    try:
        while not ctx.stop.is_set():
            task = link.recv(timeout_s=0.1)
            if task is None or not isinstance(task, protocol.Task):
                continue
            if task.op == "shutdown":
                link.done("shutdown")
                break
            handler = handlers.get(task.op)
            if handler is None:
                link.done(task.op, task.session, task.index, ok=False, error=f"{role} has no op {task.op!r}")
                continue
            spans = Spans()
            try:
                info = handler(task, spans) or {}
            except Fatal as error:
                link.done(task.op, task.session, task.index, ok=False, error=str(error), info={"fatal": True})
                die(f"rank {ctx.rank} {role}: {error}")
            except Exception as error:
                log.warning("rank %d %s %s failed: %s", ctx.rank, role, task.op, traceback.format_exc())
                link.done(task.op, task.session, task.index, ok=False, error=f"{type(error).__name__}: {error}",
                          spans=spans.items)
                continue
            if info.get("silent"):
                continue
            link.done(task.op, task.session, task.index, spans=spans.items, info=info)
    finally:
        link.close()


def run_thread(name: str, target: Callable[[], None]) -> threading.Thread:
    """A worker thread whose unexpected death is fatal for the rank."""

    def guarded() -> None:
        try:
            target()
        except Fatal as error:
            die(str(error))
        except Exception:
            die(f"thread {name} crashed:\n{traceback.format_exc()}")

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
    timeouts = ctx.config.timeouts
    if ctx.groups.device.type == "cuda":
        torch.cuda.set_device(ctx.groups.device)  # so memory_facts reads this rank's GPU
    link = WorkerLink(ctx.zmq, ctx.endpoint, ctx.rank, "heartbeat")
    last_ping = time.monotonic()
    try:
        while not ctx.stop.is_set():
            message = link.recv(timeouts.heartbeat_s)
            now = time.monotonic()
            if isinstance(message, protocol.Ping):
                last_ping = now
                rss, peak, cuda = memory_facts()
                link.send(protocol.Beat(rank=ctx.rank, seq=message.seq, echo=message.sent, received=now,
                                        sent=time.monotonic(), rss=rss, peak_rss=peak, cuda_peak=cuda))
            elif isinstance(message, protocol.Task) and message.op == "shutdown":
                link.done("shutdown")
                return
            if now - last_ping > timeouts.rank_dead_s:
                die(f"rank {ctx.rank}: no ping from the coordinator for {timeouts.rank_dead_s:.0f} s")
    finally:
        link.close()
