"""Exactly-once, in-order acceptance of a stream of indices (control admission and chunk emission).

A pure class, no I/O, no clock. It holds one cursor ``expected`` (the next index it will accept) and a bounded
memory of the payloads of the last few accepted indices, so that a retry can be told from a conflict.

Invariants:
- ``expected`` starts at ``start`` and only ever moves by one, on ``accept`` of exactly ``expected``.
- ``accept(expected, p)`` moves the cursor and returns ``Verdict.ACCEPTED``.
- ``accept(i, p)`` for an already accepted ``i`` still in memory, with a payload equal to the one accepted, is a
  retry: it returns ``Verdict.DUPLICATE`` and changes nothing.
- Anything else raises ``OrderingError`` and changes nothing: a gap (``i > expected``), a conflicting duplicate
  (``i < expected`` with a different payload) or a stale index (``i < expected``, older than the memory, so a retry
  cannot be told from a conflict) or an invalid one (before ``start``).
- Memory is bounded by ``memory`` entries whatever the length of the stream.
- ``check`` is the same decision as ``accept`` without the state change (a pure query).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from enum import Enum

__all__ = ["InOrder", "OrderingError", "Verdict"]


class Verdict(str, Enum):
    """What ``InOrder.accept`` did with an index."""

    ACCEPTED = "accepted"  # it was the expected index: the cursor moved
    DUPLICATE = "duplicate"  # a retry of an accepted index with the same payload: nothing changed


class OrderingError(ValueError):
    """An index that is neither the next one nor a recognisable retry. Nothing changed."""

    def __init__(self, kind: str, index: int, expected: int) -> None:
        self.kind = kind  # "gap", "conflict", "stale" or "invalid"
        self.index = index
        self.expected = expected
        reasons = {
            "gap": f"index {index} skips ahead; expected index {expected}",
            "conflict": f"index {index} was already accepted with a different payload; expected index {expected}",
            "stale": f"index {index} was accepted long ago; expected index {expected}",
            "invalid": f"index {index} is before the first index; expected index {expected}",
        }
        super().__init__(reasons[kind])


class InOrder:
    """Accept ``start, start + 1, ...`` exactly once each; recognise retries of the last ``memory`` indices."""

    __slots__ = ("_expected", "_memory", "_start")

    def __init__(self, start: int = 0, memory: int = 4) -> None:
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        if memory < 1:
            raise ValueError(f"memory must be >= 1, got {memory}")
        self._start = start
        self._expected = start
        # (index, payload) of the last accepted indices, oldest first; maxlen keeps it bounded.
        self._memory: deque[tuple[int, Hashable]] = deque(maxlen=memory)

    @property
    def expected(self) -> int:
        """The next index ``accept`` will take."""
        return self._expected

    @property
    def accepted(self) -> int:
        """How many indices were accepted so far."""
        return self._expected - self._start

    def check(self, index: int, payload: Hashable = None) -> Verdict:
        """Decide what ``accept(index, payload)`` would do, without doing it. Raises ``OrderingError``."""
        if index == self._expected:
            return Verdict.ACCEPTED
        if index < self._start:
            raise OrderingError("invalid", index, self._expected)
        if index > self._expected:
            raise OrderingError("gap", index, self._expected)
        for seen, seen_payload in self._memory:
            if seen == index:
                if seen_payload == payload:
                    return Verdict.DUPLICATE
                raise OrderingError("conflict", index, self._expected)
        raise OrderingError("stale", index, self._expected)

    def accept(self, index: int, payload: Hashable = None) -> Verdict:
        """Accept ``index`` if it is the expected one; see the module docstring for the other cases."""
        verdict = self.check(index, payload)
        if verdict is Verdict.ACCEPTED:
            self._memory.append((index, payload))
            self._expected += 1
        return verdict
