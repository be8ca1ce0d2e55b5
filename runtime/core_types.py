"""Vocabulary of the coordinator core (runtime/core.py): the events it takes and the outputs it returns.

Plain data, no rules. Every event is something that happened at rank 0 (a decoded message, a finished image
decode, a send that failed, a timer turn); every output is something the shell must do, in list order (send a
message, decode an image off the loop thread, hand a chunk's frames to its client, end the job).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from ipc import protocol
from runtime.images import DecodedImage

EXIT_OK = 0
EXIT_FAILED = 1

# ---- events ----


@dataclass(frozen=True)
class ClientSent:
    """A client message, decoded."""

    identity: bytes  # the ROUTER identity it came from
    message: protocol.ClientMessage


@dataclass(frozen=True)
class ClientUnreadable:
    """A client message that did not decode (``protocol.ProtocolViolation``)."""

    identity: bytes
    error: str
    req: int | None = None  # when it could still be read: the error reaches the waiting request


@dataclass(frozen=True)
class ImageDecoded:
    """The shell finished a ``DecodeImage``: the image, or why it cannot be used."""

    ticket: int
    image: DecodedImage | None
    error: str = ""


@dataclass(frozen=True)
class ClientUnreachable:
    """A message to a client's session could not be queued: the peer is ``gone`` (it may reconnect and resume) or
    ``full`` (connected but not reading: it is dropped, never buffered)."""

    identity: bytes
    session: str
    why: Literal["gone", "full"]


@dataclass(frozen=True)
class WorkerSent:
    """A worker's completion or heartbeat."""

    message: protocol.Completion | protocol.Beat


@dataclass(frozen=True)
class MemorySampled:
    """Memory of a rank without a heartbeat thread of its own (the coordinator's)."""

    rank: int
    rss: int
    peak_rss: int
    cuda_peak: int
    held: int | None = None  # bytes the sessions' caches hold on this rank, as its stages count them


@dataclass(frozen=True)
class FramesMissing:
    """A chunk's frames were not in rank 0's mailbox when they were to leave (``EmitChunk``)."""

    session: str
    index: int
    error: str


@dataclass(frozen=True)
class RankLost:
    """A rank died, hung or cannot be reached (a worker socket gone, a fatal error on rank 0's own threads)."""

    reason: str


@dataclass(frozen=True)
class Tick:
    """A turn of the loop: timers (pings, liveness, deadlines, silent clients) are due."""


@dataclass(frozen=True)
class ShutdownRequested:
    """Stop serving. The shell already ordered every worker to stop; ``lost`` ranks could not be reached."""

    lost: tuple[int, ...] = ()


Event = (ClientSent | ClientUnreadable | ImageDecoded | ClientUnreachable | WorkerSent | MemorySampled
         | FramesMissing | RankLost | Tick | ShutdownRequested)

# ---- outputs ----


@dataclass(frozen=True)
class ToClient:
    identity: bytes
    message: protocol.Opened | protocol.Accepted | protocol.Closed | protocol.Error | protocol.StatsReply \
        | protocol.HeartbeatAck
    session: str | None = None  # the session it belongs to: a failed send is reported back for it


@dataclass(frozen=True)
class ToWorker:
    identity: bytes
    message: protocol.WorkerTask | protocol.Ping


@dataclass(frozen=True)
class DecodeImage:
    """Decode a start image off the loop thread; answer with ``ImageDecoded(ticket, ...)``."""

    ticket: int
    data: bytes
    max_pixels: int


@dataclass(frozen=True)
class EmitChunk:
    """The frames of (session, index) leave rank 0's mailbox: as a ``Chunk`` with these facts to ``to``, or
    nowhere while the client is away (``to`` None). A miss is reported as ``FramesMissing``."""

    session: str
    facts: protocol.ChunkFacts
    to: bytes | None


@dataclass(frozen=True)
class DropTensors:
    """The session is gone: forget its tensors on rank 0 (late ones are discarded)."""

    session: str


@dataclass(frozen=True)
class Stop:
    """End the job with this exit code, after sending the outputs before it."""

    code: int
    reason: str


Output = ToClient | ToWorker | DecodeImage | EmitChunk | DropTensors | Stop


class MetricsSink(Protocol):
    """Where live counters go besides the server metrics (the Prometheus exporter); in-memory, no I/O."""

    def on_open(self) -> None: ...

    def on_chunk(self, frames: int, latency: float | None, period: float | None) -> None: ...

    def on_reject(self, reason: str) -> None: ...

    def on_idle(self, seconds: float, cause: str) -> None: ...

    def update(self, open_sessions: int, memory: dict[int, dict[str, int]]) -> None: ...


class ClientError(Exception):
    """A client request cannot be served; ``code`` goes on the wire, the state is unchanged."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


class JobFailed(Exception):
    """A rank died or hung, or a task overran its deadline: the job must end with a non-zero exit."""
