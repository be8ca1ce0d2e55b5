"""The asyncio twin of ``ipc.client.Client`` (``zmq.asyncio``), with the same API shape: awaitable requests,
chunks as an async iterator, fire-and-forget live input, typed ``ServerError`` subclasses.

Inside one event loop three tasks share the DEALER socket (pyzmq's asyncio sockets take concurrent send and recv
from tasks of one loop; no other thread touches it): a writer that drains the outbox (requests, live states,
heartbeats every ``heartbeat_s``), a reader that routes replies to their request futures by request id and
chunks and session events to per-session queues, and the heartbeat timer.

    async with AsyncClient(endpoint) as client:
        info = await client.open(image, live=True, num_chunks=32)
        keys = client.live(info.id)
        keys.press("w")
        async for chunk in client.chunks(info.id):
            ...
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from ipc import protocol
from ipc.client import (
    KEEP_QUIET_REQS,
    ChunkResult,
    ControlBackpressure,
    InputToPhoton,
    LiveInput,
    ServerError,
    SessionClosed,
    SessionInfo,
    _norm,
    closed_summary,
    session_info,
)


@dataclass
class _Session:
    events: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    closed: protocol.Closed | None = None
    photon: InputToPhoton = field(default_factory=InputToPhoton)


class AsyncClient:
    """An asyncio client; use it from one event loop (``async with``, or ``await start()`` / ``await aclose()``)."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:5555", identity: bytes | None = None,
                 timeout_s: float = 60.0, heartbeat_s: float = 1.0) -> None:
        self.endpoint = endpoint
        self.identity = identity or f"aclient-{uuid.uuid4().hex[:10]}".encode()
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self._req = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._quiet: OrderedDict[int, None] = OrderedDict()
        self._sessions: dict[str, _Session] = {}
        self._errors: asyncio.Queue[ServerError] = asyncio.Queue(maxsize=256)
        self._outbox: asyncio.Queue[tuple[bytes, tuple[str, int] | None]] = asyncio.Queue()
        self._context = zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> AsyncClient:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        self._sock = sock
        self._tasks = [asyncio.create_task(self._writer()), asyncio.create_task(self._reader())]
        if self.heartbeat_s > 0:
            self._tasks.append(asyncio.create_task(self._heartbeats()))
        return self

    async def aclose(self) -> None:
        """Stop the tasks and close the socket (no more heartbeats; see ``Client.close_client``)."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def __aenter__(self) -> AsyncClient:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------------------------------ requests

    async def open(self, image: bytes, prompt: str = "", seed: int = 0, num_chunks: int | None = None,
                   live: bool = False, pause_when_idle: bool = False) -> SessionInfo:
        req = next(self._req)
        reply = await self._request(req, protocol.Open(req=req, image=image, prompt=prompt, seed=seed,
                                                       num_chunks=num_chunks, live=live,
                                                       pause_when_idle=pause_when_idle))
        return session_info(reply)

    async def control(self, session: str, index: int, keys: Iterable[str] = (),
                      mouse: tuple[float, float] = (0.0, 0.0), poses: list[list[float]] | None = None,
                      wait: bool = True) -> None:
        """Send control[index]; see ``Client.control`` (backpressure is retried until the client timeout)."""
        fields: dict[str, Any] = dict(session=session, index=index, keys=sorted(_norm(keys)),
                                      mouse=(float(mouse[0]), float(mouse[1])), poses=poses)
        deadline = time.monotonic() + self.timeout_s
        while True:
            req = next(self._req)
            if not wait:
                self._send_quiet(req, protocol.Control(req=req, **fields))
                return
            try:
                await self._request(req, protocol.Control(req=req, **fields), max(0.0, deadline - time.monotonic()))
                return
            except ControlBackpressure as error:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(error.retry_after_s or 0.002)

    def control_state(self, session: str, keys: Iterable[str], revision: int, mouse: tuple[float, float] = (0, 0),
                      taps: Iterable[str] = ()) -> None:
        """Live mode, fire and forget (call it from the loop's thread); see ``Client.control_state``."""
        req = next(self._req)
        self._send_quiet(req, protocol.ControlState(
            req=req, session=session, keys=sorted(_norm(keys)), mouse=(float(mouse[0]), float(mouse[1])),
            taps=sorted(_norm(taps)), revision=revision), stamp=(session, revision))

    def live(self, session: str, first_revision: int = 1) -> LiveInput:
        return LiveInput(self, session, first_revision)

    async def close(self, session: str, timeout_s: float | None = None) -> dict[str, Any]:
        """Ask the server to close the session; its summary once closed (``UnknownSession`` if it is not held)."""
        req = next(self._req)
        refused = self._expect(req)
        self._put((protocol.encode(protocol.Close(req=req, session=session)), None))
        waiting = asyncio.ensure_future(self.wait_closed(session, timeout_s))
        try:
            done, _ = await asyncio.wait({waiting, refused}, return_when=asyncio.FIRST_COMPLETED)
            if refused in done and refused.exception() is not None:
                raise refused.exception()  # type: ignore[misc]
            return await waiting
        finally:
            waiting.cancel()
            self._pending.pop(req, None)
            if not refused.done():
                refused.cancel()

    async def stats(self) -> dict[str, Any]:
        req = next(self._req)
        return (await self._request(req, protocol.Stats(req=req))).stats

    async def resume(self, session: str) -> None:
        """Re-attach to a session this identity owns; see ``Client.resume``."""
        req = next(self._req)
        self._session(session)
        await self._request(req, protocol.Heartbeat(req=req, session=session))

    # ------------------------------------------------------------------------------------------ receiving

    async def next_chunk(self, session: str, timeout_s: float | None = None) -> ChunkResult:
        """The session's next chunk. Raises ``SessionClosed`` at its end, ``ServerError`` on its errors."""
        state = self._session(session)
        if state.closed is not None and state.events.empty():
            raise SessionClosed(state.closed)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            event = await asyncio.wait_for(state.events.get(), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no chunk of session {session} within {timeout:.1f} s") from None
        if isinstance(event, ChunkResult):
            return event
        if isinstance(event, protocol.Closed):
            raise SessionClosed(event)
        raise event

    async def chunks(self, session: str, timeout_s: float | None = None) -> AsyncIterator[ChunkResult]:
        """Chunks until the session closes (errors of the session raise)."""
        while True:
            try:
                yield await self.next_chunk(session, timeout_s)
            except SessionClosed:
                return

    async def wait_closed(self, session: str, timeout_s: float | None = None) -> dict[str, Any]:
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"session {session} not closed in time")
            try:
                await self.next_chunk(session, remaining)
            except SessionClosed as closed:
                return closed_summary(closed.closed)
            except ServerError:
                continue

    async def error(self, timeout_s: float = 0.0) -> ServerError | None:
        """The next error no caller waits for (see ``Client.error``), or ``None``."""
        try:
            if timeout_s <= 0:
                return self._errors.get_nowait()
            return await asyncio.wait_for(self._errors.get(), timeout_s)
        except (asyncio.QueueEmpty, asyncio.TimeoutError):
            return None

    # ------------------------------------------------------------------------------------------ plumbing

    def _expect(self, req: int) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[req] = future
        return future

    async def _request(self, req: int, message: Any, timeout_s: float | None = None) -> Any:
        future = self._expect(req)
        self._put((protocol.encode(message), None))
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no reply from {self.endpoint} within {timeout:.1f} s") from None
        finally:
            self._pending.pop(req, None)

    def _send_quiet(self, req: int, message: Any, stamp: tuple[str, int] | None = None) -> None:
        self._quiet[req] = None
        while len(self._quiet) > KEEP_QUIET_REQS:
            self._quiet.popitem(last=False)
        self._put((protocol.encode(message), stamp))

    def _put(self, item: tuple[bytes, tuple[str, int] | None]) -> None:
        if self._sock is None:
            raise RuntimeError("the client is not started (use `async with AsyncClient(...)` or `await start()`)")
        self._outbox.put_nowait(item)

    def _session(self, session: str) -> _Session:
        return self._sessions.setdefault(session, _Session())

    async def _writer(self) -> None:
        assert self._sock is not None
        while True:
            data, stamp = await self._outbox.get()
            await self._sock.send(data)
            if stamp is not None:  # the input-to-photon clock of this revision starts as it leaves
                self._session(stamp[0]).photon.sent(stamp[1], time.monotonic())

    async def _heartbeats(self) -> None:
        beat = protocol.encode(protocol.Heartbeat())
        while True:
            self._outbox.put_nowait((beat, None))
            await asyncio.sleep(self.heartbeat_s)

    async def _reader(self) -> None:
        assert self._sock is not None
        while True:
            self._route(await self._sock.recv())

    def _route(self, data: bytes) -> None:
        try:
            message = protocol.decode(data, "server", max_bytes=1 << 31)
        except protocol.ProtocolViolation as error:
            self._put_error(ServerError.of("bad_reply", str(error)))
            return
        if isinstance(message, protocol.Chunk):
            received = time.monotonic()
            state = self._session(message.session)
            photon = state.photon.shown(int(message.control.get("revision", -1)), received)
            frames = np.frombuffer(message.frames, dtype=np.uint8).reshape(message.shape)
            state.events.put_nowait(ChunkResult(message.session, message.index, frames, message.control,
                                                message.facts, received, photon))
            return
        if isinstance(message, protocol.Closed):
            state = self._session(message.session)
            state.closed = message
            state.events.put_nowait(message)
            return
        if isinstance(message, protocol.HeartbeatAck) and message.req == 0:
            return
        req = getattr(message, "req", None)
        future = self._pending.pop(req, None) if req is not None else None
        quiet = req in self._quiet
        self._quiet.pop(req, None)
        if isinstance(message, protocol.Error):
            error = ServerError.from_wire(message)
            if future is not None and not future.done():
                future.set_exception(error)
            elif message.session is not None and not quiet:
                self._session(message.session).events.put_nowait(error)
                self._put_error(error)
            else:
                self._put_error(error)
            return
        if future is not None and not future.done():
            future.set_result(message)

    def _put_error(self, error: ServerError) -> None:
        with contextlib.suppress(asyncio.QueueFull):
            self._errors.put_nowait(error)
