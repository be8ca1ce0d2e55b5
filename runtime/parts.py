"""A session on rank 0 as a bag of parts (STYLE.md 16): the lifecycle points every part answers.

The coordinator core (``runtime.core``) keeps routing and the session's own path (open -> scheduler -> dispatch ->
join -> emit -> close). A feature that keeps per-session state (metrics, saves, admission, the drain, clients,
watchers) is a part: it owns that state, is sans-io, and answers at fixed points with what the core must do, as
data. It never calls back into the core; what only the core may do (hold a session's boundary chunk in the
scheduler, reach the session's current client, save or close a session) it asks for with ``Hold``, ``ToOwner``,
``SaveSession`` and ``CloseSession``.

The points, in a session's order:

- ``opened(sid, now)``: a session exists (after admission). A part starts its per-session state here.
- a client request of the kinds it owns (the core's ``_request`` routes by message type: ``save`` to the saves,
  ``open`` to admission or, with ``restore``, to the saves' read).
- what a dispatched chunk takes from it (steps, control, prompt revision: the core asks the part that owns each).
- ``emitted`` (a chunk left rank 0): the parts that learn from chunks (capacity, metrics) hear of it.
- ``closed(sid, now)``: the scheduler closed the session; ``dropped(sid, now)``: the session could not even close
  cleanly and is forgotten. Both forget everything the part keeps of the session, so a close is one loop over the
  parts and never a list of holders written out by hand. The core calls ``ending`` with the whole ``Ending``; a
  part that needs more than the reason (the watchers' error, the client's last messages) answers there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.core_types import Output


@dataclass(frozen=True)
class Hold:
    """Hold (``on``) or let go the denoise of the session's next chunk: the scheduler is the core's. Letting go is
    done only while the session is open and not closing (a late one is a no-op)."""

    session: str
    on: bool


@dataclass(frozen=True)
class ToOwner:
    """``message`` to the session's client now (it may have resumed from another identity), or to ``owner`` once
    the session is gone."""

    session: str
    message: Any
    owner: bytes


@dataclass(frozen=True)
class SaveSession:
    """Save the session at its next chunk boundary for the part that asks (the drain): a save like a client's, its
    answer (``saved`` or ``error`` under ``req``) handed to that part (``Part.takes``), never to the client; it is
    the session's last here, so its boundary chunk stays held once the save's tasks are out."""

    session: str
    req: int


@dataclass(frozen=True)
class CloseSession:
    """Close the session (the scheduler is the core's) with ``reason``; a session closing already is left as is."""

    session: str
    reason: str


# what a part returns, in the order the core must carry it out
Answer = Output | Hold | ToOwner | SaveSession | CloseSession


@dataclass(frozen=True)
class Ending:
    """How a session ends, as every part hears it: closed by the scheduler with ``reason`` and ``error``, or
    ``dropped`` (it could not even close cleanly). ``farewell``: the core's last messages to the session's client
    (its ``closed`` among them), sent by the part that keeps the client (``runtime.clients``)."""

    reason: str
    error: str | None = None
    dropped: bool = False
    farewell: tuple[Any, ...] = ()


class Part:
    """The lifecycle points with their defaults (nothing kept, nothing to do); a part overrides what it needs."""

    def opened(self, sid: str, now: float) -> list[Answer]:
        return []

    def closed(self, sid: str, now: float, reason: str = "") -> list[Answer]:
        return []

    def dropped(self, sid: str, now: float) -> list[Answer]:
        """Forgotten without a clean close: by default what a close forgets."""
        return self.closed(sid, now, "dropped")

    def ending(self, sid: str, now: float, end: Ending) -> list[Answer]:
        """The one point the core calls at a session's end: ``dropped`` or ``closed`` unless a part needs more."""
        return self.dropped(sid, now) if end.dropped else self.closed(sid, now, end.reason)
