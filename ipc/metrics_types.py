"""The metrics on the wire as typed values: a session's summary (``Closed.summary``, ``per_session`` entries) and a
server's or router's stats (``StatsReply.stats``). Built by ``runtime.metrics`` and ``runtime.core.stats`` (the
router: ``runtime.router.stats``), read by attribute everywhere, never by string key.

The encoded maps keep the keys and values the dicts of earlier versions had, so older clients and the web page read
them as before. Reading is tolerant both ways: unknown fields are dropped (a newer server's additions never break an
older client) and every field has a default (a map from an older server, or a partial one, still reads). Fields
that only some senders fill (the closing extras of a summary, the router's or the server's own parts of the stats)
are ``UNSET`` when absent and then left out of the encoded map, so it keeps exactly the keys its sender set.

Adding a metric: a field here (appended, with a default), the line in ``runtime.metrics`` that fills it.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

import msgspec
from msgspec import UNSET, UnsetType, field

# the values come from below the protocol (``ipc.values``): the schemas import this module, never the reverse
from ipc.values import ChunkControl, SessionId

# the ranges of what a router reads of its replicas' stats (``runtime.replicas.read_stats``): beyond them, not a server
MAX_COUNT = 2**53  # a counter beyond this is nonsense (and a sum over replicas must still fit a msgpack uint64)
MAX_UPTIME_S = 1e9  # 31 years
MAX_SESSIONS = 100_000  # sessions one stats reply shows
MAX_COUNTED = 64  # reject or error reasons in one reply (a server keeps 32)
MAX_TEXT = 128
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_UPTIME_S)]
Reason = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
Counted = Annotated[dict[Reason, Count], msgspec.Meta(max_length=MAX_COUNTED)]


class _Metric(msgspec.Struct, frozen=True):
    """A metrics value: unknown fields are dropped on decode (a newer sender's additions)."""


# ---------------------------------------------------------------------------------------------------- a session


class Distribution(_Metric):
    """A ``runtime.metrics.StreamStat``: exact count/mean/min/max, nearest-rank percentiles (None when empty)."""

    count: int = 0
    mean: float | None = None
    min: float | None = None
    max: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    p95: float | UnsetType | None = UNSET  # the chunk period's only (the real-time factor uses it)
    total: float | UnsetType = UNSET  # the condition prefetch wait's only: its sum


class TimeToFirstFrame(_Metric):
    from_open: float | None = None
    from_first_control: float | None = None


class Compute(_Metric):
    """Compute over chunks: frames / compute seconds (see ``runtime.metrics``)."""

    chunks: int = 0
    frames: int = 0
    compute_s: float = 0.0
    fps_weighted: float | None = None


class WarmUpCompute(Compute, frozen=True):
    """The warm-up chunks' compute, and their control-to-output latencies (None: a chunk without a control)."""

    latency_s: tuple[float | None, ...] = ()


class IdleShare(_Metric):
    count: int = 0
    total_s: float = 0.0
    fraction: float | None = None  # of the elapsed time (None before any)


class IdleCause(StrEnum):
    """Why the DiT sat idle (``runtime.scheduler`` finds it; ``IdleByCause`` has a field per member, in this order)."""

    CONDITION = "condition"  # the control was there, the condition was not
    CONTROL = "control"  # waiting for the client's control
    EDGE = "edge"  # no room downstream (latent/output edge full)
    NO_SESSION = "no_session"  # nothing open to serve
    SAVE = "save"  # a save held the next chunk while every rank copied the session's state


def _shares(self: Any) -> dict[str, IdleShare]:
    """Each cause's share, by the cause's name."""
    return msgspec.structs.asdict(self)


# DiT idle time by cause: one ``IdleShare`` field per ``IdleCause`` member, named by its value (built from the enum
# so a new cause is one line there)
IdleByCause = msgspec.defstruct(
    "IdleByCause", [(cause.value, IdleShare, field(default_factory=IdleShare)) for cause in IdleCause],
    bases=(_Metric,), module=__name__, namespace={"shares": _shares})


class Idle(_Metric):
    total_s: float = 0.0
    fraction: float | None = None
    by_cause: IdleByCause = field(default_factory=IdleByCause)


class RecentChunk(_Metric):
    """One of the last chunks of a session (``runtime.metrics.brief``)."""

    index: int = 0
    emitted: float = 0.0
    frames: int = 0
    latency_s: float | None = None
    compute_s: float = 0.0
    control: ChunkControl | None = None


class ClockOffset(_Metric):
    offset_s: float = 0.0
    uncertainty_s: float = 0.0


class SessionSummary(_Metric):
    """A session's metrics: on close (``Closed.summary``, what the SDK's ``close`` returns) and live (``per_session``
    of a stats reply). The rules behind each figure: ``runtime.metrics``."""

    session: str = ""
    opened_at: float = 0.0
    closed_at: float | None = None
    elapsed_s: float | None = None
    chunks: int = 0
    frames: int = 0
    time_to_first_frame_s: TimeToFirstFrame = field(default_factory=TimeToFirstFrame)
    latency_s: Distribution = field(default_factory=Distribution)
    chunk_period_s: Distribution = field(default_factory=Distribution)
    compute: Compute = field(default_factory=Compute)
    warmup: WarmUpCompute = field(default_factory=WarmUpCompute)
    chunk_media_s: float | None = None
    real_time_factor: float | None = None
    dit_idle: Idle = field(default_factory=Idle)
    condition_prefetch_wait_s: Distribution = field(default_factory=Distribution)
    peak_memory_bytes: dict[str, int] = {}  # rank -> bytes
    percentile_relative_error: float = 0.0
    recent_chunks: tuple[RecentChunk, ...] = ()
    # set on a session's normal close (``runtime.core``): the clocks, the releases, what was not released
    clock_offsets: dict[str, ClockOffset] | UnsetType = UNSET
    released: dict[str, list[int]] | UnsetType = UNSET  # stage -> ranks that confirmed, in release order
    leaked_caches: list[str] | UnsetType = UNSET
    poisoned: bool | UnsetType = UNSET
    replica: str | UnsetType = UNSET  # from a router: the replica the session ran on
    # set by the SDK from the ``closed`` message (``ipc.client.closed_summary``): why it ended
    reason: str | UnsetType = UNSET
    error: str | UnsetType | None = UNSET


class PartialSummary(SessionSummary, omit_defaults=True):
    """A summary from a sender that holds no metrics of the session (a router naming the replica of a session it
    lost, or of one whose replica has not reported yet): encoded with the fields it sets only (its figures are
    unknown, not zero); a reader decodes it as a ``SessionSummary`` whose ``session`` is empty."""

    time_to_first_frame_s: TimeToFirstFrame | None = None  # type: ignore[assignment]
    latency_s: Distribution | None = None  # type: ignore[assignment]
    chunk_period_s: Distribution | None = None  # type: ignore[assignment]
    compute: Compute | None = None  # type: ignore[assignment]
    warmup: WarmUpCompute | None = None  # type: ignore[assignment]
    dit_idle: Idle | None = None  # type: ignore[assignment]
    condition_prefetch_wait_s: Distribution | None = None  # type: ignore[assignment]


# ---------------------------------------------------------------------------------------------------- a server


class SessionCounts(_Metric):
    open: Count = 0
    total: Count = 0


class RankStats(_Metric):
    """A rank's memory (its heartbeat) and its memory admission (``runtime.memory_admission``)."""

    rss: int = 0
    peak_rss: int = 0
    cuda_peak: int = 0
    session_bytes: int | None = None
    free_bytes: int | None = None
    room_bytes: int | None = None
    measured_session_bytes: int | None = None


class WarmUpStage(_Metric):
    """One stage's start-up warm-up (``runtime.warm_start``): keyed by rank as text."""

    seconds: float = 0.0  # the slowest rank's
    chunks_per_size: int = 0
    ranks: dict[str, list[str]] = {}  # rank -> sizes warmed ("480x832")
    threads: dict[str, list[str]] = {}
    failed: dict[str, dict[str, str]] = {}  # rank -> size -> why


# each stage's warm-up by the stage's name (``Stage`` values, in pipeline order: the map the struct of one field per
# stage encoded to); a name this reader does not know is a newer server's stage, read like the others
WarmUpStages = dict[str, WarmUpStage]


class SeatStats(_Metric):
    """A session's seat in the capacity model (``runtime.capacity``)."""

    steps: int = 0
    want_steps: int = 0
    min_steps: int = 0
    steps_changed: str | None = None
    predicted_rtf: float | None = None
    measured_rtf: float | None = None
    measured_periods: int = 0


class CapacityStats(_Metric):
    """Real-time admission and the degrade ladder (``runtime.capacity``)."""

    admission: str = ""
    ladder: str = ""
    margin: float = 0.0
    predicted_period_s: float | None = None
    headroom: float | None = None  # what a router places by (None: not admitting by real time)
    stage_s: dict[str, float] = {}  # "stage/steps/HxW" -> seconds
    sessions: dict[str, SeatStats] = {}


class SnapshotFolder(_Metric):
    """The server's ``[snapshots] dir`` (``runtime.snapshots``): its complete snapshots, as last listed (after each
    save, and at most every few seconds for a ``stats``), and the retention budget (0: no limit). Without a budget
    the folder is never listed (it may hold thousands on a shared filesystem): ``count`` and ``bytes`` are None."""

    count: Count | None = 0
    bytes: Count | None = 0
    max_bytes: Count = 0
    max_count: Count = 0


class RouterTotals(_Metric):
    """A router's sums over its up replicas."""

    replicas_up: int = 0
    replicas: int = 0
    max_sessions: int = 0
    open_sessions: int = 0
    sessions_total: int = 0
    chunks_emitted: int = 0
    frames_emitted: int = 0
    rejects: dict[str, int] = {}
    errors: dict[str, int] = {}


class RouterCounters(_Metric):
    chunks_forwarded: int = 0
    client_messages: int = 0
    watchers: int = 0
    watch_dropped: int = 0
    opening: int = 0
    sessions_total: int = 0
    chunk_hold_s: Distribution = field(default_factory=Distribution)  # a chunk's stay in the router (its shell's)
    autosaves: int = 0
    migrations: int = 0


class ReplicaView(_Metric):
    """A replica as its router shows it (``runtime.replicas.Replica.describe``)."""

    state: str = ""
    endpoint: str = ""
    source: str = ""
    layout: str = ""
    max_sessions: int = 0
    server: str = ""
    sessions: int = 0
    opening: int = 0
    external_sessions: int = 0
    load: int = 0
    chunk_period_s: float | None = None
    for_s: float = 0.0
    down_reason: str | None = None
    stats_age_s: float | None = None
    stats: dict[str, Any] | None = None  # its own latest stats, without any session's entry (shown as it came)


class ServerStats(_Metric, kw_only=True):
    """A ``stats`` reply: a server's (``runtime.core.stats``) or a router's (``runtime.router.stats``, layout
    "router"). The counters a router reads of its replicas carry ranges (``runtime.replicas.read_stats``): a value
    out of them is not a server's. ``per_session``: the asking client's sessions only."""

    uptime_s: Seconds
    sessions: SessionCounts = field(default_factory=SessionCounts)
    chunks_emitted: Count = 0
    frames_emitted: Count = 0
    rejects: Counted = {}
    errors: Counted | UnsetType = UNSET
    dit_idle: Idle | UnsetType = UNSET
    per_session: Annotated[dict[SessionId, SessionSummary], msgspec.Meta(max_length=MAX_SESSIONS)] = {}
    open_sessions: Count
    # a server's own (``runtime.core``)
    watchers: int | UnsetType = UNSET  # spectators of every session now
    draining: bool | UnsetType = UNSET  # True while the server drains (it takes no new session); absent otherwise
    watch_dropped: int | UnsetType = UNSET  # chunks dropped for slow watchers so far (never the players')
    ranks: dict[str, RankStats] | UnsetType = UNSET
    clock_offsets: dict[str, ClockOffset] | UnsetType = UNSET
    layout: Reason = ""
    schedule: str | UnsetType = UNSET
    warm: bool | UnsetType = UNSET  # every stage ran at every served size before the port opened
    warm_up: WarmUpStages | UnsetType = UNSET
    sizes: list[tuple[int, int]] | UnsetType = UNSET
    capacity: CapacityStats | UnsetType = UNSET  # real-time factors, headroom, the ladder's steps
    snapshots: SnapshotFolder | UnsetType = UNSET  # the snapshot folder and its budget
    # a router's own (``runtime.router``)
    total: RouterTotals | UnsetType = UNSET
    router: RouterCounters | UnsetType = UNSET
    replicas: dict[str, ReplicaView] | UnsetType = UNSET


def given(value: Any) -> Any:
    """A field that only some senders fill, or None where it was not."""
    return None if value is UNSET else value

