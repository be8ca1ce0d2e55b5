"""One CUDA stream per role thread, and an event at every hand-off of a tensor between threads. A no-op on CPU.

Why: on the legacy default stream shared by all threads of a rank, a condition broadcast waited for every kernel
queued on rank 0 (the next encode, or a whole DiT chunk on a co-located rank), the frames' device-to-host copy
queued behind the encoder, and a span's sync waited for the other role's kernels too. The rules:

- **A stream per thread.** Each role thread enters its own stream once, for its whole life (``RoleStreams.enter``):
  everything it launches (kernels, copies, the NCCL calls of its group, whose internal stream waits on it) queues
  there, and its spans wait for that stream only (``RoleStreams.synchronize``). The start-up warm-up of a stage runs
  in its thread, on its stream (``ranks.warmup``): cuDNN's autotune cache is per thread.
- **Events at hand-offs.** A tensor handed to another thread goes through ``hand_off`` where it was produced (an
  event recorded on the producing thread's stream: the GPU point at which its producing work is queued) and
  ``take_over`` where it is consumed: the consuming thread's stream waits on that event, on the GPU; neither the
  host nor the rest of the producer's stream is waited for.
- **Memory across streams.** ``take_over`` records the consuming stream on the tensor (``record_stream``): when the
  consumer drops it, the allocator reuses its block only after the work queued on the consumer's stream so far is
  done, never while one of its kernels may still read it (received buffers included).
- **Before the threads.** Weights are loaded on the legacy default stream, which these streams (non-blocking) do not
  wait for: ``launch.py`` synchronises the device once after the stages are built, before anything runs on them.

``RoleStreams`` also knows which role the calling thread entered (``lane``), on CPU too, so the pairing of
hand-offs (made on one role's lane, taken on another's) is the same code on both devices and testable without CUDA.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

_thread = threading.local()  # .lane: the role this thread entered


def lane() -> str | None:
    """The role whose stream the calling thread entered (None: none, e.g. the main thread at start-up)."""
    return getattr(_thread, "lane", None)


class RoleStreams:
    """The streams of one rank's role threads, one per role name, made on first use (None on CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._streams: dict[str, Any] = {}
        self._lock = threading.Lock()

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def stream(self, role: str) -> Any | None:
        """The ``torch.cuda.Stream`` of ``role`` (the same one every time), or None on CPU."""
        if not self.cuda:
            return None
        with self._lock:
            if role not in self._streams:
                self._streams[role] = torch.cuda.Stream(device=self.device)
            return self._streams[role]

    @contextmanager
    def enter(self, role: str) -> Iterator[None]:
        """Run the body on ``role``'s stream (its lane). A thread enters one lane at a time: nesting two lanes would
        put one role's work on another's stream."""
        if lane() is not None:
            raise RuntimeError(f"thread {threading.current_thread().name} is on lane {lane()!r}, cannot enter {role!r}")
        _thread.lane = role
        try:
            stream = self.stream(role)
            if stream is None:
                yield
            else:
                with torch.cuda.stream(stream):
                    yield
        finally:
            _thread.lane = None

    def synchronize(self) -> None:
        """Wait (on the host) for what the calling thread queued on its own stream; nothing on CPU."""
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()


@dataclass(frozen=True)
class Handoff:
    """A value on its way from one thread to another, with the event recorded where a CUDA tensor was produced."""

    value: Any
    lane: str | None  # the role thread that produced it
    event: Any | None  # a ``torch.cuda.Event`` recorded on the producer's stream; None for anything not on CUDA


def hand_off(value: Any) -> Handoff:
    """Call in the producing thread right after the value was made (its kernels queued on this thread's stream)."""
    event = None
    if isinstance(value, torch.Tensor) and value.is_cuda:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(value.device))
    return Handoff(value, lane(), event)


def take_over(handoff: Handoff) -> Any:
    """Call in the consuming thread: its stream waits (on the GPU) for the producer's event, and the tensor's memory
    is kept from reuse until the work this stream queues on it is done. The value itself, unchanged."""
    value = handoff.value
    if handoff.event is not None:
        stream = torch.cuda.current_stream(value.device)
        stream.wait_event(handoff.event)
        value.record_stream(stream)
    return value
