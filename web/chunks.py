"""The one place the gateway reads a chunk's applied control and facts off their wire shape.

Today both are msgpack maps; they may become typed structs (a control and a chunk's facts keeping one shape from
the SDK to the DiT and back). ``read_chunk`` takes either (``_get`` reads a key or an attribute), so such a
change is a fix here and nowhere else: the rest of the gateway sees only ``ChunkView``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

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
    times: Mapping[str, Any]  # rank-0 times of the chunk (for the trace)
    spans: tuple[tuple[Any, ...], ...]  # (name, rank, role, queued, start, end) on rank 0's clock
    gateway_input_to_photon_s: Mapping[int, float]  # gateway clock: revision sent -> this chunk received

    def timeline(self) -> Timeline:
        """What the session's trace keeps of this chunk (no pixels)."""
        return Timeline(self.session, self.index, int(self.frames.shape[0]), self.keys, self.mouse, self.revision,
                        self.times, self.spans)


@dataclass(frozen=True)
class Timeline:
    """One chunk's place on the session's timeline, kept for the Chrome trace."""

    session: str
    index: int
    frames: int
    keys: tuple[str, ...]
    mouse: tuple[float, float]
    revision: int
    times: Mapping[str, Any]
    spans: tuple[tuple[Any, ...], ...]


def _get(source: Any, name: str, default: Any = None) -> Any:
    if isinstance(source, Mapping):
        return source.get(name, default)
    return getattr(source, name, default)


def read_chunk(chunk: ChunkResult) -> ChunkView:
    control, facts = chunk.control, chunk.facts
    mouse = _get(control, "mouse") or (0.0, 0.0)
    latency = _get(facts, "control_to_output_s")
    return ChunkView(
        session=chunk.session,
        index=chunk.index,
        frames=chunk.frames,
        keys=tuple(sorted(_get(control, "keys") or ())),
        mouse=(float(mouse[0]), float(mouse[1])),
        revision=int(_get(control, "revision", -1)),
        control_to_output_s=None if latency is None else float(latency),
        times=_get(facts, "times") or {},
        spans=tuple(tuple(span) for span in _get(facts, "spans") or ()),
        gateway_input_to_photon_s=dict(chunk.input_to_photon_s),
    )


def chrome_trace(chunks: Iterable[Timeline]) -> dict[str, object]:
    """The Chrome/Perfetto trace of a session's chunks (one track per rank and role), as ``scripts/client.py``
    writes it; chunks whose facts lack times are left out rather than guessed."""
    from runtime.metrics import ChunkRecord, Span
    from runtime.scheduler_types import ChunkTimes
    from runtime.trace import chrome_trace as build

    names = {f.name for f in dataclasses.fields(ChunkTimes)}
    records = []
    for chunk in chunks:
        try:
            times = ChunkTimes(**{k: v for k, v in chunk.times.items() if k in names})
            spans = tuple(Span(*span) for span in chunk.spans)
        except (TypeError, ValueError):
            continue
        control = {"keys": list(chunk.keys), "mouse": list(chunk.mouse), "revision": chunk.revision}
        records.append((chunk.session, ChunkRecord(chunk.index, chunk.frames, times, control, spans)))
    return build(records)
