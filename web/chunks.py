"""The one place the gateway reads a chunk's applied control and facts (typed ``protocol.ChunkControl`` and
``protocol.ChunkFacts``, the same shapes from rank 0 to the SDK): the rest of the gateway sees only ``ChunkView``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from ipc import protocol
from ipc.client import ChunkResult


@dataclass(frozen=True)
class ChunkView:
    """What the gateway needs of one chunk."""

    session: str
    index: int
    frames: np.ndarray  # uint8 [n, H, W, 3]
    keys: tuple[str, ...]  # applied: held keys and the taps this chunk consumed
    mouse: tuple[float, float]  # applied: yaw, pitch degrees over the chunk
    revision: int  # the last page input revision the applied snapshot folded in (-1: none yet)
    control_to_output_s: float | None  # server clock: control accepted -> frames emitted
    facts: protocol.ChunkFacts  # rank-0 times and every rank's spans (for the trace)
    gateway_input_to_photon_s: Mapping[int, float]  # gateway clock: revision sent -> this chunk received
    prompt_revision: int = 0  # the prompt the chunk used (0: the open's; r: the page's r-th new prompt)

    def timeline(self) -> Timeline:
        """What the session's trace keeps of this chunk (no pixels)."""
        return Timeline(self.session, self.facts)


@dataclass(frozen=True)
class Timeline:
    """One chunk's place on the session's timeline, kept for the Chrome trace."""

    session: str
    facts: protocol.ChunkFacts

    @property
    def frames(self) -> int:
        return self.facts.frames


def read_chunk(chunk: ChunkResult) -> ChunkView:
    control, facts = chunk.control, chunk.facts
    return ChunkView(
        session=chunk.session,
        index=chunk.index,
        frames=chunk.frames,
        keys=tuple(sorted(control.keys)),
        mouse=(float(control.mouse[0]), float(control.mouse[1])),
        revision=control.revision,
        control_to_output_s=facts.times.control_to_output,
        facts=facts,
        gateway_input_to_photon_s=dict(chunk.input_to_photon_s),
        prompt_revision=facts.prompt_revision,
    )


def chrome_trace(chunks: Iterable[Timeline]) -> dict[str, object]:
    """The Chrome/Perfetto trace of a session's chunks (one track per rank and role), as ``scripts/client.py``
    writes it."""
    from runtime.trace import chrome_trace as build

    return build((chunk.session, chunk.facts) for chunk in chunks)
