"""Rank 0's start, once every worker reported in: the core built from the config, section by section, with every
served size priced (``models.memory``) before the port opens, so no session waits for a price on the loop.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from models import memory
from runtime.config import Config, client_token, operator_token
from runtime.core import CoordinatorCore
from runtime.memory_admission import Cost, gib
from runtime.probes import rank0_snapshot
from runtime.save_rate import SaveRate
from runtime.sizes import served_sizes
from runtime.snapshots import Budget, SnapshotStore, model_identity
from runtime.warm_start import WarmStart

log = logging.getLogger(__name__)


def build_core(c: Config, geometry: Any, device: str, exporter: Any, rooms: dict[int, int],
               warm_start: WarmStart) -> CoordinatorCore:  # fmt: skip
    session_cost = price_sessions(c, device)  # seconds of meta-device runs: before the core's heartbeat clock starts
    core = CoordinatorCore(c.layout, c.server, c.stream, c.scheduler, c.timeouts, c.metrics, geometry, time.monotonic(),
                           observers=() if exporter is None else (exporter,), intrinsics=c.controls.intrinsics,
                           rooms=rooms, session_cost=session_cost, warm_start=warm_start, capacity=c.capacity,
                           snapshots=SnapshotStore(c.snapshots.dir,
                                                   Budget.of(c.snapshots.max_gb, c.snapshots.max_count),
                                                   SaveRate(c.snapshots.saves_per_minute, c.snapshots.save_burst)),
                           model=model_identity(c.model.kind, c.model.preset, c.model.checkpoint_dir,
                                                c.model.weights_seed),
                           auth_token=client_token(c.server), operator_token=operator_token(c.server))
    log.info("warm-up: %s", warm_start.describe())
    core.admitting.memory.unservable_sizes.update(warm_start.failures())  # a rank out of memory at a size
    for reason in core.admitting.memory.unservable(served_sizes(c.stream)):
        log.warning("%s", reason)
    return core


def price_sessions(config: Config, device: str) -> Cost | None:
    """What one more session costs each rank at a frame size: every served size priced now (a meta-device run takes
    about a second per size for a full-size model), any other when asked."""
    if not memory.priced(config, device):
        return None
    priced = {size: memory.session_costs(config, *size, device) for size in served_sizes(config.stream)}
    for (height, width), cost in priced.items():
        log.info("a %dx%d session costs %s", height, width, ", ".join(f"rank {r} {gib(n)}" for r, n in cost.items()))

    def cost(height: int, width: int) -> Mapping[int, int]:
        known = priced.get((height, width))
        return known if known is not None else memory.session_costs(config, height, width, device)

    return cost


def write_port_file(port: int) -> None:
    """``WORLDSTREAM_PORT_FILE``, once serving: tests and scripts wait on it (written whole, then renamed)."""
    port_file = os.environ.get("WORLDSTREAM_PORT_FILE")
    if port_file:
        with open(f"{port_file}.tmp", "w") as f:
            f.write(str(port))
        os.replace(f"{port_file}.tmp", port_file)


def probe_snapshot(core: CoordinatorCore | None, world: int, ranks_in: int, warm: bool,
                   stopping: bool) -> Any:  # fmt: skip
    """What rank 0's probe server answers from (``runtime.probes``), from the loop's state and its core's."""
    return rank0_snapshot(
        world_size=world, ranks_in=ranks_in, warm=warm, serving=core is not None,
        draining=core is not None and core.draining.active, stopping=stopping,
        rooms=None if core is None else {r: core.admitting.memory.stats(r) for r in range(world)},
        open_sessions=0 if core is None else len(core.sessions), restored=0 if core is None else core.restored)
