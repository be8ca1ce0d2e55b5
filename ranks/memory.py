"""A rank's side of memory-aware admission: its room, what its sessions hold, and the check of the model.

- ``room_bytes``: what this rank can give to sessions, reported to rank 0 in every hello and beat. On CUDA: the
  memory free on the device (after ``empty_cache``: a block cached for one role stream is not usable by another)
  once the weights are loaded and every stage thread warmed up, less the working peaks of the stages this rank
  runs (``models.memory.working_bytes``: they must stay free for a chunk to run) and ``memory.margin_gb``;
  ``memory.budget_gb`` caps it when set. On CPU: ``memory.budget_gb`` (0: unlimited), so tests can exercise
  admission.
- ``cache_bytes``: the bytes the open sessions' caches hold now, as the stages count them (shown in ``stats``).
- ``check_session``: once a session's caches reached their steady size on this rank, the bytes of its tensors (on
  CUDA what the allocator gave them, to its 512-byte rounding) against the model's; a model that under-estimates
  by more than ``memory.tolerance`` logs a warning, since admission trusts it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import torch

from ipc.protocol import Stage
from models import memory
from runtime.memory_admission import GIB, UNLIMITED, gib
from runtime.placement import STAGES

log = logging.getLogger(__name__)


def room_bytes(config: Any, rank: int, device: torch.device) -> int:
    budget = int(config.memory.budget_gb * GIB)
    if device.type != "cuda":
        return budget if budget > 0 else UNLIMITED
    # The warm-up's blocks were cached per stream (one per role thread): reserved-but-unallocated memory is not
    # usable by another stream, so it goes back to the device first and only what the device has free counts.
    torch.cuda.empty_cache()
    unused, _ = torch.cuda.mem_get_info(device)
    stream = config.stream
    working = memory.working_bytes(config, rank, stream.height, stream.width, "cuda")
    room = max(0, unused - working - int(config.memory.margin_gb * GIB))
    log.info("rank %d memory: %s unused after loading, %s kept for a chunk's working peak, %s margin: room %s",
             rank, gib(unused), gib(working), gib(int(config.memory.margin_gb * GIB)), gib(room))
    return min(room, budget) if budget > 0 else room


def cache_bytes(backend: Any) -> int:
    """Bytes of every open session's caches on this rank (stages that do not count them add nothing)."""
    total = 0
    for stage in backend.values():
        count = getattr(stage, "sessions_nbytes", None)
        if count is not None:
            with contextlib.suppress(RuntimeError, KeyError):  # a session opened or closed meanwhile: next beat
                total += count()
    return total


def check_later(config: Any, rank: int, role: str, stage: Any, session: str, height: int, width: int) -> None:
    """``check_session`` on a thread of its own: the model's first run at a frame size takes about a second on
    the meta device, which must not stall the role's stream; a check that fails only logs."""

    def check() -> None:
        try:
            check_session(config, rank, role, stage, session, height, width)
        except Exception:
            log.exception("rank %d %s: the memory check of session %s failed", rank, role, session)

    threading.Thread(target=check, name=f"memory-check-{role}", daemon=True).start()


def check_session(config: Any, rank: int, role: str, stage: Any, session: str, height: int, width: int) -> None:
    """Warn when ``session`` holds more on this rank's ``role`` stage than the model said it would."""
    count = getattr(stage, "session_nbytes", None)
    device = "cuda" if torch.cuda.is_available() and config.layout.backend != "gloo" else "cpu"
    if count is None or not memory.priced(config, device):
        return
    items = memory.session_items(config, rank, height, width, device)
    expected = sum(items.get(k, 0) for k in STAGES[Stage(role)].memory_items)
    try:
        measured = count(session)
    except KeyError:  # already released
        return
    if measured > expected * (1 + config.memory.tolerance):
        log.warning("rank %d %s: session %s (%dx%d) holds %d bytes (%s), the memory model said %d (%s): admission "
                    "under-estimates this rank by %.0f%%", rank, role, session, height, width, measured, gib(measured),
                    expected, gib(expected), 100 * (measured / max(expected, 1) - 1))
    else:
        log.debug("rank %d %s: session %s holds %s, model %s", rank, role, session, gib(measured), gib(expected))
