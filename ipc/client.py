"""The Python client for worldstream servers (ZeroMQ DEALER + msgpack).

One background thread owns the socket: it sends what the caller queues, sends heartbeats, and routes what
arrives (replies by request id, chunks and session events by session). The caller's methods are thread-safe
and block with deadlines. Every error from the server surfaces as a ``ServerError`` carrying the server's code
and message.

    with Client("tcp://127.0.0.1:5555") as client:
        session = client.open(Path("start.png").read_bytes(), prompt="a forest", num_chunks=8)
        for i in range(8):
            client.control(session.id, i, keys="w")
        for chunk in client.chunks(session.id):
            ...  # chunk.frames: uint8 [n, H, W, 3]
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from ipc import protocol


class ServerError(Exception):
    """The server answered with an error."""

    def __init__(self, code: str, message: str, session: str | None = None, retry_after_s: float | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.session = session
        self.retry_after_s = retry_after_s


class SessionClosed(Exception):
    """The session ended; ``summary`` holds its metrics."""

    def __init__(self, closed: protocol.Closed) -> None:
        super().__init__(f"session {closed.session} closed: {closed.reason}" + (f" ({closed.error})" if closed.error
                                                                                 else ""))
        self.closed = closed


@dataclass(frozen=True)
class SessionInfo:
    id: str
    height: int
    width: int
    fps: float
    frames_first_chunk: int
    frames_per_chunk: int
    num_chunks: int | None


@dataclass(frozen=True)
class ChunkResult:
    session: str
    index: int
    frames: np.ndarray  # uint8 [n, H, W, 3]
    control: dict[str, Any]  # the snapshot the model saw
    facts: dict[str, Any]  # timings and spans on the server's clock
    received: float  # client monotonic clock at arrival


@dataclass
class _Session:
    events: queue.Queue[Any] = field(default_factory=queue.Queue)
    closed: protocol.Closed | None = None


class Client:
    def __init__(self, endpoint: str = "tcp://127.0.0.1:5555", identity: bytes | None = None,
                 timeout_s: float = 60.0, heartbeat_s: float = 1.0) -> None:
        self.endpoint = endpoint
        self.identity = identity or f"client-{uuid.uuid4().hex[:10]}".encode()
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self._req = itertools.count(1)
        self._lock = threading.Lock()
        self._pending: dict[int, Future[Any]] = {}
        self._sessions: dict[str, _Session] = {}
        self._errors: queue.Queue[ServerError] = queue.Queue(maxsize=256)  # errors tied to no request
        self._outbox: queue.Queue[bytes] = queue.Queue()
        self._stop = threading.Event()
        self._context = zmq.Context.instance()
        self._wake_addr = f"inproc://client-wake-{uuid.uuid4().hex}"
        self._wake_rx = self._context.socket(zmq.PULL)
        self._wake_rx.bind(self._wake_addr)
        self._thread = threading.Thread(target=self._io, name="worldstream-client", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------ requests

    def open(self, image: bytes, prompt: str = "", seed: int = 0, num_chunks: int | None = None, live: bool = False,
             pause_when_idle: bool = False) -> SessionInfo:
        req = self._next_req()
        future = self._expect(req)
        self._send(protocol.Open(req=req, image=image, prompt=prompt, seed=seed, num_chunks=num_chunks, live=live,
                                 pause_when_idle=pause_when_idle))
        reply = self._wait(future, self.timeout_s)
        return SessionInfo(reply.session, reply.height, reply.width, reply.fps, reply.frames_first_chunk,
                           reply.frames_per_chunk, reply.num_chunks)

    def control(self, session: str, index: int, keys: Iterable[str] = (), mouse: tuple[float, float] = (0.0, 0.0),
                poses: list[list[float]] | None = None, wait: bool = True) -> None:
        """Send control[index]; with ``wait`` block until the server accepted it (or raise its error).

        A control that meets a full edge (code ``control_backpressure``) is resent after the server's hint until
        it is accepted or the client's timeout passes: a scripted client may send as fast as it likes."""
        message = dict(session=session, index=index, keys=sorted(set(keys)), mouse=(float(mouse[0]), float(mouse[1])),
                       poses=poses)
        deadline = time.monotonic() + self.timeout_s
        while True:
            req = self._next_req()
            future = self._expect(req)
            self._send(protocol.Control(req=req, **message))  # type: ignore[arg-type]
            if not wait:
                return
            try:
                self._wait(future, max(0.0, deadline - time.monotonic()))
                return
            except ServerError as error:
                if error.code != "control_backpressure" or time.monotonic() > deadline:
                    raise
                time.sleep(error.retry_after_s or 0.002)

    def control_state(self, session: str, keys: Iterable[str], revision: int, mouse: tuple[float, float] = (0, 0),
                      taps: Iterable[str] = ()) -> None:
        """Live mode: the whole held-key state, sent whenever input changes (fire and forget)."""
        self._send(protocol.ControlState(req=self._next_req(), session=session, keys=sorted(set(keys)),
                                         mouse=(float(mouse[0]), float(mouse[1])), taps=list(taps), revision=revision))

    def close(self, session: str, timeout_s: float | None = None) -> dict[str, Any]:
        """Ask the server to close the session; returns its summary once closed."""
        self._send(protocol.Close(req=self._next_req(), session=session))
        return self.wait_closed(session, timeout_s)

    def stats(self) -> dict[str, Any]:
        req = self._next_req()
        future = self._expect(req)
        self._send(protocol.Stats(req=req))
        return self._wait(future, self.timeout_s).stats

    def resume(self, session: str) -> None:
        """Re-attach to a session this client identity owns (after a reconnect)."""
        req = self._next_req()
        future = self._expect(req)
        self._session(session)
        self._send(protocol.Heartbeat(req=req, session=session))
        self._wait(future, self.timeout_s)

    def send_raw(self, data: bytes) -> None:
        """Send bytes as they are (for protocol tests)."""
        self._outbox.put(data)
        self._wake()

    # ------------------------------------------------------------------------------------------ receiving

    def next_chunk(self, session: str, timeout_s: float | None = None) -> ChunkResult:
        """The session's next chunk. Raises ``SessionClosed`` at its end, ``ServerError`` on its errors."""
        state = self._session(session)
        if state.closed is not None and state.events.empty():
            raise SessionClosed(state.closed)
        try:
            event = state.events.get(timeout=self.timeout_s if timeout_s is None else timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no chunk of session {session} within {timeout_s or self.timeout_s:.1f} s") from None
        if isinstance(event, ChunkResult):
            return event
        if isinstance(event, protocol.Closed):
            raise SessionClosed(event)
        raise event

    def chunks(self, session: str, timeout_s: float | None = None) -> Iterator[ChunkResult]:
        """Chunks until the session closes (errors of the session raise)."""
        while True:
            try:
                yield self.next_chunk(session, timeout_s)
            except SessionClosed:
                return

    def wait_closed(self, session: str, timeout_s: float | None = None) -> dict[str, Any]:
        """Discard chunks until the session's ``closed`` arrives; returns its summary."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            try:
                self.next_chunk(session, max(0.0, deadline - time.monotonic()))
            except SessionClosed as closed:
                return {**closed.closed.summary, "reason": closed.closed.reason, "error": closed.closed.error}
            except ServerError:
                continue

    def error(self, timeout_s: float = 0.0) -> ServerError | None:
        """The next error that belongs to no request or session (e.g. a rank failed), if any."""
        try:
            return self._errors.get(timeout=timeout_s) if timeout_s > 0 else self._errors.get_nowait()
        except queue.Empty:
            return None

    # ------------------------------------------------------------------------------------------ plumbing

    def _next_req(self) -> int:
        return next(self._req)

    def _expect(self, req: int) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            self._pending[req] = future
        return future

    def _wait(self, future: Future[Any], timeout_s: float) -> Any:
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            raise TimeoutError(f"no reply from {self.endpoint} within {timeout_s:.1f} s") from None

    def _session(self, session: str) -> _Session:
        with self._lock:
            return self._sessions.setdefault(session, _Session())

    def _send(self, message: Any) -> None:
        self._outbox.put(protocol.encode(message))
        self._wake()

    def _wake(self) -> None:
        sock = self._context.socket(zmq.PUSH)
        try:
            sock.connect(self._wake_addr)
            sock.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        finally:
            sock.close(linger=0)

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
                    while self._wake_rx.poll(0):
                        self._wake_rx.recv()
                while True:
                    try:
                        sock.send(self._outbox.get_nowait())
                    except queue.Empty:
                        break
                if self.heartbeat_s > 0 and time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + self.heartbeat_s
                    sock.send(protocol.encode(protocol.Heartbeat()))
                while sock.poll(0):
                    self._route(sock.recv())
        finally:
            sock.close()
            self._wake_rx.close()

    def _route(self, data: bytes) -> None:
        try:
            message = protocol.decode(data, "server", max_bytes=1 << 31)
        except protocol.ProtocolViolation as error:
            self._put_error(ServerError("bad_reply", str(error)))
            return
        if isinstance(message, protocol.Chunk):
            frames = np.frombuffer(message.frames, dtype=np.uint8).reshape(message.shape)
            self._session(message.session).events.put(ChunkResult(
                message.session, message.index, frames, message.control, message.facts, time.monotonic()))
            return
        if isinstance(message, protocol.Closed):
            state = self._session(message.session)
            state.closed = message
            state.events.put(message)
            return
        if isinstance(message, protocol.HeartbeatAck) and message.req == 0:
            return
        req = getattr(message, "req", None)
        with self._lock:
            future = self._pending.pop(req, None) if req is not None else None
        if isinstance(message, protocol.Error):
            error = ServerError(message.code, message.message, message.session, message.retry_after_s)
            if future is not None:
                future.set_exception(error)
            elif message.session is not None:
                self._session(message.session).events.put(error)
                self._put_error(error)
            else:
                self._put_error(error)
            return
        if future is not None:
            future.set_result(message)

    def _put_error(self, error: ServerError) -> None:
        with contextlib.suppress(queue.Full):  # an unread error queue must not grow without bound
            self._errors.put_nowait(error)

    def close_client(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_client()
