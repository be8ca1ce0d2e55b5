"""What an SDK keeps of what its server says, bounded: the server is a peer, not a part of the client.

Two things a broken or hostile server (or router) could make an SDK hold without limit:

- the text of an ``error``: a 10 MB ``message`` was kept whole in the ``ServerError`` (and in every log line and
  ``repr`` of it). ``clipped`` keeps its head and says how much was left out.
- per-session state for sessions the caller never asked about: every chunk, ``closed``, ``missed``, ``migrated``
  or ``error`` naming a new id made a ``SessionState``. ``Strays`` remembers the ids that only the server named,
  oldest first, and gives up the oldest past ``MAX_STRAY_SESSIONS``; an id the caller opens, watches, resumes or
  reads from is adopted and never given up. A stray is kept at all (not dropped at once) because a server's first
  chunks may arrive before its caller asks for them (a resumed or watched session read a moment later).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Final

MAX_ERROR_CHARS: Final = 2000  # an error's text kept: room for any message our servers write
MAX_CODE_CHARS: Final = 64  # an error code kept (ours are short words)
MAX_SESSION_ID_CHARS: Final = 64  # ``protocol.SessionId``: a longer one names no session of ours
MAX_STRAY_SESSIONS: Final = 64  # sessions only the server named, remembered at once


def clipped(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text``, or its first ``limit`` characters and how many more there were."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


class Strays:
    """The session ids that only the server's messages named (not the caller): bounded, oldest given up first."""

    def __init__(self, limit: int = MAX_STRAY_SESSIONS) -> None:
        self.limit = limit
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, sid: str) -> str | None:
        """``sid`` is a stray now; returns the stray given up to keep the bound (its state is to be dropped)."""
        self._ids[sid] = None
        return self._ids.popitem(last=False)[0] if len(self._ids) > self.limit else None

    def adopt(self, sid: str) -> None:
        """The caller asked for ``sid``: it is the caller's, kept as long as the client."""
        self._ids.pop(sid, None)

    def __len__(self) -> int:
        return len(self._ids)
