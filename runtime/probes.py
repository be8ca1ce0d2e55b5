"""What the probes say: readiness rules and the snapshot a loop publishes for its HTTP probe server.

Pure, no I/O: the loop that owns the state (rank 0's coordinator, the router) builds a frozen ``Snapshot`` from
what it knows and hands it to ``ranks.probe_server.ProbeServer``; the server's thread reads only the latest snapshot
(one attribute read), never the loop's own objects, so a probe can neither block the loop nor see it half-updated.

Rules:

- **Rank 0 is ready** when every rank reported in, every stage warmed every served size (``stats``' ``warm``), the
  loop serves (the core exists and the client port answers) and it is neither draining nor stopping. A server
  that could not warm a size stays not ready: its ``/ready`` body names why.
- **The router is ready** when at least one replica is up and it is not stopping.
- ``draining`` is true from the drain's start (a first stop signal or an operator's ``drain``, ``runtime.drain``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["gauge", "counter"]


@dataclass(frozen=True)
class Sample:
    """One value of a series exported from a snapshot (a loop's state, not an event count an observer keeps)."""

    name: str  # without the ``_total`` a counter gets on the wire
    kind: Kind
    help: str
    value: float
    labels: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Snapshot:
    """What a loop last published: readiness, why not, facts for the ``/ready`` body, series for ``/metrics``."""

    ready: bool
    why_not: tuple[str, ...] = ()  # empty when ready
    facts: Mapping[str, object] = field(default_factory=dict)
    samples: tuple[Sample, ...] = ()


STARTING = Snapshot(ready=False, why_not=("starting: nothing published yet",))


def rank0_snapshot(*, world_size: int, ranks_in: int, warm: bool, serving: bool, draining: bool = False,
                   stopping: bool = False, rooms: Mapping[int, Mapping[str, int | None]] | None = None,
                   open_sessions: int = 0, restored: int = 0) -> Snapshot:
    """Rank 0's readiness and its loop's gauges; ``rooms``: rank -> ``MemoryAdmission.stats`` of that rank."""
    why = []
    if ranks_in < world_size:
        why.append(f"{ranks_in} of {world_size} ranks reported in (warming up)")
    elif not warm:
        why.append("not warm: some stage could not warm a served size (stats: warm_up)")
    if not serving and ranks_in >= world_size:
        why.append("not serving yet")
    if draining:
        why.append("draining")
    if stopping:
        why.append("stopping")
    samples = [
        Sample("worldstream_ranks_in", "gauge", "Ranks that reported in (warm) to rank 0", ranks_in),
        Sample("worldstream_world_size", "gauge", "Ranks in the job", world_size),
        Sample("worldstream_warm", "gauge", "1 once every stage warmed every served size", float(warm)),
        Sample("worldstream_draining", "gauge", "1 while the server drains (admits no session)", float(draining)),
        Sample("worldstream_ready", "gauge", "1 when /ready answers 200", float(not why)),
        Sample("worldstream_sessions_restored", "counter",
               "Sessions restored here from a snapshot (a router's migrations arrive as these)", restored),
    ]
    for rank, room in sorted((rooms or {}).items()):
        labels = (("rank", str(rank)),)
        for key, help_ in (("room_bytes", "Bytes a rank can give to sessions (absent: unlimited)"),
                           ("session_bytes", "Bytes the open sessions cost a rank, by the memory model")):
            value = room.get(key)
            if value is not None:
                samples.append(Sample(f"worldstream_rank_{key}", "gauge", help_, value, labels))
    facts = {"world_size": world_size, "ranks_in": ranks_in, "warm": warm, "serving": serving,
             "draining": draining, "stopping": stopping, "open_sessions": open_sessions}
    return Snapshot(ready=not why, why_not=tuple(why), facts=facts, samples=tuple(samples))


def router_snapshot(*, replicas: Mapping[str, bool], placements: int, migrations: int, open_sessions: int,
                    chunks_forwarded: int, forwarded_bytes: int, stopping: bool = False) -> Snapshot:
    """The router's readiness and gauges; ``replicas``: name -> up."""
    up = sum(replicas.values())
    why = []
    if not up:
        why.append(f"no replica up (of {len(replicas)} known)")
    if stopping:
        why.append("stopping")
    samples = [
        Sample("worldstream_router_replicas_up", "gauge", "Replicas up (taking sessions)", up),
        Sample("worldstream_router_replicas_down", "gauge", "Replicas known but down", len(replicas) - up),
        *(Sample("worldstream_router_replica_up", "gauge", "1 while this replica is up", float(is_up),
                 (("replica", name),)) for name, is_up in sorted(replicas.items())),
        Sample("worldstream_router_placements", "counter", "Sessions the router placed on a replica", placements),
        Sample("worldstream_router_migrations", "counter",
               "Sessions restored on another replica after theirs went down", migrations),
        Sample("worldstream_router_open_sessions", "gauge", "The router's sessions open now", open_sessions),
        Sample("worldstream_router_chunks_forwarded", "counter", "Chunks forwarded to clients", chunks_forwarded),
        Sample("worldstream_router_forwarded_bytes", "counter",
               "Bytes of replica messages sent on as received (chunks, mostly) to clients and watchers",
               forwarded_bytes),
        Sample("worldstream_ready", "gauge", "1 when /ready answers 200", float(not why)),
    ]
    facts = {"replicas_up": up, "replicas": len(replicas), "stopping": stopping, "open_sessions": open_sessions}
    return Snapshot(ready=not why, why_not=tuple(why), facts=facts, samples=tuple(samples))


def families(samples: Iterable[Sample]) -> dict[str, list[Sample]]:
    """Samples grouped by series name, in first-seen order (one Prometheus family each)."""
    out: dict[str, list[Sample]] = {}
    for sample in samples:
        out.setdefault(sample.name, []).append(sample)
    return out
