"""What the SDK's calls return: a session's geometry (``SessionInfo``), a saved session (``Snapshot``), a chunk
(``ChunkResult``), a watched session (``Watch``), and the input-to-photon clock of a live session."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from ipc import protocol

KEEP_REVISIONS = 1024  # sent-but-not-yet-shown revisions remembered per session for input-to-photon (bounded)


class SessionInfo(protocol.StreamHeader, frozen=True):
    """A session's stream header (``id`` is its ``session``) and what its ``opened`` adds (defaults when watching)."""

    intrinsics: tuple[float, float, float, float] | None = None  # (fx, fy, cx, cy) at this frame size: the camera used
    steps: int = 0  # denoising steps its first chunks run (0: a server before quality presets)
    watch_token: str = ""  # the owner shares it: others ``watch`` the session with it ("" when watching)
    first_chunk: int = 0  # its first chunk and control index (a restored session continues its snapshot's numbering)

    @property
    def id(self) -> str:
        """The session's id: what every call about it takes."""
        return self.session


@dataclass(frozen=True)
class Snapshot:
    """A saved session (``Client.save``): what ``Client.open(restore=id)`` takes, and what the save cost."""

    id: str
    session: str
    chunk: int  # the boundary: a restored session's first chunk and control index
    bytes: int  # every rank's file together
    pause_s: float  # how long the session's DiT waited for the ranks to copy their state
    write_s: float  # the slowest rank's write and hash (the stream went on meanwhile)
    files: int
    wait_s: float = 0.0  # from the request to the boundary (no cost: the chunks before it ran on)


def snapshot_of(saved: protocol.Saved) -> Snapshot:
    return Snapshot(saved.snapshot, saved.session, saved.chunk, saved.bytes, saved.pause_s, saved.write_s,
                    saved.files, saved.wait_s)


@dataclass(frozen=True)
class ChunkResult:
    session: str
    index: int
    frames: np.ndarray  # uint8 [n, H, W, 3] at the session's frame size
    control: protocol.ChunkControl  # the snapshot the model saw (revision -1 for indexed controls)
    facts: protocol.ChunkFacts  # its times and every rank's spans on the server's clock (facts.control is control)
    received: float  # client monotonic clock at arrival
    input_to_photon_s: dict[int, float] = field(default_factory=dict)  # live: revision first shown here -> latency
    missed: int = 0  # watching: chunks of the session dropped for this client right before this one (it read slowly)
    migrated: protocol.Migrated | None = None  # the first chunk after its session moved replica: where it resumed

    @property
    def revision(self) -> int:
        """The client input revision the applied snapshot came from (-1: indexed, or no live input yet)."""
        return self.control.revision

    @property
    def prompt_revision(self) -> int:
        """The prompt this chunk used: 0 the open's, r the one ``set_prompt`` answered with revision r."""
        return self.facts.prompt_revision


def session_info(opened: protocol.Opened | protocol.Watching) -> SessionInfo:
    header = protocol.StreamHeader.of(opened).as_fields()
    if isinstance(opened, protocol.Watching):
        return SessionInfo(**header)
    return SessionInfo(**header, intrinsics=opened.intrinsics, steps=opened.steps, watch_token=opened.watch_token,
                       first_chunk=opened.first_chunk)


@dataclass
class Watch:
    """A session watched read-only (``Client.watch``): its geometry, then its chunks as an iterator, from the next
    one emitted after the subscription until the session (or the watch) ends. ``ChunkResult.missed`` counts the
    chunks dropped for this client before each one (a watcher that reads too slowly loses chunks, never slows the
    player); ``missed`` here sums them."""

    info: SessionInfo
    chunks: Iterator[ChunkResult]
    missed: int = 0

    def __iter__(self) -> Iterator[ChunkResult]:
        return self

    def __next__(self) -> ChunkResult:
        chunk = next(self.chunks)
        self.missed += chunk.missed
        return chunk


class InputToPhoton:
    """Input-to-photon latency of a live session on the client clock (sans-io: times are passed in).

    For each revision r the client sent, the latency is the time from sending the ``control_state`` of r to
    receiving the first chunk whose applied control carries a revision >= r (the first frames that can show
    that input). Bounded: at most ``keep`` sent revisions wait to be shown; older ones are forgotten. A revision
    not newer than one sent before starts no clock (the server refuses it as stale: it shows nothing)."""

    def __init__(self, keep: int = KEEP_REVISIONS) -> None:
        self.keep = keep
        self._sent: OrderedDict[int, float] = OrderedDict()
        self._last = -1  # the newest revision sent

    def sent(self, revision: int, at: float) -> None:
        if revision <= self._last:
            return
        self._last = revision
        self._sent[revision] = at
        while len(self._sent) > self.keep:
            self._sent.popitem(last=False)

    def shown(self, revision: int, at: float) -> dict[int, float]:
        """A chunk applying ``revision`` arrived at ``at``: latencies of the revisions it shows for the first time."""
        out = {}
        for r in [r for r in self._sent if r <= revision]:
            out[r] = at - self._sent.pop(r)
        return out
