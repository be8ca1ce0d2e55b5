"""The one place the gateway reads a chunk's applied control and facts (typed ``protocol.ChunkControl`` and
``protocol.ChunkFacts``, the same shapes from rank 0 to the SDK): the page's ``chunk`` message is built here from the
SDK's ``ChunkResult`` itself, and a session's trace keeps each chunk's ``(session, facts)``, no pixels."""

from __future__ import annotations

from collections.abc import Iterable

from ipc import protocol
from ipc.client import ChunkResult
from web import page_messages as pm
from web.playout import Dropped

Timeline = tuple[str, protocol.ChunkFacts]  # one chunk's place on its session's timeline: what its trace keeps


def page_chunk(chunk: ChunkResult, dropped: Dropped) -> pm.Chunk:
    """The page's ``chunk`` message (``dropped``: the gateway's playout counters now)."""
    facts, control = chunk.facts, chunk.facts.control
    return pm.Chunk(session=chunk.session, index=chunk.index, frames=int(chunk.frames.shape[0]),
                    keys=sorted(control.keys), mouse=(float(control.mouse[0]), float(control.mouse[1])),
                    revision=control.revision, prompt_revision=facts.prompt_revision,
                    control_to_output_s=facts.times.control_to_output, steps=facts.steps,
                    steps_changed=facts.steps_changed,
                    gateway_input_to_photon_s={str(r): s for r, s in chunk.input_to_photon_s.items()},
                    dropped=dropped, missed=chunk.missed)


def chrome_trace(chunks: Iterable[Timeline]) -> dict[str, object]:
    """The Chrome/Perfetto trace of a session's chunks (one track per rank and role), as ``scripts/client.py``
    writes it."""
    from runtime.trace import chrome_trace as build

    return build(chunks)
