"""Memory-aware admission on rank 0 (sans-io): a session opens only if every rank has room for what it costs.

Each rank reports its room once it is ready (``Hello.room``, again in every ``Beat``): the bytes it can give to
sessions (on CUDA what is free after weights and warm-up less its working peaks and a margin; on CPU
``memory.budget_gb``; unlimited when it says -1). The cost of a session at a frame size comes from the memory
model (``models.memory.session_costs``, handed in as a function). Rank 0 keeps what it admitted: a rank's free
bytes are its room less the costs of the sessions it holds, so two sessions opened back to back never both count
the same bytes, and a closed session's bytes are free again at once. The ranks' own measure of what their sessions
hold (``Beat.cache_bytes``) is shown beside it in ``stats``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

GIB = 1 << 30
UNLIMITED = -1  # a room on the wire: this rank does not limit sessions

Cost = Callable[[int, int], Mapping[int, int]]  # (height, width) -> bytes one more session costs each rank


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclass
class MemoryAdmission:
    cost: Cost | None = None  # None: sessions cost nothing here (no memory model for this backend)
    rooms: dict[int, int] = field(default_factory=dict)  # rank -> bytes for sessions (absent or -1: unlimited)
    admitted: dict[str, dict[int, int]] = field(default_factory=dict)  # session -> bytes admitted on each rank
    measured: dict[int, int] = field(default_factory=dict)  # rank -> bytes its sessions hold, as the rank measures
    # (height, width) -> why no session of that size can open (a rank ran out of memory warming it up: ranks.warmup)
    unservable_sizes: dict[tuple[int, int], str] = field(default_factory=dict)

    def report(self, rank: int, room: int, cache_bytes: int | None = None) -> None:
        self.rooms[rank] = room
        if cache_bytes is not None:
            self.measured[rank] = cache_bytes

    def session_bytes(self, rank: int) -> int:
        return sum(costs.get(rank, 0) for costs in self.admitted.values())

    def free_bytes(self, rank: int) -> int | None:
        room = self.rooms.get(rank, UNLIMITED)
        return None if room < 0 else room - self.session_bytes(rank)

    def refusal(self, height: int, width: int) -> str | None:
        """Why one more ``height x width`` session does not fit (the first rank short of room), or None."""
        if (height, width) in self.unservable_sizes:
            return self.unservable_sizes[(height, width)]
        if self.cost is None:
            return None
        for rank, need in sorted(self.cost(height, width).items()):
            free = self.free_bytes(rank)
            if free is not None and need > free:
                holding = sum(1 for costs in self.admitted.values() if costs.get(rank, 0))
                return (f"rank {rank} has no room for another {height}x{width} session: it needs {need} bytes "
                        f"({gib(need)}) and has {max(free, 0)} bytes ({gib(max(free, 0))}) free; {holding} open "
                        f"sessions hold {gib(self.session_bytes(rank))} of its {gib(self.rooms[rank])}")
        return None

    def unservable(self, sizes: Iterable[tuple[int, int]]) -> list[str]:
        """Why each of ``sizes`` cannot hold even one session, whatever closes (asked once at start: a layout too
        big for its cards should say so in its log, not only in every refused ``open``)."""
        if self.admitted:
            raise RuntimeError("unservable() answers for an empty server; sessions are open")
        reasons = ((f"{h}x{w}", self.refusal(h, w)) for h, w in sizes)
        return [f"no {size} session can open on this server: {why}" for size, why in reasons if why is not None]

    def admit(self, session: str, height: int, width: int) -> None:
        """Hold the session's bytes on every rank (call once ``refusal`` said it fits)."""
        if self.cost is not None:
            self.admitted[session] = {rank: n for rank, n in self.cost(height, width).items() if n}

    def release(self, session: str) -> None:
        self.admitted.pop(session, None)

    def stats(self, rank: int) -> dict[str, int | None]:
        return {"session_bytes": self.session_bytes(rank), "free_bytes": self.free_bytes(rank),
                "room_bytes": None if self.rooms.get(rank, UNLIMITED) < 0 else self.rooms[rank],
                "measured_session_bytes": self.measured.get(rank)}
