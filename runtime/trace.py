"""Export chunk spans as a Chrome / Perfetto trace (the JSON "Trace Event Format").

Pure: records in, a JSON-able dict out (``json.dump`` it to a ``.json`` file and open it in ui.perfetto.dev or
chrome://tracing). Rules:

- One process per rank (``pid = rank``, named "rank N" by a ``process_name`` metadata event) and one thread per
  role on that rank (``tid`` = a small integer fixed per role name, named by a ``thread_name`` event), so every
  (rank, role) pair is one track.
- Every span is a complete event (``ph: "X"``) with ``ts``/``dur`` in microseconds since ``origin`` (rank-0
  seconds; default: the earliest time in the export). Its name is "<span> <session>#<chunk>"; ``args`` carry the
  session, the chunk index and the queue wait before the span started.
- With ``windows=True`` each chunk also gets an event on rank 0's "chunks" track covering its window, from the
  control acceptance or condition submission (whichever came first) to emission.
- A chunk whose steps changed (``steps_changed``: the first chunk of a new setting) also gets an instant event
  (``ph: "i"``) "steps N (why) <session>#<chunk>" on the chunks track at its denoise start, where it took effect.
- Spans must already be in rank-0 time (convert with ``runtime.clock.ClockSync``); ``spans_outside_window`` finds
  the ones that do not fit their chunk's window, which after conversion points at a bad clock offset.
"""

from __future__ import annotations

from collections.abc import Iterable

from ipc.protocol import ChunkFacts, Span, Stage, to_builtins
from runtime.metrics import window

# a track per stage in pipeline order (its worker's role is the stage's name), the coordinator's above them, the
# transfer threads' below, the chunk windows last; a role not named here gets the next free track
ROLE_TIDS = {"coordinator": 0, **{stage.value: i for i, stage in enumerate(Stage, 1)}, "transfer": len(Stage) + 1,
             "chunks": 9}
WINDOW_ROLE = "chunks"


def spans_outside_window(record: ChunkFacts, slack: float = 0.0) -> list[Span]:
    """Spans of ``record`` that start before its window or end after it, beyond ``slack`` seconds."""
    start, end = window(record)
    return [s for s in record.spans if s.start < start - slack or s.end > end + slack]


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def chrome_trace(
    chunks: Iterable[tuple[str, ChunkFacts]], origin: float | None = None, windows: bool = True
) -> dict[str, object]:
    """The trace of ``(session, record)`` pairs as a Trace Event Format dict (``{"traceEvents": [...]}``)."""
    chunks = list(chunks)
    if origin is None:
        times = [s.queued for _, r in chunks for s in r.spans] + [window(r)[0] for _, r in chunks]
        origin = min(times, default=0.0)
    tids = dict(ROLE_TIDS)
    tracks: set[tuple[int, str]] = set()
    events: list[dict[str, object]] = []
    for session, record in chunks:
        label = f"{session}#{record.index}"
        for span in record.spans:
            tid = tids.setdefault(span.role, max(tids.values()) + 1)
            tracks.add((span.rank, span.role))
            events.append({
                "name": f"{span.name} {label}",
                "cat": span.name.split(":", 1)[0],
                "ph": "X",
                "ts": _us(span.start - origin),
                "dur": _us(span.end - span.start),
                "pid": span.rank,
                "tid": tid,
                "args": {"session": session, "chunk": record.index, "queued_us": _us(span.start - span.queued)},
            })
        if windows:
            start, end = window(record)
            latency = record.times.control_to_output
            tracks.add((0, WINDOW_ROLE))
            events.append({
                "name": f"chunk {label}",
                "cat": "chunk",
                "ph": "X",
                "ts": _us(start - origin),
                "dur": _us(end - start),
                "pid": 0,
                "tid": tids[WINDOW_ROLE],
                "args": {"session": session, "chunk": record.index, "frames": record.frames,
                         "latency_us": None if latency is None else _us(latency),
                         "control": to_builtins(record.control), "steps": record.steps},
            })
        if record.steps_changed is not None:
            tracks.add((0, WINDOW_ROLE))
            events.append({"name": f"steps {record.steps} ({record.steps_changed}) {label}", "cat": "steps",
                           "ph": "i", "s": "t", "ts": _us(record.times.denoise_start - origin), "pid": 0,
                           "tid": tids[WINDOW_ROLE], "args": {"session": session, "chunk": record.index,
                                                              "steps": record.steps, "why": record.steps_changed}})
    meta: list[dict[str, object]] = []
    for rank in sorted({rank for rank, _ in tracks}):
        meta.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
    for rank, role in sorted(tracks):
        meta.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tids[role], "args": {"name": role}})
    return {"traceEvents": meta + events, "displayTimeUnit": "ms", "otherData": {"origin_s": origin}}
