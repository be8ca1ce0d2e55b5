"""Vocabulary of the coordinator core (runtime/core.py): the events it takes and the outputs it returns.

Plain data, no rules. Every event is something that happened at rank 0 (a decoded message, a finished image
decode, a send that failed, a timer turn); every output is something the shell must do, in list order (send a
message, decode an image off the loop thread, hand a chunk's frames to its client, end the job). What concerns
clients alone (their messages, failed sends, replies, the timer turn, the stop) is ``runtime.client_types``, shared
with the router core and re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ipc import protocol
from runtime.client_types import (  # the client side, shared with the router core
    ClientError,
    ClientSent,
    ClientUnreachable,
    ClientUnreadable,
    EndWatch,
    ShutdownRequested,
    Stop,
    Tick,
    ToClient,
    WatchDropped,
)
from runtime.images import DecodedImage
from runtime.snapshots import Manifest, Stored

__all__ = ["EXIT_FAILED", "EXIT_OK", "ClientError", "ClientSent", "ClientUnreachable", "ClientUnreadable",
           "DecodeImage", "DrainEnded", "DrainRequested",
           "DropTensors", "EmitChunk", "EndWatch", "Event", "FramesMissing", "ImageDecoded", "JobFailed",
           "ListSnapshots", "ManifestRead", "ManifestWritten", "MemorySampled",
           "Output", "RankLost", "ReadManifest", "ShutdownRequested", "SnapshotsListed", "Stop", "Tick", "ToClient",
           "ToWorker", "WatchDropped", "WorkerSent", "WriteManifest"]

EXIT_OK = 0
EXIT_FAILED = 1

# ---- events ----


@dataclass(frozen=True)
class ImageDecoded:
    """The shell finished a ``DecodeImage``: the image, or why it cannot be used."""

    ticket: int
    image: DecodedImage | None
    error: str = ""


@dataclass(frozen=True)
class ManifestRead:
    """The shell finished a ``ReadManifest``: the manifest (its size, numbers and files checked by
    ``SnapshotStore.read``), or why there is none to restore."""

    ticket: int
    manifest: Manifest | None
    error: str = ""


@dataclass(frozen=True)
class ManifestWritten:
    """The shell finished a ``WriteManifest``: the save is complete (``error`` empty) or it never will be."""

    snapshot: str
    error: str = ""


@dataclass(frozen=True)
class SnapshotsListed:
    """The shell finished a ``ListSnapshots``: the folder's complete snapshots (None: it could not be listed)."""

    written: str
    stored: tuple[Stored, ...] | None


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
    cache_bytes: int | None = None  # bytes the sessions' caches hold on this rank, as its stages count them


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
class DrainRequested:
    """A stop signal (the first: a second stops at once) asks the server to drain (``runtime.drain``)."""


Event = (ClientSent | ClientUnreadable | ImageDecoded | ManifestRead | ManifestWritten | SnapshotsListed
         | ClientUnreachable | WorkerSent
         | MemorySampled
         | FramesMissing | RankLost | Tick | ShutdownRequested | WatchDropped | DrainRequested)

# ---- outputs ----


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
class ReadManifest:
    """Read a snapshot's manifest off the loop thread (a shared folder may hold anything: a manifest of a
    gigabyte, a slow filesystem); answer with ``ManifestRead(ticket, ...)`` (``runtime.snapshots.read_manifest``)."""

    ticket: int
    snapshot: str  # an id checked by ``check_id``: it names no path outside the folder


@dataclass(frozen=True)
class WriteManifest:
    """Write a finished save's manifest (``SnapshotStore.write``), stamped with the wall clock there: the core reads
    no clock and touches no file. Answer with ``ManifestWritten``."""

    manifest: Manifest


@dataclass(frozen=True)
class ListSnapshots:
    """List the folder's complete snapshots off the loop thread (it reads every manifest: 1.2 s for 1,000 on a
    busy CPU), after the save ``written``; answer with ``SnapshotsListed`` (the budget is kept then)."""

    written: str


@dataclass(frozen=True)
class EmitChunk:
    """The frames of (session, index) leave rank 0's mailbox: as a ``Chunk`` with these facts to ``to``, or
    nowhere while the client is away (``to`` None). A miss is reported as ``FramesMissing``."""

    session: str
    facts: protocol.ChunkFacts
    to: bytes | None
    watchers: tuple[bytes, ...] = ()  # its watchers: the same encoded chunk goes to each one's feed


@dataclass(frozen=True)
class DropTensors:
    """The session is gone: forget its tensors on rank 0 (late ones are discarded)."""

    session: str


@dataclass(frozen=True)
class DropSnapshotFiles:
    """A save failed: delete what its ranks wrote (it has no manifest, so nothing can restore it). Asked again for
    every file a rank reports after the failure (its writer finished later). ``expired``: a complete snapshot the
    retention budget deletes (``runtime.snapshots.over_budget``), its manifest first."""

    snapshot: str
    expired: bool = False


@dataclass(frozen=True)
class DrainEnded:
    """The drain is over (every session handed off, or ``server.drain_s`` is up): stop as on a stop signal."""

    why: str


Output = (ToClient | ToWorker | DecodeImage | ReadManifest | WriteManifest | ListSnapshots | EmitChunk | EndWatch
          | DropTensors | DropSnapshotFiles | Stop | DrainEnded)


class JobFailed(Exception):
    """A rank died or hung, or a task overran its deadline: the job must end with a non-zero exit."""
