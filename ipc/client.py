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

A server that drains (a stop signal, ``drain``) without a router ends each session with ``SessionDraining`` from
``next_chunk`` and ``chunks`` (its ``snapshot`` and ``chunk``: open it elsewhere with ``open(restore=snapshot)``;
``Client.draining(id)`` keeps the notice); through a router the session moves by itself (``SessionMigrated``).

The SDK's modules: ``ipc.client_errors`` (``ServerError`` and its subclasses), ``ipc.client_results`` (what calls
return), ``ipc.client_requests`` (the requests, checked once, and ``LiveInput``), ``ipc.client_core`` (the sans-io
``ClientCore``: routing and every call's decisions as plans), and the two transports that perform the plans'
steps, this module's ``Client`` and ``ipc.aio_client.AsyncClient``. Every name is importable from here.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, Unpack

import zmq

from ipc import protocol
from ipc.client_core import (
    KEEP_QUIET_REQS,
    MAX_OUTBOX,
    Ask,
    ClientCore,
    ClientSettings,
    EventQueue,
    NextEvent,
    Pause,
    PendingReply,
    Plan,
    Running,
    SessionState,
    Start,
    Step,
    T,
    Tell,
)
from ipc.client_errors import (
    BadRequest,
    BadSnapshot,
    Busy,
    ControlBackpressure,
    OutboxFull,
    PromptBackpressure,
    RejectedControl,
    SaveFailed,
    ServerError,
    ServerGone,
    SessionClosed,
    SessionDraining,
    SessionFailed,
    SessionMigrated,
    StaleRevision,
    UnknownSession,
    WatchOnly,
    closed_summary,
    outbox_room,
)
from ipc.client_requests import (
    REPLIES,
    ControlFields,
    LiveInput,
    Requests,
    StateSink,
    chunk_control,
    input_state,
    open_message,
    prompt_message,
)
from ipc.client_results import (
    KEEP_REVISIONS,
    ChunkResult,
    InputToPhoton,
    SessionInfo,
    Snapshot,
    Watch,
    session_info,
    snapshot_of,
)
from ipc.metrics_types import ServerStats, SessionSummary
from ipc.outgoing import MAX_IN_FLIGHT, InFlight

# the SDK's names, wherever they live now (``from ipc.client import X`` reads them all, as before the split)
__all__ = [
    "KEEP_QUIET_REQS", "KEEP_REVISIONS", "MAX_OUTBOX", "REPLIES", "BadRequest", "BadSnapshot", "Busy",
    "ChunkResult", "Client", "ClientCore", "ControlBackpressure", "ControlFields", "EventQueue", "InputToPhoton",
    "LiveInput",
    "OutboxFull", "PendingReply", "PromptBackpressure", "RejectedControl", "Requests", "SaveFailed",
    "ServerError", "ServerGone", "SessionClosed", "SessionDraining", "SessionFailed", "SessionInfo", "SessionMigrated",
    "SessionState", "Snapshot", "StaleRevision", "StateSink", "UnknownSession", "Watch", "WatchOnly",
    "chunk_control", "closed_summary", "input_state", "open_message", "outbox_room", "prompt_message",
    "session_info", "snapshot_of",
]


class Client(ClientSettings):
    """A blocking client; see the module docstring. ``identity`` is the ZeroMQ routing identity: a client that
    reconnects with the identity that opened a session may ``resume`` it while the server still holds it. ``token``
    (or ``token_file``; else $WORLDSTREAM_TOKEN or $WORLDSTREAM_TOKEN_FILE): the client token a server or router
    beyond loopback requires; every request carries it (without one, a request is refused ``unauthorized``)."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:5555", identity: bytes | None = None,
                 timeout_s: float = 60.0, heartbeat_s: float = 1.0, server_silent_s: float = 5.0,
                 max_outbox: int = MAX_OUTBOX, max_in_flight: int = MAX_IN_FLIGHT, token: str | None = None,
                 token_file: str | None = None) -> None:  # fmt: skip
        super().__init__(endpoint, identity, timeout_s, heartbeat_s, server_silent_s, max_outbox, "client", token,
                         token_file)
        self._errors: queue.Queue[ServerError] = queue.Queue(maxsize=256)  # errors tied to no waiting request
        self._core: ClientCore[queue.Queue[Any], Future[Any]] = ClientCore(
            queue.Queue, self._put_error, close_orphan=self._close_orphan, token=self.token)
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
        message = self._core.requests.open(image, prompt, seed, num_chunks, live, pause_when_idle, intrinsics, steps,
                                      min_steps, restore, indexed)
        return session_info(self._wait(self._ask(message), self.timeout_s))

    def save(self, session: str, timeout_s: float | None = None) -> Snapshot:
        """Save the session at its next chunk boundary (its owner only); returns once every rank's file is written.
        The stream goes on meanwhile (it pauses only while the ranks copy their state: ``Snapshot.pause_s``)."""
        saved = self._wait(self._ask(self._core.requests.save(session)), timeout_s or self.timeout_s)
        return snapshot_of(saved)

    def control(self, session: str, index: int, control: protocol.ChunkControl | None = None, *, wait: bool = True,
                steps: int | None = None, **fields: Unpack[ControlFields]) -> None:
        """Send control[index], a ``ChunkControl`` or its keyword form (``keys="w", mouse=(2, 0), poses=...``); with
        ``wait`` block until the server accepted it (or raise its error).

        A control that meets a full edge (code ``control_backpressure``) is resent after the server's hint until
        it is accepted or the client's timeout passes: a scripted client may send as fast as it likes. Without
        ``wait`` an error arrives through ``error()``. An invalid control (unknown keys, a mouse turn beyond a full
        turn, poses that are not 4x4) raises ``BadRequest`` before anything is sent. ``steps``: the session's best
        quality from this chunk on (4, 2, 1; None: unchanged)."""
        self._run(self._core.control(session, index, chunk_control(control, session, **fields), wait, steps,
                                     self.timeout_s))

    def control_state(self, session: str, state: protocol.InputState, steps: int | None = None) -> None:
        """Live mode: the whole held-key state (``input_state(keys, revision, ...)``), sent whenever input changes
        (fire and forget: a rejection, e.g. ``StaleRevision``, arrives through ``error()`` and does not interrupt the
        chunk stream). The moment it leaves the socket starts the input-to-photon clock of its revision. Never
        refused: a state not sent yet is replaced by this newer one (live input is a state, not a queue)."""
        self._outbox.put_state(session, *self._core.live_state(session, state, steps))
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
        return self._wait(self._ask(self._core.requests.set_prompt(session, prompt)), self.timeout_s)

    def close(self, session: str, timeout_s: float | None = None) -> SessionSummary:
        """Ask the server to close the session; returns its summary once closed (``UnknownSession`` if the
        server no longer holds it)."""
        return self._run(self._core.until_closed(self._core.requests.close(session), self._timeout(timeout_s)))

    def stats(self) -> ServerStats:
        return self._wait(self._ask(self._core.requests.stats()), self.timeout_s).stats

    def draining(self, session: str) -> protocol.Draining | None:
        """The ``draining`` notice the session got (its snapshot and chunk), or None."""
        return self._core.session(session).draining

    def drain(self, operator_token: str) -> protocol.Draining:
        """An operator's: drain the server as a SIGTERM does (docs/operations.md, "Drain"), with the server's
        operator token (``server.operator_token_file``; without it ``unauthorized``); its reply says how many sessions
        it hands off and the seconds left before it stops."""
        return self._wait(self._ask(self._core.requests.drain(operator_token)), self.timeout_s)

    def watch(self, session: str, token: str, timeout_s: float | None = None) -> Watch:
        """Watch another client's session read-only with the token its owner shared (``SessionInfo.watch_token``):
        a ``Watch`` (iterate it for the chunks, from the next one the server emits, until the session or the watch
        ends; ``timeout_s`` bounds the wait for each). ``UnknownSession`` for a wrong token or a session that is
        not running (the same words), ``Busy`` at the server's ``max_watchers``. A watcher's controls and close are
        refused (``WatchOnly``)."""
        return Watch(self._run(self._core.watch(session, token, self.timeout_s)), self.chunks(session, timeout_s))

    def unwatch(self, session: str, timeout_s: float | None = None) -> SessionSummary:
        """Stop watching; returns once the stream ended (its ``closed``, reason "unwatched")."""
        return self._run(self._core.until_closed(self._core.requests.unwatch(session), self._timeout(timeout_s)))

    def resume(self, session: str) -> None:
        """Re-attach to a session this client identity owns (after a reconnect): its chunks come here from now
        on. Raises ``UnknownSession`` when the server no longer holds it (closed, or its client timed out)."""
        self._core.session(session)  # its chunks that come before the reply find their queue
        self._wait(self._ask(self._core.requests.resume(session)), self.timeout_s)

    def send_raw(self, data: bytes) -> None:
        """Send bytes as they are (for protocol tests)."""
        self._put(data)

    # ------------------------------------------------------------------------------------------ receiving

    def next_chunk(self, session: str, timeout_s: float | None = None) -> ChunkResult:
        """The session's next chunk. Raises ``SessionClosed`` at its end, ``ServerError`` on its errors,
        ``SessionMigrated`` (once per move; the session goes on) when a router restored it on another replica."""
        return self._run(self._core.next_chunk(session, self._timeout(timeout_s)))

    def chunks(self, session: str, timeout_s: float | None = None,
               on_migrated: Callable[[SessionMigrated], None] | None = None) -> Iterator[ChunkResult]:
        """Chunks until the session closes (errors of the session raise). A migration is no error: the chunks go
        on from its resume chunk (indices come again) after ``on_migrated`` ran (an indexed session sends its
        controls again from ``SessionMigrated.chunk`` there)."""
        while (item := self._run(self._core.streamed(session, self._timeout(timeout_s)))) is not None:
            if isinstance(item, ChunkResult):
                yield item
            elif on_migrated is not None:
                on_migrated(item)

    def wait_closed(self, session: str, timeout_s: float | None = None,
                    refused: Future[Any] | None = None) -> SessionSummary:
        """Discard chunks until the session's ``closed`` arrives; returns its summary. ``refused``: a request
        whose error (e.g. the close was refused) ends the wait by raising it."""
        return self._run(self._core.wait_closed(session, self._timeout(timeout_s), refused))

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
            self._put(self._core.encode(message))
        except OutboxFull:
            self._forget(req)
            raise
        return future

    def _forget(self, req: int) -> None:
        self._core.forget(req)
        self._in_flight.leave(req)

    def _run(self, plan: Plan[T]) -> T:
        """Run a plan of the core (the decisions are its), blocking on each step it asks for."""
        with contextlib.closing(plan):
            running = Running(plan)
            while not running.done:
                running.answer(*self._perform(running.step))
            return running.result

    def _perform(self, step: Step) -> tuple[Any, BaseException | None]:
        """Perform one step: its outcome, or the error performing it raised (the plan decides what it means)."""
        try:
            if isinstance(step, Ask):
                return self._wait(self._ask(step.message), step.timeout_s), None
            if isinstance(step, Start):
                return self._ask(step.message), None
            if isinstance(step, Tell):
                return self._send_quiet(step.message), None
            if isinstance(step, Pause):
                return time.sleep(step.seconds), None
            assert isinstance(step, NextEvent)
            try:
                return self._core.session(step.session).events.get(timeout=step.timeout_s), None
            except queue.Empty:
                raise step.late() from None
        except Exception as error:
            return None, error

    def _wait(self, future: Future[Any], timeout_s: float) -> Any:
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            future.cancel()  # a late reply finds no one waiting (a late ``opened`` is closed, not leaked)
            raise TimeoutError(f"no reply from {self.endpoint} within {timeout_s:.1f} s") from None

    def _put(self, data: bytes, stamp: tuple[str, int] | None = None, own: bool = False) -> None:
        """Queue a message for the I/O thread; a caller's (not ``own``) is refused beyond ``max_outbox``."""
        self._outbox.put(data, stamp, own)
        self._wake()

    def _send_quiet(self, message: Any, own: bool = False) -> None:
        """Send a fire-and-forget request: its error goes to ``error()``, never to a chunk stream."""
        self._put(self._core.tell(message), own=own)

    def _close_orphan(self, session: str) -> None:
        self._send_quiet(self._core.requests.close(session), own=True)  # from the I/O thread: never refused

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
                        sock.send(self._core.encode(protocol.Heartbeat()), zmq.NOBLOCK)
                while sock.poll(0):
                    self._core.route(sock.recv_multipart(copy=False))  # a chunk's frames: a part
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
