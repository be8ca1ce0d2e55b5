"""The asyncio twin of ``ipc.client.Client`` (``zmq.asyncio``), with the same API shape: awaitable requests,
chunks as an async iterator, fire-and-forget live input, typed ``ServerError`` subclasses.

Inside one event loop three tasks share the DEALER socket (pyzmq's asyncio sockets take concurrent send and recv
from tasks of one loop; no other thread touches it): a writer that drains the outbox (requests, live states,
heartbeats every ``heartbeat_s``), a reader that hands each message to the ``ClientCore`` it shares with ``Client``
(replies to their request futures by request id, chunks and session events to per-session queues), and the
heartbeat timer.

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
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from ipc import protocol
from ipc.client import (
    MAX_OUTBOX,
    BadRequest,
    ChunkResult,
    ClientCore,
    ControlBackpressure,
    LiveInput,
    OutboxFull,
    Requests,
    ServerError,
    ServerGone,
    SessionClosed,
    SessionInfo,
    SessionMigrated,
    SessionState,
    Snapshot,
    chunk_control,
    closed_summary,
    outbox_room,
    session_info,
    snapshot_of,
)
from ipc.metrics_types import ServerStats, SessionSummary
from ipc.outgoing import MAX_IN_FLIGHT, Outgoing


class AsyncClient:
    """An asyncio client; use it from one event loop (``async with``, or ``await start()`` / ``await aclose()``)."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:5555", identity: bytes | None = None,
                 timeout_s: float = 60.0, heartbeat_s: float = 1.0, server_silent_s: float = 5.0,
                 max_outbox: int = MAX_OUTBOX, max_in_flight: int = MAX_IN_FLIGHT) -> None:  # fmt: skip
        self.endpoint = endpoint
        self.identity = identity or f"aclient-{uuid.uuid4().hex[:10]}".encode()
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.server_silent_s = server_silent_s  # no reply this long (heartbeats included): ``ServerGone``
        self.max_outbox = max_outbox  # messages of callers waiting to leave the socket: more raise ``OutboxFull``
        self._requests = Requests()
        self._errors: asyncio.Queue[ServerError] = asyncio.Queue(maxsize=256)
        self._core: ClientCore[asyncio.Queue[Any], asyncio.Future[Any]] = ClientCore(
            asyncio.Queue, self._put_error, close_orphan=self._close_orphan)
        self._outbox = Outgoing(max_outbox, lambda waiting: outbox_room(waiting, max_outbox, endpoint))
        self._ready = asyncio.Event()  # set when something is queued: wakes the writer
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self._in_flight = asyncio.Semaphore(max_in_flight)  # many tasks of this client cannot overrun the server
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

    async def open(self, image: bytes = b"", prompt: str = "", seed: int = 0, num_chunks: int | None = None,
                   live: bool = False, pause_when_idle: bool = False,
                   intrinsics: tuple[float, float, float, float] | None = None, steps: int | None = None,
                   min_steps: int | None = None, restore: str | None = None,
                   indexed: bool = False) -> SessionInfo:  # fmt: skip
        """Open a session; see ``Client.open`` (``intrinsics``: the camera at 480x832, checked before sending;
        ``steps``/``min_steps``: denoising steps per chunk, 4, 2 or 1; ``restore``: a snapshot id; ``indexed``:
        restore a live session with indexed controls)."""
        message = self._requests.open(image, prompt, seed, num_chunks, live, pause_when_idle, intrinsics, steps,
                                      min_steps, restore, indexed)
        return session_info(await self._request(message))

    async def save(self, session: str) -> Snapshot:
        """Save the session at its next chunk boundary; see ``Client.save``."""
        return snapshot_of(await self._request(self._requests.save(session)))

    async def control(self, session: str, index: int, keys: Iterable[str] = (),
                      mouse: tuple[float, float] = (0.0, 0.0), poses: list[list[float]] | None = None,
                      wait: bool = True, steps: int | None = None) -> None:
        """Send control[index]; see ``Client.control`` (backpressure is retried until the client timeout)."""
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
                await self._request(message, max(0.0, deadline - time.monotonic()))
                return
            except ControlBackpressure as error:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(error.retry_after_s or 0.002)

    def control_state(self, session: str, state: protocol.InputState, steps: int | None = None) -> None:
        """Live mode, fire and forget (call it from the loop's thread); never refused: a state not sent yet is
        replaced by this newer one. See ``Client.control_state``."""
        self._started()
        message = self._requests.control_state(session, state, steps)
        self._core.quiet(message.req)
        self._outbox.put_state(session, protocol.encode(message), (session, state.revision))
        self._ready.set()

    def live(self, session: str, first_revision: int = 1) -> LiveInput:
        return LiveInput(self, session, first_revision)

    async def set_prompt(self, session: str, prompt: str) -> protocol.PromptScheduled:
        """A new prompt mid-stream: its revision and first chunk once encoded; see ``Client.set_prompt``."""
        return await self._request(self._requests.set_prompt(session, prompt))

    async def close(self, session: str, timeout_s: float | None = None) -> SessionSummary:
        """Ask the server to close the session; its summary once closed (``UnknownSession`` if it is not held)."""
        return await self._until_closed(self._requests.close(session), session, timeout_s, "closing")

    async def stats(self) -> ServerStats:
        return (await self._request(self._requests.stats())).stats

    async def watch(self, session: str, token: str, timeout_s: float | None = None) -> AsyncWatch:
        """Watch another client's session read-only; see ``Client.watch`` (``async for`` the returned watch)."""
        state = self._session(session)
        state.closed, state.missed = None, 0  # a session watched again after an unwatch
        reply = await self._request(self._requests.watch(session, token))
        return AsyncWatch(session_info(reply), self.chunks(session, timeout_s))

    async def unwatch(self, session: str, timeout_s: float | None = None) -> SessionSummary:
        """Stop watching; see ``Client.unwatch``."""
        self._session(session).closed = None  # the closed that ends this watch, not an earlier one
        return await self._until_closed(self._requests.unwatch(session), session, timeout_s)

    async def _until_closed(self, message: protocol.Close | protocol.Unwatch, session: str, timeout_s: float | None,
                            fine: str | None = None) -> SessionSummary:  # fmt: skip
        """Send ``message`` and return the session's summary once its ``closed`` comes; an error answering the
        request raises, except code ``fine`` (``closing``: the session was closing already, its closed follows)."""
        refused = self._ask(message)
        waiting = asyncio.ensure_future(self.wait_closed(session, timeout_s))
        try:
            done, _ = await asyncio.wait({waiting, refused}, return_when=asyncio.FIRST_COMPLETED)
            error = refused.exception() if refused in done else None
            if error is not None and (fine is None or getattr(error, "code", None) != fine):
                raise error
            return await waiting
        finally:
            waiting.cancel()
            self._core.forget(message.req)
            if not refused.done():
                refused.cancel()

    async def resume(self, session: str) -> None:
        """Re-attach to a session this identity owns; see ``Client.resume``."""
        self._session(session)
        await self._request(self._requests.resume(session))

    # ------------------------------------------------------------------------------------------ receiving

    async def next_chunk(self, session: str, timeout_s: float | None = None) -> ChunkResult:
        """The session's next chunk. Raises ``SessionClosed`` at its end, ``ServerError`` on its errors,
        ``SessionMigrated`` (once per move; the session goes on) when a router restored it on another replica."""
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

    async def chunks(self, session: str, timeout_s: float | None = None,
                     on_migrated: Callable[[SessionMigrated], Awaitable[None]] | None = None
                     ) -> AsyncIterator[ChunkResult]:
        """Chunks until the session closes (errors of the session raise); a migration is awaited in
        ``on_migrated`` and the chunks go on from its resume chunk (as ``Client.chunks``)."""
        while True:
            try:
                yield await self.next_chunk(session, timeout_s)
            except SessionMigrated as moved:
                if on_migrated is not None:
                    await on_migrated(moved)
            except SessionClosed:
                return

    async def wait_closed(self, session: str, timeout_s: float | None = None) -> SessionSummary:
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"session {session} not closed in time")
            try:
                await self.next_chunk(session, min(remaining, 0.25))
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

    async def error(self, timeout_s: float = 0.0) -> ServerError | None:
        """The next error no caller waits for (see ``Client.error``), or ``None``."""
        try:
            if timeout_s <= 0:
                return self._errors.get_nowait()
            return await asyncio.wait_for(self._errors.get(), timeout_s)
        except (asyncio.QueueEmpty, asyncio.TimeoutError):
            return None

    # ------------------------------------------------------------------------------------------ plumbing

    def _ask(self, message: Any) -> asyncio.Future[Any]:
        """Send a request whose reply is waited for: the future it resolves."""
        future = self._core.expect(message.req, asyncio.get_running_loop().create_future(), type(message))
        try:
            self._put(protocol.encode(message))
        except (OutboxFull, RuntimeError):
            self._core.forget(message.req)
            raise
        return future

    async def _request(self, message: Any, timeout_s: float | None = None) -> Any:
        """Send a request once fewer than ``max_in_flight`` wait for answers, and wait for its own."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        try:  # a free slot is taken without yielding: a full outbox still refuses at once
            await (self._in_flight.acquire() if not self._in_flight.locked() else
                   asyncio.wait_for(self._in_flight.acquire(), timeout))
        except asyncio.TimeoutError:
            raise TimeoutError(f"requests to {self.endpoint} waited {timeout:.1f} s for their answers: this one was "
                               "not sent") from None
        try:
            future = self._ask(message)
            return await asyncio.wait_for(future, max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise TimeoutError(f"no reply from {self.endpoint} within {timeout:.1f} s") from None
        finally:
            self._in_flight.release()
            self._core.forget(message.req)

    def _send_quiet(self, message: Any, stamp: tuple[str, int] | None = None, own: bool = False) -> None:
        """Send a fire-and-forget request: its error goes to ``error()``, never to a chunk stream."""
        self._core.quiet(message.req)
        self._put(protocol.encode(message), stamp, own)

    def _close_orphan(self, session: str) -> None:
        self._send_quiet(self._requests.close(session), own=True)  # from the reader: never refused

    def _put(self, data: bytes, stamp: tuple[str, int] | None = None, own: bool = False) -> None:
        """Queue a message for the writer; a caller's (not ``own``) is refused beyond ``max_outbox``."""
        self._started()
        self._outbox.put(data, stamp, own)
        self._ready.set()

    def _started(self) -> None:
        if self._sock is None:
            raise RuntimeError("the client is not started (use `async with AsyncClient(...)` or `await start()`)")

    def _session(self, session: str) -> SessionState[asyncio.Queue[Any]]:
        return self._core.session(session)

    async def _writer(self) -> None:
        assert self._sock is not None
        while True:
            self._ready.clear()  # before looking: anything queued from here on sets it again
            while (item := self._outbox.peek()) is not None:
                await self._sock.send(item[0])
                self._outbox.sent(item)
                self._core.sent(item[1])  # the input-to-photon clock of a live revision starts as it leaves
            await self._ready.wait()

    async def _heartbeats(self) -> None:
        beat = protocol.encode(protocol.Heartbeat())
        while True:
            if len(self._outbox) < self.max_outbox:  # else the writer is stuck on a full socket: never pile up
                self._outbox.put(beat, None, own=True)
                self._ready.set()
            await asyncio.sleep(self.heartbeat_s)
            self._core.check_server(self.server_silent_s)

    async def _reader(self) -> None:
        assert self._sock is not None
        while True:
            self._core.route(await self._sock.recv())

    def _put_error(self, error: ServerError) -> None:
        with contextlib.suppress(asyncio.QueueFull):
            self._errors.put_nowait(error)


@dataclass
class AsyncWatch:
    """The asyncio twin of ``ipc.client.Watch``: ``info``, then ``async for`` the chunks; ``missed`` sums what was
    dropped for this client."""

    info: SessionInfo
    chunks: AsyncIterator[ChunkResult]
    missed: int = 0

    def __aiter__(self) -> AsyncWatch:
        return self

    async def __anext__(self) -> ChunkResult:
        chunk = await self.chunks.__anext__()
        self.missed += chunk.missed
        return chunk
