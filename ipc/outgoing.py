"""What a client (``ipc.client.Client``, ``ipc.aio_client.AsyncClient``) has to send, and how much it may ask at once.

- **Outgoing**: the messages waiting to leave the client's socket, in order. A caller's message beyond
  ``max_outbox`` is refused (``OutboxFull``: nothing sent, nothing queued); the client's own (an orphan's close, a
  heartbeat) are not. **Live input is a state, not a queue**: a session's ``control_state`` waits in one slot that a
  newer state replaces, so a flood of input (a page sending thousands of states) costs one message per session and
  the newest state is always the one that goes, never refused. The slot keeps the place of the oldest state it
  replaced, so a state never goes after a message its caller queued later (a ``close``, say).
- **InFlight**: the requests of one client waiting for their answers, at most ``limit``. A caller beyond it waits
  for a slot: many threads of one ``Client`` (many tasks of one ``AsyncClient`` use an ``asyncio.Semaphore`` of
  the same size) cannot ask more at once than a server keeps answers waiting for one client (``server.max_waiting``).

Thread-safe: callers put from any thread, the client's one writer takes.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

Stamp = tuple[str, int] | None  # (session, revision) of a live state: its input-to-photon clock starts as it leaves
Item = tuple[bytes, Stamp]
MAX_IN_FLIGHT = 64  # requests of one client waiting for answers (a server keeps up to 1024 waiting for a client)


@dataclass(frozen=True)
class _Slot:
    """A session's live-input slot in the line: its state is ``Outgoing._states[session]`` when its turn comes."""

    session: str


class Outgoing:
    """A client's outbox (see the module docstring). ``refuse(waiting)`` raises ``OutboxFull`` for a caller's
    message that finds ``waiting`` messages queued at its limit."""

    def __init__(self, max_outbox: int, refuse: Callable[[int], None]) -> None:
        self.max_outbox = max_outbox
        self._refuse = refuse
        self._lock = threading.Lock()
        self._line: deque[Item | _Slot] = deque()
        self._states: dict[str, Item] = {}  # session -> its newest unsent state
        self.replaced = 0  # states that a newer one replaced before they left (never sent: not needed)

    def __len__(self) -> int:
        return len(self._line)

    def put(self, data: bytes, stamp: Stamp = None, own: bool = False) -> None:
        with self._lock:
            if not own and len(self._line) >= self.max_outbox:
                self._refuse(len(self._line))
            self._line.append((data, stamp))

    def put_state(self, session: str, data: bytes, stamp: Stamp = None) -> None:
        """The session's newest live state: it replaces one still waiting (never refused: one slot per session)."""
        with self._lock:
            if session in self._states:
                self.replaced += 1
            else:
                self._line.append(_Slot(session))
            self._states[session] = (data, stamp)

    def peek(self) -> Item | None:
        """The next message to send (it stays queued until ``sent``), or None."""
        with self._lock:
            if not self._line:
                return None
            head = self._line[0]
            return self._states[head.session] if isinstance(head, _Slot) else head

    def sent(self, item: Item) -> None:
        """``item`` (the last ``peek``) left the socket. A state replaced meanwhile keeps its slot: the newer one
        goes next."""
        with self._lock:
            head = self._line[0]
            if isinstance(head, _Slot):
                if self._states[head.session] is not item:
                    return
                del self._states[head.session]
            self._line.popleft()


class InFlight:
    """At most ``limit`` requests waiting for their answers (see the module docstring). ``leave`` is idempotent: a
    request leaves when its answer came, its caller gave up, or it was forgotten."""

    def __init__(self, limit: int = MAX_IN_FLIGHT) -> None:
        if limit < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {limit}")
        self.limit = limit
        self._in_flight: set[int] = set()
        self._free = threading.Condition()

    def enter(self, req: int, timeout_s: float) -> None:
        """Take a slot for request ``req``; ``TimeoutError`` when none freed within ``timeout_s`` (nothing sent)."""
        with self._free:
            if not self._free.wait_for(lambda: len(self._in_flight) < self.limit, timeout_s):
                raise TimeoutError(f"{self.limit} requests of this client waited {timeout_s:.1f} s for their "
                                   "answers: this one was not sent")
            self._in_flight.add(req)

    def leave(self, req: int) -> None:
        with self._free:
            if req in self._in_flight:
                self._in_flight.discard(req)
                self._free.notify()

    def __len__(self) -> int:
        return len(self._in_flight)
