"""What a replica says about a session's chunk indices, checked against what the router saw (pure).

A replica is trusted to route, not to be right: its ``saved.chunk`` becomes the session's snapshot boundary and its
``opened.first_chunk`` after a migration becomes the index below which the router refuses controls. Taken as they
come, one ``saved(chunk=2**63)`` made every later (true) save look older and be ignored, and one
``opened(first_chunk=2**63)`` made every control of the session be refused: the session was pinned for good.
The rules, stated once here and applied by ``runtime.router``:

- A chunk index is at most ``MAX_CHUNK_INDEX`` (a chunk's ``facts.index`` cannot be larger on the wire).
- An open that restored nothing starts at chunk 0; a session of ``num_chunks`` chunks has its indices below it.
- A migration restores the snapshot the router recorded: the new replica must start at that snapshot's boundary.
- A save's boundary is the first chunk its replica has not dispatched yet: not below where the session's stream
  began on this replica, and at most ``MAX_AHEAD`` chunks past the ones the router forwarded (a replica holds a
  few chunks between its DiT and its socket: a latent edge, an output edge and a link's queue).
"""

from __future__ import annotations

from typing import Final

MAX_CHUNK_INDEX: Final = 2**32 - 1  # ``ChunkFacts.index``'s bound in ``ipc.protocol``
MAX_AHEAD: Final = 64  # chunks a save's boundary may run ahead of those forwarded (far above any pipeline's depth)


def open_problem(first_chunk: int, num_chunks: int | None, restored: bool) -> str | None:
    """Why an ``opened`` cannot be right (None: it can)."""
    if not restored and first_chunk != 0:
        return f"a new session must start at chunk 0, not {first_chunk}"
    return _index_problem(first_chunk, num_chunks, "its first chunk")


def migration_problem(first_chunk: int, snapshot_chunk: int) -> str | None:
    """Why the restore of a migrating session cannot be right: it must start at its snapshot's boundary."""
    if first_chunk != snapshot_chunk:
        return f"its restore starts at chunk {first_chunk}, but its snapshot was of chunk {snapshot_chunk}"
    return None


def save_problem(chunk: int, first: int, forwarded: int, num_chunks: int | None) -> str | None:
    """Why a ``saved`` boundary ``chunk`` cannot be right for a session whose stream began at chunk ``first`` on
    its replica and of which ``forwarded`` chunks were forwarded since."""
    if chunk < first:
        return f"its boundary chunk {chunk} is before its stream's first chunk {first}"
    if chunk > first + forwarded + MAX_AHEAD:
        return (f"its boundary chunk {chunk} is more than {MAX_AHEAD} chunks past the {first + forwarded} "
                f"chunks it has streamed")
    return _index_problem(chunk, num_chunks, "its boundary chunk")


def _index_problem(index: int, num_chunks: int | None, what: str) -> str | None:
    if not 0 <= index <= MAX_CHUNK_INDEX:
        return f"{what} {index} is not a chunk index (0 to {MAX_CHUNK_INDEX})"
    if num_chunks is not None and index >= num_chunks:
        return f"{what} {index} is past the session's {num_chunks} chunks"
    return None
