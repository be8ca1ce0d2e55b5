"""What rank 0 holds of one session besides the scheduler's cursors: its client, its inputs, its in-flight facts.

Owned by the coordinator core (runtime/core.py), which alone mutates it. Bounded per session: controls, spans,
queue times and joins exist only for chunks in flight and for the one stage task running, whatever the session
length.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ipc.protocol import ChunkControl, Edge, Span, Stage, StreamHeader, WorkerSpan, WorkerTask
from runtime.clock import ClockSync
from runtime.control_service import LiveControls
from runtime.core_types import ToWorker
from runtime.images import DecodedImage
from runtime.metrics import SessionMetrics
from runtime.placement import JoinKey, Part, SessionFacts, step_of
from runtime.prompts import PromptRevisions
from runtime.save_rate import SaveCredit

if TYPE_CHECKING:
    from models.geometry import StreamGeometry

Step = Stage | Edge  # what a task of the session works on: a stage, or a transfer


@dataclass
class Join:
    """One scheduler action in flight on the ranks: the completions it still waits for."""

    waiting: set[Part]
    sent: float  # when its tasks left (for the stage deadline)
    then: tuple = ()  # tasks to send once it is finished (``placement.Plan.then``)


@dataclass
class Session:
    id: str
    client: bytes  # the ROUTER identity chunks go to
    owner: bytes  # the identity that opened it (a reconnect with it may resume)
    open_req: int
    seed: int
    prompt: str
    geometry: StreamGeometry  # the backend's geometry at this session's frame size
    num_chunks: int | None
    live: LiveControls | None
    metrics: SessionMetrics
    image: DecodedImage | None  # the start image until the condition stage has it
    gone: bool = False  # the client can no longer be reached (until it resumes)
    intrinsics: tuple[float, float, float, float] | None = None  # its camera at 480x832 (the open's or the server's)
    opened: bool = False  # its ``opened`` was sent; until then a failure answers the ``open`` request itself
    controls: dict[int, ChunkControl] = field(default_factory=dict)  # accepted, not yet emitted
    spans: dict[int, list[Span]] = field(default_factory=dict)  # chunk -> spans reported so far
    queued: dict[tuple[Step, int], float] = field(default_factory=dict)  # (step, chunk) -> when its task left
    joins: dict[JoinKey, Join] = field(default_factory=dict)
    released: dict[str, list[int]] = field(default_factory=dict)  # stage -> ranks that confirmed, in order
    asked: dict[int, int] = field(default_factory=dict)  # chunk -> steps its control asked for (until dispatched)
    chunk_steps: dict[int, tuple[int, str | None]] = field(default_factory=dict)  # dispatched, not emitted: steps, why
    last_steps: int = 0  # steps of the latest dispatched chunk (0: none yet)
    prompts: PromptRevisions = field(default_factory=PromptRevisions)  # which text each chunk attends to
    restore: str = ""  # the snapshot it was opened from ("": a fresh session); its caches load it at init
    first_chunk: int = 0  # its first chunk (a restored session's snapshot chunk)
    save_credit: SaveCredit = field(default_factory=SaveCredit)  # its saves in hand (``runtime.save_rate``)

    def __post_init__(self) -> None:
        self.prompts.texts.setdefault(self.prompts.announced, self.prompt)  # the text of its first revision

    def handed(self, tasks: Iterable[tuple[bytes, WorkerTask]], now: float) -> list[ToWorker]:
        """``tasks`` leave now: when a chunk's work was handed over is the queue wait of its spans."""
        for _, task in tasks:
            step = step_of(task)
            if step is not None:
                self.queued[(step, task.index)] = now  # type: ignore[union-attr]
        return [ToWorker(to, task) for to, task in tasks]

    def header(self, fps: float) -> StreamHeader:
        """Its stream header: what its ``opened`` and each ``watching`` carry."""
        g = self.geometry
        return StreamHeader(self.id, g.height, g.width, fps, g.frames_in_chunk(0), g.frames_in_chunk(1),
                            self.num_chunks)

    def facts(self) -> SessionFacts:
        image = self.image
        return SessionFacts(self.id, self.seed, self.prompt, self.geometry,
                            image.pixels if image else b"", image.height if image else 0, image.width if image else 0,
                            self.intrinsics, self.prompts.announced, self.restore)

    def add_spans(self, index: int, rank: int, role: str, spans: tuple[WorkerSpan, ...], clock: ClockSync,
                  queued: float) -> None:
        """A worker's spans of chunk ``index`` on its own clock -> spans on rank 0's clock (cache init and
        release work, index -1, stays off the chunk timeline)."""
        if index < 0 or not spans:
            return
        offset = clock.offset(rank) if rank in clock.ranks() else 0.0
        kept = self.spans.setdefault(index, [])
        for span in spans:
            start, end = span.start - offset, span.end - offset
            kept.append(Span(span.name, rank, role, min(queued, start), start, max(start, end)))

    def take_chunk(self, index: int) -> tuple[ChunkControl, tuple[Span, ...]]:
        """The control and spans of an emitted chunk; its bookkeeping ends here."""
        for key in [k for k in self.queued if k[1] == index]:
            del self.queued[key]
        return self.controls.pop(index), tuple(self.spans.pop(index, ()))

    def confirm_release(self, stage: Stage, rank: int) -> None:
        confirmed = self.released.setdefault(stage.value, [])
        if rank not in confirmed:
            confirmed.append(rank)
