"""The Python client for worldstream servers (ZeroMQ DEALER + msgpack).

One background thread owns the socket: it sends what the caller queues, sends heartbeats, and routes what
arrives (replies by request id, chunks and session events by session). The caller's methods are thread-safe
and block with deadlines. Every error from the server surfaces as a ``ServerError`` (a subclass per code where
the caller may act on it: ``Busy``, ``UnknownSession``, ``RejectedControl``, ...) carrying the server's code,
message and retry hint.

Indexed mode (scripted clients, replays):

    with Client("tcp://127.0.0.1:5555") as client:
        session = client.open(Path("start.png").read_bytes(), prompt="a forest", num_chunks=8)
        for i in range(8):
            client.control(session.id, i, keys="w")
        for chunk in client.chunks(session.id):
            ...  # chunk.frames: uint8 [n, H, W, 3]

Live mode (a person at the keyboard): the client sends its held-key state whenever it changes and the server
cuts it into per-chunk snapshots. Each chunk reports the snapshot applied and the input revision it came from,
and ``chunk.input_to_photon_s`` the client-clock latency of every revision it shows for the first time.

    session = client.open(image, live=True)
    keys = client.live(session.id)
    keys.press("w"); keys.tap("i"); keys.move(2.0, 0.0); keys.release("w")

Through a router with ``snapshot_every``, a session outlives its replica: ``next_chunk`` raises ``SessionMigrated``
(its ``chunk`` is where it resumes: the session's chunks come again from that index, and its indexed controls go
on from there; the first chunk after it carries ``chunk.migrated``); ``chunks`` goes on by itself and calls its
``on_migrated`` (e.g. to send the controls again from ``chunk``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import msgspec
import numpy as np
import zmq

from ipc import protocol, tolerant
from ipc.client_bounds import MAX_CODE_CHARS, MAX_SESSION_ID_CHARS, Strays, clipped
from ipc.metrics_types import ServerStats, SessionSummary
from ipc.newer_peer import PeerReader
from ipc.outgoing import MAX_IN_FLIGHT, InFlight, Outgoing

KEEP_REVISIONS = 1024  # sent-but-not-yet-shown revisions remembered per session for input-to-photon (bounded)
KEEP_QUIET_REQS = 4096  # fire-and-forget request ids remembered, so their errors do not end a chunk stream
log = logging.getLogger("worldstream.client")
MAX_OUTBOX = 1024  # a caller's messages waiting to leave the socket; one more is refused with ``OutboxFull``

# ------------------------------------------------------------------------------------------------ errors


class ServerError(Exception):
    """The server answered with an error. ``code`` is machine-readable, ``message`` says why for people,
    ``retry_after_s`` is set when trying again later can work. Subclasses exist per code a caller may act on;
    ``ServerError.of(code, ...)`` builds the right one (unknown codes give the base class)."""

    codes: tuple[str, ...] = ()

    def __init__(self, code: str, message: str, session: str | None = None, retry_after_s: float | None = None,
                 req: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.session = session
        self.retry_after_s = retry_after_s
        self.req = req

    @staticmethod
    def of(code: str, message: str, session: str | None = None, retry_after_s: float | None = None,
           req: int | None = None) -> ServerError:
        return _ERROR_TYPES.get(code, ServerError)(code, message, session, retry_after_s, req)

    @staticmethod
    def from_wire(error: protocol.Error) -> ServerError:
        return ServerError.of(clipped(error.code, MAX_CODE_CHARS), clipped(error.message), error.session,
                              error.retry_after_s, error.req)


class Busy(ServerError):
    """The server is at its session limit; ``retry_after_s`` says when to try again."""

    codes = ("busy",)


class UnknownSession(ServerError):
    """No such session for this client (never opened, closed, timed out, or owned by another identity)."""

    codes = ("unknown_session",)


class RejectedControl(ServerError):
    """An indexed control was refused (duplicate, skip, out of order or out of range); nothing changed."""

    codes = ("rejected_control",)


class ControlBackpressure(RejectedControl):
    """The control edge is full; the same control will be accepted once work moves on (``Client.control``
    retries these itself)."""

    codes = ("control_backpressure",)


class BadRequest(ServerError):
    """The request itself is invalid: malformed message, bad image, bad control or live state, bad limits."""

    codes = ("bad_message", "bad_request", "bad_image", "bad_control", "malformed", "unknown_keys", "bad_reply")


class StaleRevision(BadRequest):
    """A live ``control_state`` whose revision is not newer than the last one the server folded in."""

    codes = ("stale_revision",)


class PromptBackpressure(ServerError):
    """Too many prompt changes of the session wait for their first chunk; ``retry_after_s`` says when to retry."""

    codes = ("prompt_backpressure",)


class SessionFailed(ServerError):
    """A stage failed for this session; the server closes it and releases its caches."""

    codes = ("failed",)


class ServerGone(ServerError):
    """The server is shutting down or a rank died (codes from the server), or it stopped answering heartbeats or
    restarted (``server_gone``, found by the client itself): every session of it ends."""

    codes = ("shutdown", "rank_failed", "server_gone")


class OutboxFull(ServerError):
    """Found by the client itself: ``max_outbox`` messages already wait to leave its socket (the server does not take
    them: down, unreachable, or slower than the caller). Nothing was sent and nothing queued; send again later (live
    input is never refused: its newest state waits in one slot per session)."""

    codes = ("outbox_full",)


class WatchOnly(ServerError):
    """This client watches the session: it cannot send its controls or close it (only its owner can)."""

    codes = ("watch_only",)


class SessionMigrated(ServerError):
    """Not an end: the session's replica went down and the router restored it on ``replica`` from its latest
    snapshot. Its chunks come again from ``chunk`` on (the same frames, given the same controls); its indexed
    controls go on from ``chunk`` (one below it is refused); live input goes on as it was."""

    codes = ("migrated",)
    chunk: int = 0  # the chunk it resumes from: the next chunk and control index
    replica: str = ""  # the router's name of the replica it runs on now

    @staticmethod
    def of_notice(notice: protocol.Migrated) -> SessionMigrated:
        error = SessionMigrated("migrated", f"session {notice.session} resumed from chunk {notice.chunk} on replica "
                                f"{notice.replica} (its replica went down)", notice.session)
        error.chunk, error.replica = notice.chunk, notice.replica
        return error


class SaveFailed(ServerError):
    """A ``save`` did not complete (a rank could not copy or write its state, or the session ended meanwhile): no
    snapshot; the session streams on."""

    codes = ("save_failed",)


class BadSnapshot(BadRequest):
    """An ``open(restore=...)`` this server cannot do: the message names what differs (model, layout, DiT degree,
    frame size, format) or what is wrong with the files."""

    codes = ("bad_snapshot",)


_ERROR_TYPES: dict[str, type[ServerError]] = {
    code: cls for cls in (Busy, UnknownSession, RejectedControl, ControlBackpressure, BadRequest, StaleRevision,
                          SessionFailed, ServerGone, OutboxFull, PromptBackpressure, WatchOnly, SaveFailed,
                          BadSnapshot) for code in cls.codes
}


class SessionClosed(Exception):
    """The session ended; ``summary`` holds its metrics."""

    def __init__(self, closed: protocol.Closed) -> None:
        super().__init__(f"session {closed.session} closed: {closed.reason}" + (f" ({closed.error})" if closed.error
                                                                                 else ""))
        self.closed = closed


def closed_summary(closed: protocol.Closed) -> SessionSummary:
    """A session's closing summary with its reason and error folded in (what ``wait_closed`` returns); a closed
    without a summary of its own (a watcher's) gives an empty one."""
    summary = closed.summary if isinstance(closed.summary, SessionSummary) else SessionSummary()
    return msgspec.structs.replace(summary, reason=closed.reason, error=closed.error)


# ------------------------------------------------------------------------------------------------ results


@dataclass(frozen=True)
class SessionInfo:
    id: str
    height: int
    width: int
    fps: float
    frames_first_chunk: int
    frames_per_chunk: int
    num_chunks: int | None
    intrinsics: tuple[float, float, float, float] | None = None  # (fx, fy, cx, cy) at this frame size: the camera used
    steps: int = 0  # denoising steps its first chunks run (0: a server before quality presets)
    watch_token: str = ""  # the owner shares it: others ``watch`` the session with it ("" when watching)
    first_chunk: int = 0  # its first chunk and control index (a restored session continues its snapshot's numbering)


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
    if isinstance(opened, protocol.Watching):
        return SessionInfo(opened.session, opened.height, opened.width, opened.fps, opened.frames_first_chunk,
                           opened.frames_per_chunk, opened.num_chunks)
    return SessionInfo(opened.session, opened.height, opened.width, opened.fps, opened.frames_first_chunk,
                       opened.frames_per_chunk, opened.num_chunks, opened.intrinsics, opened.steps,
                       opened.watch_token, opened.first_chunk)


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


class StateSink(Protocol):
    def control_state(self, session: str, state: protocol.InputState, steps: int | None = None) -> None: ...


class LiveInput:
    """A live session's input device: tracks held keys, taps and mouse motion, and sends the whole state as a
    ``control_state`` with a strictly increasing revision whenever it changes (nothing is sent when nothing
    changed). Works with ``Client`` and ``AsyncClient`` (their ``control_state`` is fire-and-forget).

    Each method returns the revision it sent, or ``None`` when it sent nothing."""

    def __init__(self, sink: StateSink, session: str, first_revision: int = 1) -> None:
        if first_revision < 0:
            raise ValueError(f"revisions are >= 0, got first_revision={first_revision}")
        self.sink = sink
        self.session = session
        self.held: frozenset[str] = frozenset()
        self.revision = first_revision - 1  # the last revision sent

    def press(self, *keys: str) -> int | None:
        return self.set(self.held | _norm(keys))

    def release(self, *keys: str) -> int | None:
        return self.set(self.held - _norm(keys))

    def tap(self, *keys: str) -> int | None:
        """Keys pressed and released between two messages: each acts on exactly one chunk."""
        return self.set(self.held, taps=keys)

    def move(self, dx: float, dy: float) -> int | None:
        """Mouse motion (yaw, pitch degrees) since the previous message."""
        return self.set(self.held, mouse=(dx, dy))

    def reset(self) -> int | None:
        """Release everything (e.g. the window lost focus)."""
        return self.set(frozenset())

    def set(self, keys: Iterable[str], taps: Iterable[str] = (), mouse: tuple[float, float] = (0.0, 0.0),
            steps: int | None = None) -> int | None:  # fmt: skip
        """Send the whole state: ``keys`` held now, ``taps`` and ``mouse`` motion since the previous message;
        ``steps``: the session's best quality from the next chunk cut (a state with steps is always sent)."""
        held, tapped = _norm(keys), sorted(_norm(taps))
        mouse = (float(mouse[0]), float(mouse[1]))
        if held == self.held and not tapped and mouse == (0.0, 0.0) and steps is None:
            return None
        revision = self.revision + 1
        extra = {} if steps is None else {"steps": steps}  # a sink without quality presets is sent no steps
        self.sink.control_state(self.session, input_state(held, revision, mouse, tapped), **extra)
        self.held, self.revision = held, revision  # only once sent: a refused send (``OutboxFull``) changes nothing
        return revision


def _norm(keys: Iterable[str]) -> frozenset[str]:
    """``"wd"``, ``["w", "D"]`` -> ``{"w", "d"}``."""
    return frozenset(k.lower() for item in keys for k in item)


def input_state(keys: Iterable[str], revision: int, mouse: tuple[float, float] = (0.0, 0.0),
                taps: Iterable[str] = ()) -> protocol.InputState:
    """A live input state as it travels (``"wd"`` or ``["w", "D"]`` for keys). Its values are checked by the server
    (``protocol.check_input_state``; a refusal arrives through ``error()``), as a page's are by the gateway."""
    return protocol.InputState(keys=sorted(_norm(keys)), mouse=(float(mouse[0]), float(mouse[1])),
                               taps=sorted(_norm(taps)), revision=revision)


def chunk_control(keys: Iterable[str] = (), mouse: tuple[float, float] = (0.0, 0.0),
                  poses: Iterable[Iterable[float]] | None = None, session: str | None = None) -> protocol.ChunkControl:
    """The control of one chunk as it travels (``"wd"`` or ``["w", "D"]`` for keys); ``BadRequest`` (code
    ``bad_control``) when it is not a valid control, before anything is sent."""
    try:
        return protocol.ChunkControl(keys=_norm(keys), mouse=(float(mouse[0]), float(mouse[1])),
                                     poses=None if poses is None else tuple(tuple(map(float, p)) for p in poses))
    except (ValueError, TypeError) as error:
        raise BadRequest("bad_control", str(error), session) from None


def prompt_message(req: int, session: str, prompt: str) -> protocol.SetPrompt:
    """A ``set_prompt`` request (both SDKs); ``BadRequest`` for a prompt the protocol cannot carry."""
    try:
        return protocol.SetPrompt(req=req, session=session, prompt=prompt)
    except (TypeError, ValueError) as error:
        raise BadRequest("bad_request", str(error)) from None


def open_message(req: int, image: bytes, prompt: str = "", seed: int = 0, num_chunks: int | None = None,
                 live: bool = False, pause_when_idle: bool = False, intrinsics: Iterable[float] | None = None,
                 steps: int | None = None, min_steps: int | None = None,
                 restore: str | None = None, indexed: bool = False) -> protocol.Open:  # fmt: skip
    """An ``open`` request; ``BadRequest`` (code ``bad_request``) when its camera intrinsics or its steps (4, 2, 1)
    are not valid, before anything is sent. ``restore``: a snapshot id (``image`` is then not used); ``indexed``:
    restore a live session as one that takes indexed controls."""
    try:
        camera = None if intrinsics is None else tuple(float(v) for v in intrinsics)
        return protocol.Open(req=req, image=image, prompt=prompt, seed=seed, num_chunks=num_chunks, live=live,
                             pause_when_idle=pause_when_idle, intrinsics=camera,  # type: ignore[arg-type]
                             steps=steps, min_steps=min_steps, restore=restore, indexed=indexed)
    except (ValueError, TypeError) as error:
        raise BadRequest("bad_request", str(error)) from None


class Requests:
    """Every request a client sends, built once for ``Client`` and ``AsyncClient``: each with a fresh request id, its
    arguments checked before anything is sent (``BadRequest``). The clients differ only in how they send and wait."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)

    def open(self, image: bytes, prompt: str = "", seed: int = 0, num_chunks: int | None = None, live: bool = False,
             pause_when_idle: bool = False, intrinsics: Iterable[float] | None = None, steps: int | None = None,
             min_steps: int | None = None, restore: str | None = None, indexed: bool = False) -> protocol.Open:
        return open_message(next(self._ids), image, prompt, seed, num_chunks, live, pause_when_idle, intrinsics,
                            steps, min_steps, restore, indexed)

    def save(self, session: str) -> protocol.Save:
        return protocol.Save(req=next(self._ids), session=session)

    def control(self, session: str, index: int, control: protocol.ChunkControl,
                steps: int | None = None) -> protocol.Control:  # fmt: skip
        return protocol.Control(req=next(self._ids), session=session, index=index, control=control, steps=steps)

    def control_state(self, session: str, state: protocol.InputState,
                      steps: int | None = None) -> protocol.ControlState:  # fmt: skip
        return protocol.ControlState(req=next(self._ids), session=session, keys=state.keys, mouse=state.mouse,
                                     taps=state.taps, revision=state.revision, steps=steps)

    def set_prompt(self, session: str, prompt: str) -> protocol.SetPrompt:
        return prompt_message(next(self._ids), session, prompt)

    def close(self, session: str) -> protocol.Close:
        return protocol.Close(req=next(self._ids), session=session)

    def stats(self) -> protocol.Stats:
        return protocol.Stats(req=next(self._ids))

    def watch(self, session: str, token: str) -> protocol.Watch:
        return protocol.Watch(req=next(self._ids), session=session, token=token)

    def unwatch(self, session: str) -> protocol.Unwatch:
        return protocol.Unwatch(req=next(self._ids), session=session)

    def resume(self, session: str) -> protocol.Heartbeat:
        """A heartbeat naming the session: its chunks come to this identity from now on."""
        return protocol.Heartbeat(req=next(self._ids), session=session)


# what each request is answered with (besides an ``error``): a reply of another kind fails the request as
# ``bad_reply`` instead of reaching a caller that reads fields it does not have
REPLIES: dict[type, tuple[type, ...]] = {
    protocol.Open: (protocol.Opened,), protocol.Save: (protocol.Saved,), protocol.Control: (protocol.Accepted,),
    protocol.ControlState: (protocol.Accepted,), protocol.SetPrompt: (protocol.PromptScheduled,),
    protocol.Close: (protocol.Closed,), protocol.Stats: (protocol.StatsReply,), protocol.Watch: (protocol.Watching,),
    protocol.Unwatch: (protocol.Closed,), protocol.Heartbeat: (protocol.HeartbeatAck,),
}


def _tag(kind: type) -> str:
    return str(getattr(getattr(kind, "__struct_config__", None), "tag", kind.__name__))


def outbox_room(waiting: int, limit: int, endpoint: str) -> None:
    """``OutboxFull`` when ``waiting`` messages already wait to leave for ``endpoint`` (``limit`` at the most)."""
    if waiting >= limit:
        raise OutboxFull("outbox_full", f"{waiting} messages already wait to be sent to {endpoint}: the server is "
                         "not taking them (down, unreachable or slower than this client); nothing was sent")


# ------------------------------------------------------------------------------------------------ routing


class EventQueue(Protocol):
    """Where a session's events go: a ``queue.Queue`` (``Client``) or an ``asyncio.Queue`` (``AsyncClient``)."""

    def put_nowait(self, item: Any, /) -> None: ...

    def empty(self) -> bool: ...


class PendingReply(Protocol):
    """A request waiting for its reply: a ``concurrent.futures.Future`` (``Client``) or an ``asyncio.Future``
    (``AsyncClient``)."""

    def done(self) -> bool: ...

    def set_result(self, result: Any, /) -> None: ...

    def set_exception(self, exception: BaseException, /) -> None: ...


Q = TypeVar("Q", bound=EventQueue)
F = TypeVar("F", bound=PendingReply)


@dataclass
class SessionState(Generic[Q]):
    events: Q  # ChunkResult, protocol.Closed or ServerError, in arrival order
    closed: protocol.Closed | None = None
    photon: InputToPhoton = field(default_factory=InputToPhoton)  # touched by the receiving side only
    missed: int = 0  # watching: chunks dropped for this client since the last one it got (``protocol.Missed``)
    migrated: protocol.Migrated | None = None  # a migrated notice not yet followed by a chunk


class ClientCore(Generic[Q, F]):
    """The I/O-free half shared by ``Client`` and ``AsyncClient``: the pending requests, the fire-and-forget
    request ids, the per-session state, and what is done with each message from the server (``route``).

    Chunks and ``closed`` go to their session's event queue (with input-to-photon bookkeeping), heartbeat acks are
    dropped, replies resolve the pending request with their ``req``. An error goes to its pending request; else,
    when it names a session and was not caused by a fire-and-forget request, it also ends that session's stream;
    it always reaches ``put_error`` then. The clients differ only in the queue type (``new_events``), the future
    type they register with ``expect``, and ``put_error``. One lock guards the state, so the blocking client's
    callers and its I/O thread may share a core (the asyncio client uses it from its loop only)."""

    def __init__(self, new_events: Callable[[], Q], put_error: Callable[[ServerError], None],
                 clock: Callable[[], float] = time.monotonic,
                 close_orphan: Callable[[str], None] | None = None) -> None:
        self._new_events = new_events
        self._put_error = put_error
        self._close_orphan = close_orphan  # sends ``close`` for a session opened after its caller stopped waiting
        self._clock = clock
        self._heard = clock()  # the last message from the server (any kind; heartbeat acks at least once a beat)
        self._server_id = ""  # from heartbeat acks: a different one means the server restarted
        self._gone = False
        self._lock = threading.Lock()
        self._pending: dict[int, F] = {}
        self._replies: dict[int, tuple[type, ...]] = {}  # req -> the kinds of reply its request takes
        self._quiet: OrderedDict[int, None] = OrderedDict()  # fire-and-forget reqs (bounded)
        self._sessions: dict[str, SessionState[Q]] = {}
        self._strays = Strays()  # the sessions only the server named (bounded: ``ipc.client_bounds``)
        self._reader = PeerReader("server", max_bytes=1 << 31)  # read by ``route`` only (the I/O side)

    def session(self, session: str) -> SessionState[Q]:
        """The state of a session the caller asks for (made when new; the caller's from now on)."""
        with self._lock:
            self._strays.adopt(session)
            state = self._sessions.get(session)
            if state is None:
                state = self._sessions[session] = SessionState(self._new_events())
            return state

    def _named(self, session: str) -> SessionState[Q]:
        """The state of a session a server message names: a new one is a stray, the oldest past the bound
        dropped."""
        with self._lock:
            state = self._sessions.get(session)
            if state is None:
                state = self._sessions[session] = SessionState(self._new_events())
                if (given_up := self._strays.add(session)) is not None:
                    del self._sessions[given_up]
            return state

    def expect(self, req: int, future: F, request: type | None = None) -> F:
        """Register ``future`` to be resolved by the reply (or error) with request id ``req``; a reply of another
        kind than a ``request`` is answered with (``REPLIES``) fails it as ``bad_reply``."""
        with self._lock:
            self._pending[req] = future
            if request is not None:
                self._replies[req] = REPLIES.get(request, ())
        return future

    def forget(self, req: int) -> None:
        with self._lock:
            self._pending.pop(req, None)
            self._replies.pop(req, None)

    def quiet(self, req: int) -> None:
        """``req`` is fire-and-forget: its error goes to ``put_error`` only and does not end a chunk stream."""
        with self._lock:
            self._quiet[req] = None
            while len(self._quiet) > KEEP_QUIET_REQS:
                self._quiet.popitem(last=False)

    def sent(self, stamp: tuple[str, int] | None) -> None:
        """A message left the socket; a live ``stamp`` (session, revision) starts that revision's
        input-to-photon clock."""
        if stamp is not None:
            self.session(stamp[0]).photon.sent(stamp[1], self._clock())

    @property
    def silent(self) -> bool:
        """The server is silent past the limit now (``ServerGone`` was raised and nothing came since)."""
        return self._gone

    def check_server(self, silent_after_s: float) -> None:
        """Called by the I/O loop: a server silent for ``silent_after_s`` (no heartbeat ack, nothing) is gone."""
        silent = self._clock() - self._heard
        if not self._gone and silent > silent_after_s:
            self._server_gone(f"no reply from the server for {silent:.1f} s: it is down or unreachable")

    def _server_gone(self, why: str, fail_requests: bool = True) -> None:
        """Every open session's stream ends with ``ServerGone``, and every waiting request fails unless
        ``fail_requests`` is False (after a restart: those reached the new server, which will answer them)."""
        self._gone = True
        error = ServerGone("server_gone", why)
        with self._lock:
            pending = list(self._pending.values()) if fail_requests else []
            if fail_requests:
                self._pending, self._replies = {}, {}
            open_sessions = [s for s in self._sessions.values() if s.closed is None]
        for future in pending:
            if not future.done():
                future.set_exception(error)
        for state in open_sessions:
            state.events.put_nowait(error)
        self._put_error(error)

    def route(self, data: bytes) -> None:
        """One message from the server. Whatever it holds, the I/O thread that calls this lives on: a message this
        client cannot act on is a ``bad_reply`` error, never the end of every later call."""
        try:
            self._route(data)
        except Exception as error:
            log.exception("a reply from the server could not be handled")
            self._put_error(ServerError.of("bad_reply", f"a reply could not be handled ({type(error).__name__})"))

    def _route(self, data: bytes) -> None:
        self._heard = self._clock()
        self._gone = False  # answering again (a restart is told apart by its id below)
        try:
            message = self._reader.decode(data)  # a newer server's additions are skipped (at no extra cost)
        except protocol.ProtocolViolation as error:
            self._put_error(ServerError.of("bad_reply", str(error)))
            return
        if isinstance(message, tolerant.Unknown):
            return
        if len(getattr(message, "session", None) or "") > MAX_SESSION_ID_CHARS:  # names no session of ours
            self._put_error(ServerError.of("bad_reply", f"a {type(message).__name__} names a session id of "
                                           f"{len(message.session)} characters"))
            return
        if isinstance(message, protocol.HeartbeatAck) and message.server:
            if self._server_id and message.server != self._server_id:
                self._server_gone("the server restarted: the sessions of its previous run are gone",
                                  fail_requests=False)
                self._gone = False
            self._server_id = message.server
        if isinstance(message, protocol.Chunk):
            received = self._clock()
            state = self._named(message.session)
            facts = message.facts
            photon = state.photon.shown(facts.control.revision, received)
            frames = np.frombuffer(message.frames, dtype=np.uint8).reshape(message.shape)
            missed, state.missed = state.missed, 0
            migrated, state.migrated = state.migrated, None
            state.events.put_nowait(ChunkResult(message.session, facts.index, frames, facts.control, facts,
                                                received, photon, missed, migrated))
            return
        if isinstance(message, protocol.Migrated):  # the session goes on: its stream says where from
            state = self._named(message.session)
            state.migrated = message
            state.events.put_nowait(SessionMigrated.of_notice(message))
            return
        if isinstance(message, protocol.Missed):
            self._named(message.session).missed += message.chunks
            return
        if isinstance(message, protocol.Closed):
            state = self._named(message.session)
            state.closed = message
            state.events.put_nowait(message)
            return
        if isinstance(message, protocol.HeartbeatAck) and message.req == 0:
            return
        req = getattr(message, "req", None)
        with self._lock:
            future = self._pending.pop(req, None) if req is not None else None
            replies = self._replies.pop(req, ()) if req is not None else ()
            quiet = req in self._quiet
            self._quiet.pop(req, None)
        if future is not None and future.done():  # an asyncio request that timed out or was cancelled meanwhile
            future = None
        if isinstance(message, protocol.Error):
            error = ServerError.from_wire(message)
            if future is not None:
                future.set_exception(error)
            elif message.session is not None and not quiet:
                # the session's own failure (or the server's end): it ends the session's chunk stream
                self._named(message.session).events.put_nowait(error)
                self._put_error(error)
            else:
                self._put_error(error)
            return
        if future is not None and replies and not isinstance(message, replies):
            future.set_exception(ServerError.of("bad_reply", f"a {_tag(type(message))!r} answered request {req}, "
                                                f"which takes {' or '.join(repr(_tag(r)) for r in replies)}"))
        elif future is not None:
            if isinstance(message, protocol.Opened):  # its chunks follow at once: the caller's before it reads
                self.session(message.session)
            future.set_result(message)
        elif isinstance(message, protocol.Opened) and self._close_orphan is not None:
            self._close_orphan(message.session)  # its open timed out or failed here: close it, never leak it


# ------------------------------------------------------------------------------------------------ client


class Client:
    """A blocking client; see the module docstring. ``identity`` is the ZeroMQ routing identity: a client that
    reconnects with the identity that opened a session may ``resume`` it while the server still holds it."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:5555", identity: bytes | None = None,
                 timeout_s: float = 60.0, heartbeat_s: float = 1.0, server_silent_s: float = 5.0,
                 max_outbox: int = MAX_OUTBOX, max_in_flight: int = MAX_IN_FLIGHT) -> None:  # fmt: skip
        self.endpoint = endpoint
        self.identity = identity or f"client-{uuid.uuid4().hex[:10]}".encode()
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.server_silent_s = server_silent_s  # no reply this long (heartbeats included): ``ServerGone``
        self.max_outbox = max_outbox  # messages of callers waiting to leave the socket: more raise ``OutboxFull``
        self._requests = Requests()
        self._errors: queue.Queue[ServerError] = queue.Queue(maxsize=256)  # errors tied to no waiting request
        self._core: ClientCore[queue.Queue[Any], Future[Any]] = ClientCore(
            queue.Queue, self._put_error, close_orphan=self._close_orphan)
        # callers' messages beyond max_outbox are refused (not its own); live states: one slot a session (ipc.outgoing)
        self._outbox = Outgoing(max_outbox, lambda waiting: outbox_room(waiting, max_outbox, endpoint))
        self._in_flight = InFlight(max_in_flight)  # many threads of this client cannot overrun the server
        self._stop = threading.Event()
        self._context = zmq.Context.instance()
        # Any thread wakes the I/O thread through a pipe (os.write is thread-safe; a ZeroMQ socket is not).
        self._wake_rx, self._wake_tx = os.pipe()
        os.set_blocking(self._wake_rx, False)
        os.set_blocking(self._wake_tx, False)
        self._wake_lock = threading.Lock()  # the pipe closes once, never under a writer
        self._thread = threading.Thread(target=self._io, name="worldstream-client", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------ requests

    def open(self, image: bytes = b"", prompt: str = "", seed: int = 0, num_chunks: int | None = None,
             live: bool = False, pause_when_idle: bool = False,
             intrinsics: tuple[float, float, float, float] | None = None, steps: int | None = None,
             min_steps: int | None = None, restore: str | None = None, indexed: bool = False) -> SessionInfo:
        """Open a session and wait until its caches are ready. Raises ``Busy`` (with ``retry_after_s``) when the
        server is at its session limit, ``BadRequest`` for a bad image or a length beyond the server's limit.
        ``intrinsics``: the camera ``(fx, fy, cx, cy)`` in pixels of a 480x832 frame, scaled to the session's frame
        size (None: the server's ``controls.intrinsics``); bad values raise ``BadRequest`` before anything is sent.
        ``SessionInfo.intrinsics`` says what applies, at the session's frame size. ``steps``: denoising steps per
        chunk (4, 2, 1; None: 4), the best quality the server's degrade ladder may lower down to ``min_steps``.
        ``restore``: a snapshot id (``save``): the session continues the saved one from its chunk
        (``SessionInfo.first_chunk``) with its seed, prompt, frame size and camera; opening one snapshot twice
        forks it. A snapshot this server cannot restore raises ``ServerError`` code ``bad_snapshot``. ``indexed``:
        a saved live session restored takes indexed controls (``control``) instead (an exact replay)."""
        message = self._requests.open(image, prompt, seed, num_chunks, live, pause_when_idle, intrinsics, steps,
                                      min_steps, restore, indexed)
        return session_info(self._wait(self._ask(message), self.timeout_s))

    def save(self, session: str, timeout_s: float | None = None) -> Snapshot:
        """Save the session at its next chunk boundary (its owner only); returns once every rank's file is written.
        The stream goes on meanwhile (it pauses only while the ranks copy their state: ``Snapshot.pause_s``)."""
        saved = self._wait(self._ask(self._requests.save(session)), timeout_s or self.timeout_s)
        return snapshot_of(saved)

    def control(self, session: str, index: int, keys: Iterable[str] = (), mouse: tuple[float, float] = (0.0, 0.0),
                poses: list[list[float]] | None = None, wait: bool = True, steps: int | None = None) -> None:
        """Send control[index]; with ``wait`` block until the server accepted it (or raise its error).

        A control that meets a full edge (code ``control_backpressure``) is resent after the server's hint until
        it is accepted or the client's timeout passes: a scripted client may send as fast as it likes. Without
        ``wait`` an error arrives through ``error()``. An invalid control (unknown keys, a mouse turn beyond a full
        turn, poses that are not 4x4) raises ``BadRequest`` before anything is sent. ``steps``: the session's best
        quality from this chunk on (4, 2, 1; None: unchanged)."""
        control = chunk_control(keys, mouse, poses, session)
        if protocol.steps_problem(steps) is not None:
            raise BadRequest("bad_control", str(protocol.steps_problem(steps)), session)
        deadline = time.monotonic() + self.timeout_s
        while True:
            message = self._requests.control(session, index, control, steps)
            if not wait:
                self._send_quiet(message)
                return
            try:
                self._wait(self._ask(message), max(0.0, deadline - time.monotonic()))
                return
            except ControlBackpressure as error:
                if time.monotonic() > deadline:
                    raise
                time.sleep(error.retry_after_s or 0.002)

    def control_state(self, session: str, state: protocol.InputState, steps: int | None = None) -> None:
        """Live mode: the whole held-key state (``input_state(keys, revision, ...)``), sent whenever input changes
        (fire and forget: a rejection, e.g. ``StaleRevision``, arrives through ``error()`` and does not interrupt the
        chunk stream). The moment it leaves the socket starts the input-to-photon clock of its revision. Never
        refused: a state not sent yet is replaced by this newer one (live input is a state, not a queue)."""
        message = self._requests.control_state(session, state, steps)
        self._core.quiet(message.req)
        self._outbox.put_state(session, protocol.encode(message), (session, state.revision))
        self._wake()

    def live(self, session: str, first_revision: int = 1) -> LiveInput:
        """A ``LiveInput`` bound to this client and a live session."""
        return LiveInput(self, session, first_revision)

    def set_prompt(self, session: str, prompt: str) -> protocol.PromptScheduled:
        """A new prompt mid-stream. Returns once the server encoded it: its ``revision`` and the first ``chunk``
        that uses it (each chunk's ``prompt_revision`` says which text it used; a later ``set_prompt`` answered
        with the same chunk supersedes this one). Raises ``BadRequest`` for a prompt beyond the server's
        ``max_prompt_chars``, ``UnknownSession``, ``PromptBackpressure``, or ``ServerError`` (code ``closing``,
        ``prompt_failed``): the session then goes on with its current prompt."""
        return self._wait(self._ask(self._requests.set_prompt(session, prompt)), self.timeout_s)

    def close(self, session: str, timeout_s: float | None = None) -> SessionSummary:
        """Ask the server to close the session; returns its summary once closed (``UnknownSession`` if the
        server no longer holds it)."""
        message = self._requests.close(session)
        try:
            return self.wait_closed(session, timeout_s, refused=self._ask(message))
        finally:
            self._forget(message.req)

    def stats(self) -> ServerStats:
        return self._wait(self._ask(self._requests.stats()), self.timeout_s).stats

    def watch(self, session: str, token: str, timeout_s: float | None = None) -> Watch:
        """Watch another client's session read-only with the token its owner shared (``SessionInfo.watch_token``):
        a ``Watch`` (iterate it for the chunks, from the next one the server emits, until the session or the watch
        ends; ``timeout_s`` bounds the wait for each). ``UnknownSession`` for a wrong token or a session that is
        not running (the same words), ``Busy`` at the server's ``max_watchers``. A watcher's controls and close are
        refused (``WatchOnly``)."""
        state = self._session(session)
        state.closed, state.missed = None, 0  # a session watched again after an unwatch
        reply = self._wait(self._ask(self._requests.watch(session, token)), self.timeout_s)
        return Watch(session_info(reply), self.chunks(session, timeout_s))

    def unwatch(self, session: str, timeout_s: float | None = None) -> SessionSummary:
        """Stop watching; returns once the stream ended (its ``closed``, reason "unwatched")."""
        message = self._requests.unwatch(session)
        self._session(session).closed = None  # the closed that ends this watch, not an earlier one
        try:
            return self.wait_closed(session, timeout_s, refused=self._ask(message))
        finally:
            self._forget(message.req)

    def resume(self, session: str) -> None:
        """Re-attach to a session this client identity owns (after a reconnect): its chunks come here from now
        on. Raises ``UnknownSession`` when the server no longer holds it (closed, or its client timed out)."""
        self._session(session)
        self._wait(self._ask(self._requests.resume(session)), self.timeout_s)

    def send_raw(self, data: bytes) -> None:
        """Send bytes as they are (for protocol tests)."""
        self._put(data)

    # ------------------------------------------------------------------------------------------ receiving

    def next_chunk(self, session: str, timeout_s: float | None = None) -> ChunkResult:
        """The session's next chunk. Raises ``SessionClosed`` at its end, ``ServerError`` on its errors,
        ``SessionMigrated`` (once per move; the session goes on) when a router restored it on another replica."""
        state = self._session(session)
        if state.closed is not None and state.events.empty():
            raise SessionClosed(state.closed)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            event = state.events.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no chunk of session {session} within {timeout:.1f} s") from None
        if isinstance(event, ChunkResult):
            return event
        if isinstance(event, protocol.Closed):
            raise SessionClosed(event)
        raise event

    def chunks(self, session: str, timeout_s: float | None = None,
               on_migrated: Callable[[SessionMigrated], None] | None = None) -> Iterator[ChunkResult]:
        """Chunks until the session closes (errors of the session raise). A migration is no error: the chunks go
        on from its resume chunk (indices come again) after ``on_migrated`` ran (an indexed session sends its
        controls again from ``SessionMigrated.chunk`` there)."""
        while True:
            try:
                yield self.next_chunk(session, timeout_s)
            except SessionMigrated as moved:
                if on_migrated is not None:
                    on_migrated(moved)
            except SessionClosed:
                return

    def wait_closed(self, session: str, timeout_s: float | None = None,
                    refused: Future[Any] | None = None) -> SessionSummary:
        """Discard chunks until the session's ``closed`` arrives; returns its summary. ``refused``: a request
        whose error (e.g. the close was refused) ends the wait by raising it."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            error = refused.exception() if refused is not None and refused.done() else None
            if error is not None and getattr(error, "code", None) != "closing":  # closing: the closed follows
                raise error
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"session {session} not closed within {timeout_s or self.timeout_s:.1f} s")
            try:
                self.next_chunk(session, min(remaining, 0.05))
            except SessionClosed as closed:
                return closed_summary(closed.closed)
            except ServerGone as gone:
                if gone.code == "server_gone":  # found by this client: no closed will come
                    raise
            except TimeoutError:
                if self._core.silent:  # nothing queued, and the server no longer answers
                    raise ServerGone("server_gone", f"no reply from the server: session {session} cannot be "
                                     "closed") from None
            except ServerError:
                continue

    def error(self, timeout_s: float = 0.0) -> ServerError | None:
        """The next error no caller waits for: a rejected ``control_state`` or unwaited control, a session's
        failure, a rank failure or shutdown. ``None`` when there is none (within ``timeout_s``)."""
        try:
            return self._errors.get(timeout=timeout_s) if timeout_s > 0 else self._errors.get_nowait()
        except queue.Empty:
            return None

    # ------------------------------------------------------------------------------------------ plumbing

    def _ask(self, message: Any) -> Future[Any]:
        """Send a request once fewer than ``max_in_flight`` wait: the future its reply resolves (its slot frees)."""
        req = message.req
        self._in_flight.enter(req, self.timeout_s)
        future: Future[Any] = self._core.expect(req, Future(), type(message))
        future.add_done_callback(lambda _: self._in_flight.leave(req))
        try:
            self._put(protocol.encode(message))
        except OutboxFull:
            self._forget(req)
            raise
        return future

    def _forget(self, req: int) -> None:
        self._core.forget(req)
        self._in_flight.leave(req)

    def _wait(self, future: Future[Any], timeout_s: float) -> Any:
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            future.cancel()  # a late reply finds no one waiting (a late ``opened`` is closed, not leaked)
            raise TimeoutError(f"no reply from {self.endpoint} within {timeout_s:.1f} s") from None

    def _session(self, session: str) -> SessionState[queue.Queue[Any]]:
        return self._core.session(session)

    def _put(self, data: bytes, stamp: tuple[str, int] | None = None, own: bool = False) -> None:
        """Queue a message for the I/O thread; a caller's (not ``own``) is refused beyond ``max_outbox``."""
        self._outbox.put(data, stamp, own)
        self._wake()

    def _send_quiet(self, message: Any, stamp: tuple[str, int] | None = None, own: bool = False) -> None:
        """Send a fire-and-forget request: its error goes to ``error()``, never to a chunk stream."""
        self._core.quiet(message.req)
        self._put(protocol.encode(message), stamp, own)

    def _close_orphan(self, session: str) -> None:
        self._send_quiet(self._requests.close(session), own=True)  # from the I/O thread: never refused

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_tx >= 0:
                with contextlib.suppress(BlockingIOError):  # a full pipe already holds a wake-up
                    os.write(self._wake_tx, b"\0")

    def _io(self) -> None:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        next_beat = time.monotonic()
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(50))
                if self._wake_rx in events:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self._wake_rx, 4096):
                            pass
                self._flush(sock)
                if self.heartbeat_s > 0 and time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + self.heartbeat_s
                    with contextlib.suppress(zmq.Again):  # a full socket: the server hears the queued ones first
                        sock.send(protocol.encode(protocol.Heartbeat()), zmq.NOBLOCK)
                while sock.poll(0):
                    self._core.route(sock.recv())
                if self.heartbeat_s > 0:
                    self._core.check_server(self.server_silent_s)
        finally:
            sock.close()

    def _flush(self, sock: zmq.Socket) -> None:
        """Send what is queued, in order, until the socket's own queue is full (no server, or one that does not
        read): the rest waits in the outbox, and the loop keeps receiving and watching the server meanwhile."""
        while (item := self._outbox.peek()) is not None:
            try:
                sock.send(item[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            self._outbox.sent(item)
            self._core.sent(item[1])  # the input-to-photon clock of a live revision starts as it leaves

    def _put_error(self, error: ServerError) -> None:
        with contextlib.suppress(queue.Full):  # an unread error queue must not grow without bound
            self._errors.put_nowait(error)

    def close_client(self) -> None:
        """Stop the I/O thread and close the socket (no more heartbeats: the server closes this client's sessions
        after its client timeout unless a client with the same identity resumes them)."""
        self._stop.set()
        self._thread.join(timeout=2.0)
        with self._wake_lock:
            if self._wake_tx >= 0:
                os.close(self._wake_tx)
                os.close(self._wake_rx)
                self._wake_tx = self._wake_rx = -1

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_client()
