"""How often one session may save (``[snapshots] saves_per_minute``, ``save_burst``): a token bucket, sans-io.

A save of a 480x832 session is about 25 GiB on disk. The retention budget (``max_gb``) bounds what the folder
keeps and the writers refuse a copy while their previous one still waits for the disk (``MAX_WAITING_WRITES``), but
neither bounds how often a client asks: one client made 200 snapshots in 14 s, every one written, listed and deleted
again. A session starts with ``burst`` saves and earns one more every ``60 / per_minute`` seconds up to ``burst``; a
save beyond that is refused ``busy`` with the seconds until the next one is allowed (``retry_after_s``).

Per session, not per client identity: a router carries many players' sessions (its autosaves too) under one
identity, which a per-identity limit would starve; a client's total is bounded by the sessions it may hold. The
bucket is the session's own (``Session.save_credit``): it goes with the session, nothing to forget at its close.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SaveCredit:
    """A session's saves in hand and when it was last counted (None: never saved, a full bucket)."""

    tokens: float = 0.0
    at: float | None = None


@dataclass(frozen=True)
class SaveRate:
    per_minute: float  # 0: no limit
    burst: int

    def take(self, credit: SaveCredit, now: float) -> float | None:
        """Spend one save of ``credit`` at ``now``: None when allowed, else the seconds until one is (``credit``
        unchanged then: a refused save costs nothing)."""
        if self.per_minute <= 0:
            return None
        rate = self.per_minute / 60.0
        tokens = float(self.burst) if credit.at is None else min(float(self.burst),
                                                                 credit.tokens + (now - credit.at) * rate)
        if tokens < 1.0:
            return (1.0 - tokens) / rate
        credit.tokens, credit.at = tokens - 1.0, now
        return None
