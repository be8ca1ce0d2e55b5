"""Admission on rank 0, as a part of each session (``runtime.parts``): the session limit, the prompt's length, the
memory every rank has left (``runtime.memory_admission``), real time (``runtime.capacity``) and the steps each
chunk runs. One ``admit`` for a new session and a restored one: the same steps, in the same order, so a refusal
reads the same from both.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ipc import protocol
from ipc.error_codes import ErrorCode
from ipc.protocol import QUALITY_STEPS, ChunkFacts
from models.geometry import frame_size
from runtime.capacity import CapacityModel
from runtime.config import CapacityConfig, ServerConfig, StreamConfig
from runtime.core_types import ClientError, DecodeImage, ImageDecoded
from runtime.memory_admission import Cost, MemoryAdmission
from runtime.parts import Answer, Part
from runtime.session import Session
from runtime.sizes import snap

if TYPE_CHECKING:
    from models.geometry import StreamGeometry

log = logging.getLogger(__name__)

BUSY_RETRY_S = 5.0  # hint to clients refused at the session limit


@dataclass
class Opening:
    """An ``open`` whose start image is being decoded."""

    ticket: int
    identity: bytes
    message: protocol.Open
    result: ImageDecoded | None = None


class Admission(Part):
    """Who may open, and with how many denoising steps each chunk runs (the capacity model's ladder)."""

    def __init__(self, server: ServerConfig, capacity: CapacityConfig, stream: StreamConfig,
                 sizes: list[tuple[int, int]], session_cost: Cost | None, rooms: dict[int, int]) -> None:  # fmt: skip
        self.server, self.capacity_config, self.stream, self.sizes = server, capacity, stream, sizes
        self.fps = stream.fps
        self.capacity = CapacityModel(capacity)  # real-time admission and the steps of every session
        # memory-aware admission: each rank's room (from its hello) against the model's cost of a session
        self.memory = MemoryAdmission(session_cost, rooms)
        self.opening: deque[Opening] = deque()  # asked for, their start images being decoded: in request order
        self.tickets: Iterator[int] = itertools.count()

    def frame_size(self, height: int, width: int) -> tuple[int, int]:
        """A start image's frame size: the fixed one, or the served size nearest its aspect ratio (``bad_image``
        when its official frame size at ``stream.area`` pixels would be degenerate)."""
        if self.stream.size == "fixed":
            return self.stream.height, self.stream.width
        size = frame_size(height, width, self.stream.area)
        if min(size) < 16:
            raise ClientError(ErrorCode.BAD_IMAGE, f"a start image of {width}x{height} pixels is too narrow: its "
                              f"frame size at {self.stream.area} pixels would be {size[1]}x{size[0]}")
        return snap(height, width, self.sizes)

    def check_prompt(self, prompt: str) -> None:
        limit = self.server.max_prompt_chars
        if len(prompt) > limit:
            raise ClientError(ErrorCode.BAD_REQUEST, f"prompt of {len(prompt)} characters exceeds the limit of {limit}")

    def ask(self, who: bytes, message: protocol.Open, sessions: int, max_chunks: int,
            model_cap: int | None) -> DecodeImage:  # fmt: skip
        """A new session is asked for beside ``sessions`` open ones: checked (its length against ``max_chunks``,
        ``model_cap`` when the model's KV cache caps it), then its image decoded off the loop."""
        if message.num_chunks is not None and not 1 <= message.num_chunks <= max_chunks:
            why = "" if model_cap is None else (
                f" (the model's KV cache keeps the whole session and holds {model_cap} chunks: "
                "model.kv_window = 'full', model.kv_full_frames)")
            raise ClientError(ErrorCode.BAD_REQUEST,
                              f"num_chunks must be in 1..{max_chunks}, got {message.num_chunks}{why}")
        self.check_prompt(message.prompt)
        self.check_limit(sessions)
        ticket = next(self.tickets)
        self.opening.append(Opening(ticket, who, message))
        return DecodeImage(ticket, message.image, self.server.max_image_pixels)

    def decoded(self, event: ImageDecoded) -> Iterator[Opening]:
        """The opens whose image is decoded, in the order they were asked for (each taken as the caller moves on:
        the ones behind still count against the limit)."""
        for opening in self.opening:
            if opening.ticket == event.ticket:
                opening.result = event
        while self.opening and self.opening[0].result is not None:
            yield self.opening.popleft()

    def check_limit(self, sessions: int) -> None:
        """``busy`` when ``sessions`` open and those being opened fill the server."""
        if sessions + len(self.opening) >= self.server.max_sessions:
            raise ClientError(ErrorCode.BUSY, f"the server is at its limit of {self.server.max_sessions} sessions",
                              retry_after_s=BUSY_RETRY_S)

    def admit(self, sessions: int, geometry: StreamGeometry, want: int | None, floor: int | None,
              left: int | None, new_id: Callable[[], str]) -> str:  # fmt: skip
        """A seat for a new session of ``geometry`` that asks for ``want`` steps, at least ``floor``, for ``left``
        more chunks (None: endless); its id (from ``new_id``, drawn only once memory admits it), or ``busy``."""
        self.check_limit(sessions)
        refusal = self.memory.refusal(geometry.height, geometry.width)
        if refusal is not None:
            if (geometry.height, geometry.width) in self.memory.unservable_sizes:  # no close frees this size
                raise ClientError(ErrorCode.BUSY,
                                  f"{refusal}; a start image of another aspect ratio streams at another size")
            raise ClientError(ErrorCode.BUSY, f"{refusal}; retry once a session closed", retry_after_s=BUSY_RETRY_S)
        sid = new_id()
        seat = self.capacity.admit(sid, (geometry.height, geometry.width), geometry.frames_in_chunk(1) / self.fps,
                                   want or QUALITY_STEPS[0], floor or self.capacity_config.min_steps, left)
        if not seat.ok:  # before the memory is held, which cannot refuse
            raise ClientError(ErrorCode.BUSY, seat.reason, retry_after_s=seat.retry_after_s or BUSY_RETRY_S)
        self.log_steps(seat.changed, f"session {sid} opened")
        self.memory.admit(sid, geometry.height, geometry.width)
        return sid

    def closed(self, sid: str, now: float, reason: str = "") -> list[Answer]:
        self.memory.release(sid)
        self.log_steps(self.capacity.remove(sid), f"session {sid} closed")
        return []

    def dropped(self, sid: str, now: float) -> list[Answer]:
        self.memory.release(sid)
        self.capacity.remove(sid)
        return []

    # ---- steps

    def steps_of(self, sid: str) -> int:
        seat = self.capacity.seats.get(sid)
        return seat.steps if seat is not None else QUALITY_STEPS[0]

    def chunk_steps(self, session: Session, index: int) -> int:
        """The denoising steps chunk ``index`` runs (at its dispatch: a chunk boundary), a control's request applied
        first; remembered with why they changed for the chunk's facts."""
        asked = [i for i in session.asked if i <= index]
        if asked:
            want = session.asked[max(asked)]
            for i in asked:
                del session.asked[i]
            self.log_steps(self.capacity.ask(session.id, want), f"its control asked for {want}")
        steps = self.steps_of(session.id)
        seat = self.capacity.seats.get(session.id)
        changed = seat.why if seat is not None and session.last_steps and steps != session.last_steps else None
        session.chunk_steps[index] = (steps, changed)
        session.last_steps = steps
        return steps

    def emitted(self, sid: str, facts: ChunkFacts, warm: bool) -> None:
        """A chunk left: its measured stage times may move every session's steps."""
        self.capacity.on_chunk(sid, facts, warm=warm)
        self.log_steps(self.capacity.rebalance(), "the measured stage times miss real time")

    def log_steps(self, changed: dict[str, int], cause: str) -> None:
        for sid, steps in changed.items():
            seat = self.capacity.seats[sid]
            log.info("session %s: %d denoising steps from its next chunk (%s: %s)", sid, steps, seat.why or "open",
                     cause)
