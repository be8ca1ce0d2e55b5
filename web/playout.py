"""Which frame goes to the page next: the stream's fps, the newest chunk, never a queue (sans-io; times passed in).

The server emits a chunk of frames at a time, as fast as the pipeline runs: slower than its media time on a busy
GPU, much faster on the CPU synthetic layout. The page wants one picture every 1/fps seconds and, whenever it
cannot keep up, the newest one. So the gateway holds the frames of the newest chunk only and releases frame k of
it at ``start + k / fps``, where ``start`` is the chunk's arrival or, if sooner, one period after the last frame
released (so the page never gets more than fps frames a second):

- a newer chunk replaces the older one at once; the older frames not yet sent are dropped (``superseded``): the
  display drops old frames, never new ones;
- when sending ran late (a slow page or network, a slow encode) and several frames are due, only the newest due
  frame is sent and the ones it jumps over are dropped (``late``).

At most one frame is in flight per page (the sender awaits each send), so nothing grows with a slow page. Only the
frames sent are encoded: a dropped frame costs nothing.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image


@dataclass
class Dropped:
    superseded: int = 0  # frames of an older chunk never sent because a newer chunk arrived
    late: int = 0  # frames skipped because a later frame of the same chunk was already due


class Playout:
    """The newest chunk's frames, released at ``fps``. ``push`` a chunk when it arrives, ``take`` the frame to send
    now (or ``None``), ``next_due`` says when to look again."""

    def __init__(self, fps: float) -> None:
        if not fps > 0:
            raise ValueError(f"fps must be > 0, got {fps}")
        self.period = 1.0 / fps
        self.dropped = Dropped()
        self.chunk: int | None = None
        self.frames = 0
        self._start = 0.0
        self._next = 0  # the next frame of the chunk not sent or dropped yet
        self._last: float | None = None  # the playout time of the last frame taken

    def rewind(self) -> None:
        """The session resumed from an earlier chunk (a router moved it to another replica from its snapshot): the
        chunk indices come again from there. The current chunk's unsent frames are dropped; pacing goes on."""
        if self.chunk is not None:
            self.dropped.superseded += self.frames - self._next
        self.chunk, self.frames, self._next = None, 0, 0

    def push(self, chunk: int, frames: int, now: float) -> None:
        if self.chunk is not None and chunk <= self.chunk:
            raise ValueError(f"chunk {chunk} after chunk {self.chunk}: chunks arrive in order")
        if self.chunk is not None:
            self.dropped.superseded += self.frames - self._next
        # The new chunk starts now, but never less than a frame period after the last frame sent: the page gets at
        # most fps frames a second, evenly spaced (this costs a new chunk at most one period of latency).
        start = now if self._last is None else max(now, self._last + self.period)
        self.chunk, self.frames, self._start, self._next = chunk, frames, start, 0

    def take(self, now: float) -> tuple[int, int] | None:
        """(chunk, frame) to send now: the newest frame whose time has come, or ``None``."""
        if self.chunk is None or self._next >= self.frames:
            return None
        due = min(self.frames - 1, math.floor((now - self._start) / self.period + 1e-9))
        if now < self._start or due < self._next:
            return None
        self.dropped.late += due - self._next
        self._next = due + 1
        self._last = self._start + due * self.period  # its slot on the playout clock, not the (later) send time
        return self.chunk, due

    def next_due(self) -> float | None:
        """When the next frame is due (the playout's clock), or ``None`` until a chunk arrives."""
        if self.chunk is None or self._next >= self.frames:
            return None
        return self._start + self._next * self.period

    def clear(self) -> None:
        """The session ended: nothing more to send (what was not sent is not counted as dropped)."""
        self.chunk, self.frames, self._next, self._last = None, 0, 0, None


def encode_frame(rgb: np.ndarray, fmt: str = "jpeg", quality: int = 80) -> bytes:
    """One uint8 [H, W, 3] frame as JPEG or WebP bytes (Pillow releases the GIL while it encodes, so this runs on
    a worker thread without holding up the event loop)."""
    out = io.BytesIO()
    image = Image.fromarray(np.ascontiguousarray(rgb), "RGB")
    if fmt == "jpeg":
        image.save(out, format="JPEG", quality=quality)
    elif fmt == "webp":
        image.save(out, format="WEBP", quality=quality, method=0)  # method 0: the fastest encoder setting
    else:
        raise ValueError(f"unknown frame format {fmt!r}; use jpeg or webp")
    return out.getvalue()
