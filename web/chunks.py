"""The one place the gateway reads a chunk's applied control and facts (typed ``protocol.ChunkControl`` and
``protocol.ChunkFacts``, the same shapes from rank 0 to the SDK): the rest of the gateway sees only ``ChunkView``, and
the page the ``chunk`` message built from it here, once."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from ipc import protocol
from ipc.client import ChunkResult
from web import page_messages as pm
from web.playout import Dropped


@dataclass(frozen=True)
class ChunkView:
    """What the gateway needs of one chunk."""

    session: str
    index: int
    frames: np.ndarray  # uint8 [n, H, W, 3]
    facts: protocol.ChunkFacts  # rank-0 times and every rank's spans (for the trace); facts.control is applied
    gateway_input_to_photon_s: Mapping[int, float]  # gateway clock: revision sent -> this chunk received
    missed: int = 0  # chunks the server dropped for this (watching) client right before this one

    @property
    def revision(self) -> int:
        """The last page input revision the applied snapshot folded in (-1: none yet): each frame's header says it."""
        return self.facts.control.revision

    def timeline(self) -> Timeline:
        """What the session's trace keeps of this chunk (no pixels)."""
        return Timeline(self.session, self.facts)

    def message(self, dropped: Dropped) -> pm.Chunk:
        """The page's ``chunk`` message (``dropped``: the gateway's playout counters now)."""
        facts, control = self.facts, self.facts.control
        return pm.Chunk(session=self.session, index=self.index, frames=int(self.frames.shape[0]),
                        keys=sorted(control.keys), mouse=(float(control.mouse[0]), float(control.mouse[1])),
                        revision=control.revision, prompt_revision=facts.prompt_revision,
                        control_to_output_s=facts.times.control_to_output, steps=facts.steps,
                        steps_changed=facts.steps_changed,
                        gateway_input_to_photon_s={str(r): s for r, s in self.gateway_input_to_photon_s.items()},
                        dropped=dropped, missed=self.missed)


@dataclass(frozen=True)
class Timeline:
    """One chunk's place on the session's timeline, kept for the Chrome trace."""

    session: str
    facts: protocol.ChunkFacts

    @property
    def frames(self) -> int:
        return self.facts.frames


def read_chunk(chunk: ChunkResult) -> ChunkView:
    return ChunkView(session=chunk.session, index=chunk.index, frames=chunk.frames, facts=chunk.facts,
                     gateway_input_to_photon_s=dict(chunk.input_to_photon_s), missed=chunk.missed)


def chrome_trace(chunks: Iterable[Timeline]) -> dict[str, object]:
    """The Chrome/Perfetto trace of a session's chunks (one track per rank and role), as ``scripts/client.py``
    writes it."""
    from runtime.trace import chrome_trace as build

    return build((chunk.session, chunk.facts) for chunk in chunks)
