"""The coordinator core's test harness: ``Job`` plays the clients and the ranks of the 7-rank layout by feeding
events (with their time) and records what the core asks the shell to do."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from typing import Any

from ipc import protocol as p
from models.synthetic import synthetic_geometry
from ranks.worker import completion
from runtime.config import LayoutConfig, MetricsConfig, SchedulerConfig, ServerConfig, StreamConfig, TimeoutsConfig
from runtime.core import CoordinatorCore
from runtime.core_types import (
    ClientSent,
    DecodeImage,
    EmitChunk,
    ImageDecoded,
    ListSnapshots,
    ManifestRead,
    ManifestWritten,
    Output,
    ReadManifest,
    SnapshotsListed,
    ToClient,
    ToWorker,
    WorkerSent,
    WriteManifest,
)
from runtime.images import DecodedImage
from runtime.placement import CONDITION_EDGE, LATENT_RECEIVER
from runtime.snapshots import SnapshotStore, read_manifest, write_manifest

A, B = b"client-a", b"client-b"
STAGE_OF_ROLE = {"condition": p.Stage.CONDITION, "denoise": p.Stage.DENOISE, "decode": p.Stage.DECODE}


def image(height: int = 160, width: int = 256) -> DecodedImage:
    return DecodedImage(bytes(height * width * 3), height, width)


class Job:
    """The core of the cpu-tiny layout (condition 0, decode 1, DiT 2-6) and everything around it: the clients'
    messages go in as events, the tasks it sends are answered the way the ranks answer them (the real
    ``ranks.worker.completion``; a broadcast's receivers and the latent receiver stay silent)."""

    def __init__(self, stream: dict[str, Any] | None = None, server: dict[str, Any] | None = None,
                 timeouts: dict[str, Any] | None = None, scheduler: dict[str, Any] | None = None,
                 model_max_chunks: int | None = None, observers: tuple[Any, ...] = ()) -> None:  # fmt: skip
        stream_config = StreamConfig(**(stream or {}))
        geometry = synthetic_geometry(stream_config.height, stream_config.width, stream_config.chunk_latent_frames)
        self.core = CoordinatorCore(
            LayoutConfig(), ServerConfig(**{"max_sessions": 4, **(server or {})}), stream_config,
            SchedulerConfig(**(scheduler or {})), TimeoutsConfig(**(timeouts or {})), MetricsConfig(warmup_chunks=0),
            dataclasses.replace(geometry, max_chunks=model_max_chunks), 0.0,
            new_id=(f"s{i}" for i in itertools.count()).__next__, observers=observers)
        self.now = 0.0
        self.tasks: list[tuple[bytes, p.WorkerTask]] = []  # sent, not yet answered
        self.log: list[Output] = []
        self.req = itertools.count(1)

    # ---- driving

    def step(self, *events: Any, dt: float = 0.001) -> list[Output]:
        self.now += dt
        out = self.core.step(events, self.now)
        self.log += out
        self.tasks += [(o.identity, o.message) for o in out if isinstance(o, ToWorker)
                       and not isinstance(o.message, p.Ping)]
        direct = list(out)  # the shell's answers to these; the steps they make answer their own
        for read in [o for o in direct if isinstance(o, ReadManifest)]:  # as the shell does, off its loop
            out += self.step(ManifestRead(read.ticket, *read_manifest(self.core.saving.store, read.snapshot)), dt=0.0)
        for write in [o for o in direct if isinstance(o, WriteManifest)]:
            out += self.step(ManifestWritten(write.manifest.id, write_manifest(self.core.saving.store, write.manifest)),
                             dt=0.0)
        for listing in [o for o in direct if isinstance(o, ListSnapshots)]:
            out += self.step(SnapshotsListed(listing.written, tuple(self.core.saving.store.listing())), dt=0.0)
        return out

    def use(self, store: SnapshotStore) -> None:
        """Save to and restore from ``store`` (a test's own folder)."""
        self.core.saving.store = store

    def send(self, who: bytes, message: p.ClientMessage) -> list[Output]:
        return self.step(ClientSent(who, message))

    def open(self, who: bytes = A, img: DecodedImage | None = None, ready: bool = True, **fields: Any) -> str:
        out = self.send(who, p.Open(req=next(self.req), image=b"png", **{"num_chunks": 4, **fields}))
        (decode,) = [o for o in out if isinstance(o, DecodeImage)]
        self.step(ImageDecoded(decode.ticket, img or image()))
        sid = list(self.core.sessions)[-1]
        while ready and not [o for o in self.to(who, p.Opened) if o.session == sid]:
            inits = [t for _, t in self.tasks if isinstance(t, p.InitCondition | p.InitDecode | p.BroadcastContext
                                                            | p.InitDenoise)]
            if not inits:  # a role is busy with another session's chunk: let it move on
                inits = [t for _, t in self.tasks]
            assert inits, "the session cannot become ready"
            self.answer(type(inits[0]), inits[0].session, getattr(inits[0], "index", None))
        return sid

    def answer(self, kind: type, session: str | None = None, index: int | None = None,
               ranks: Iterable[int] | None = None, fail: str = "", fatal: bool = False) -> list[Output]:
        """Answer the pending tasks of ``kind`` (of ``session``/``index``, on ``ranks``) as their ranks would."""
        out: list[Output] = []
        for who, task in list(self.tasks):
            rank, role = who.decode().split(":")
            if not isinstance(task, kind) or (session is not None and task.session != session) or (
                    index is not None and getattr(task, "index", None) != index) or (
                    ranks is not None and int(rank) not in ranks):
                continue
            self.tasks.remove((who, task))
            silent = role == LATENT_RECEIVER or (role == CONDITION_EDGE and rank != "0")
            if fail or fatal:
                done: Any = p.TaskFailed(rank=int(rank), role=role, session=task.session, phase=task.phase,
                                         stage=STAGE_OF_ROLE.get(role), index=getattr(task, "index", -1),
                                         error=fail or "boom", fatal=fatal)
            elif silent:
                continue
            else:
                spans = [p.WorkerSpan(role if role in STAGE_OF_ROLE else "transfer:x", self.now, self.now + 0.0005)]
                done = completion(task, STAGE_OF_ROLE.get(role), int(rank), role, spans)
            out += self.step(WorkerSent(done))
        return out

    def settle(self, *kinds: type, limit: int = 200) -> None:
        """Answer tasks of ``kinds`` until none is pending."""
        for _ in range(limit):
            pending = [task for _, task in self.tasks if isinstance(task, kinds)]
            if not pending:
                return
            self.answer(type(pending[0]), pending[0].session, getattr(pending[0], "index", None))
        raise AssertionError("did not settle")

    def play(self, sessions: dict[bytes, str], chunks: int, limit: int = 2000) -> None:
        """Send each session's controls as soon as they can be accepted and answer every task in order, until
        every session closed."""
        sched = self.core.scheduler
        for _ in range(limit):
            for who, sid in sessions.items():
                if sid in self.core.sessions and sched.session_state(sid).value == "ready":
                    index = sched.next_control_index(sid)
                    if index < chunks and sched.can_submit(sid, index):
                        control(self, sid, index, who=who)
            if not self.tasks:
                return
            _, task = self.tasks[0]
            self.answer(type(task), task.session, getattr(task, "index", None))
        raise AssertionError("did not settle")

    def chunk(self, session: str, index: int) -> list[Output]:
        """Run chunk ``index`` of ``session`` from its encoded condition to its emission."""
        self.answer(p.ConditionChunk, session, index)
        self.answer(p.DenoiseChunk, session, index)
        self.answer(p.DecodeChunk, session, index)
        return self.answer(p.ReceiveFrames, session, index)

    # ---- reading

    def to(self, who: bytes, kind: type, out: Iterable[Output] | None = None) -> list[Any]:
        return [o.message for o in (self.log if out is None else out)
                if isinstance(o, ToClient) and o.identity == who and isinstance(o.message, kind)]

    def sent(self, kind: type, out: Iterable[Output] | None = None) -> list[tuple[bytes, Any]]:
        return [(o.identity, o.message) for o in (self.log if out is None else out)
                if isinstance(o, ToWorker) and isinstance(o.message, kind)]

    def emitted(self, session: str) -> list[EmitChunk]:
        return [o for o in self.log if isinstance(o, EmitChunk) and o.session == session]


def control(job: Job, sid: str, index: int, who: bytes = A, **fields: Any) -> list[Output]:
    return job.send(who, p.Control(req=next(job.req), session=sid, index=index, control=p.ChunkControl(**fields)))


def errors(job: Job, who: bytes, out: Iterable[Output] | None = None) -> list[str]:
    return [e.code for e in job.to(who, p.Error, out)]
