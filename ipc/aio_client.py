"""The asyncio twin of ``ipc.client.Client`` (``zmq.asyncio``), with the same API shape: awaitable requests,
chunks as an async iterator, fire-and-forget live input, typed ``ServerError`` subclasses.

Inside one event loop three tasks share the DEALER socket (pyzmq's asyncio sockets take concurrent send and recv
from tasks of one loop; no other thread touches it): a writer that drains the outbox (requests, live states,
heartbeats every ``heartbeat_s``), a reader that hands each message to the ``ClientCore`` it shares with ``Client``
(replies to their request futures by request id, chunks and session events to per-session queues), and the
heartbeat timer. Every call's decisions (control's retry, until-closed, wait-closed, what ``chunks`` yields) are
``ClientCore``'s plans: this client only performs their steps, awaiting each (``_perform``), as ``Client`` blocks.

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
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Unpack

import zmq
import zmq.asyncio

from ipc import protocol
from ipc.client_core import (
    MAX_OUTBOX,
    Ask,
    ClientCore,
    ClientSettings,
    NextEvent,
    Pause,
    Plan,
    Running,
    Start,
    Step,
    T,
    Tell,
)
from ipc.client_errors import OutboxFull, ServerError, SessionMigrated
from ipc.client_requests import ControlFields, LiveInput, chunk_control
from ipc.client_results import ChunkResult, SessionInfo, Snapshot, session_info, snapshot_of
from ipc.metrics_types import ServerStats, SessionSummary
from ipc.outgoing import MAX_IN_FLIGHT


class AsyncClient(ClientSettings):
    """An asyncio client; use it from one event loop (``async with``, or ``await start()`` / ``await aclose()``)."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:5555", identity: bytes | None = None,
                 timeout_s: float = 60.0, heartbeat_s: float = 1.0, server_silent_s: float = 5.0,
                 max_outbox: int = MAX_OUTBOX, max_in_flight: int = MAX_IN_FLIGHT, token: str | None = None,
                 token_file: str | None = None) -> None:  # fmt: skip
        super().__init__(endpoint, identity, timeout_s, heartbeat_s, server_silent_s, max_outbox, "aclient", token,
                         token_file)
        self._errors: asyncio.Queue[ServerError] = asyncio.Queue(maxsize=256)
        self._core: ClientCore[asyncio.Queue[Any], asyncio.Future[Any]] = ClientCore(
            asyncio.Queue, self._put_error, close_orphan=self._close_orphan, token=self.token)
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
        message = self._core.requests.open(image, prompt, seed, num_chunks, live, pause_when_idle, intrinsics, steps,
                                      min_steps, restore, indexed)
        return session_info(await self._request(message))

    async def save(self, session: str) -> Snapshot:
        """Save the session at its next chunk boundary; see ``Client.save``."""
        return snapshot_of(await self._request(self._core.requests.save(session)))

    async def control(self, session: str, index: int, control: protocol.ChunkControl | None = None, *,
                      wait: bool = True, steps: int | None = None, **fields: Unpack[ControlFields]) -> None:
        """Send control[index]; see ``Client.control`` (backpressure is retried until the client timeout)."""
        await self._run(self._core.control(session, index, chunk_control(control, session, **fields), wait, steps,
                                           self.timeout_s))

    def control_state(self, session: str, state: protocol.InputState, steps: int | None = None) -> None:
        """Live mode, fire and forget (call it from the loop's thread); never refused: a state not sent yet is
        replaced by this newer one. See ``Client.control_state``."""
        self._started()
        self._outbox.put_state(session, *self._core.live_state(session, state, steps))
        self._ready.set()

    def live(self, session: str, first_revision: int = 1) -> LiveInput:
        return LiveInput(self, session, first_revision)

    async def set_prompt(self, session: str, prompt: str) -> protocol.PromptScheduled:
        """A new prompt mid-stream: its revision and first chunk once encoded; see ``Client.set_prompt``."""
        return await self._request(self._core.requests.set_prompt(session, prompt))

    async def close(self, session: str, timeout_s: float | None = None) -> SessionSummary:
        """Ask the server to close the session; its summary once closed (``UnknownSession`` if it is not held)."""
        return await self._run(self._core.until_closed(self._core.requests.close(session), self._timeout(timeout_s)))

    async def stats(self) -> ServerStats:
        return (await self._request(self._core.requests.stats())).stats

    async def drain(self, operator_token: str) -> protocol.Draining:
        """Drain the server; see ``Client.drain``."""
        return await self._request(self._core.requests.drain(operator_token))

    async def watch(self, session: str, token: str, timeout_s: float | None = None) -> AsyncWatch:
        """Watch another client's session read-only; see ``Client.watch`` (``async for`` the returned watch)."""
        info = await self._run(self._core.watch(session, token, self.timeout_s))
        return AsyncWatch(info, self.chunks(session, timeout_s))

    async def unwatch(self, session: str, timeout_s: float | None = None) -> SessionSummary:
        """Stop watching; see ``Client.unwatch``."""
        return await self._run(self._core.until_closed(self._core.requests.unwatch(session),
                                                       self._timeout(timeout_s)))

    async def resume(self, session: str) -> None:
        """Re-attach to a session this identity owns; see ``Client.resume``."""
        self._core.session(session)  # its chunks that come before the reply find their queue
        await self._request(self._core.requests.resume(session))

    # ------------------------------------------------------------------------------------------ receiving

    async def next_chunk(self, session: str, timeout_s: float | None = None) -> ChunkResult:
        """The session's next chunk. Raises ``SessionClosed`` at its end, ``ServerError`` on its errors,
        ``SessionMigrated`` (once per move; the session goes on) when a router restored it on another replica."""
        return await self._run(self._core.next_chunk(session, self._timeout(timeout_s)))

    async def chunks(self, session: str, timeout_s: float | None = None,
                     on_migrated: Callable[[SessionMigrated], Awaitable[None]] | None = None
                     ) -> AsyncIterator[ChunkResult]:
        """Chunks until the session closes (errors of the session raise); a migration is awaited in
        ``on_migrated`` and the chunks go on from its resume chunk (as ``Client.chunks``)."""
        while (item := await self._run(self._core.streamed(session, self._timeout(timeout_s)))) is not None:
            if isinstance(item, ChunkResult):
                yield item
            elif on_migrated is not None:
                await on_migrated(item)

    async def wait_closed(self, session: str, timeout_s: float | None = None,
                          refused: asyncio.Future[Any] | None = None) -> SessionSummary:
        """Discard chunks until the session's ``closed`` arrives; see ``Client.wait_closed``."""
        return await self._run(self._core.wait_closed(session, self._timeout(timeout_s), refused))

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
            self._put(self._core.encode(message))
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

    async def _run(self, plan: Plan[T]) -> T:
        """Run a plan of the core (the decisions are its), awaiting each step it asks for."""
        with contextlib.closing(plan):
            running = Running(plan)
            while not running.done:
                running.answer(*(await self._perform(running.step)))
            return running.result

    async def _perform(self, step: Step) -> tuple[Any, BaseException | None]:
        try:
            if isinstance(step, Ask):
                return await self._request(step.message, step.timeout_s), None
            if isinstance(step, Start):
                return self._ask(step.message), None
            if isinstance(step, Tell):
                return self._put(self._core.tell(step.message)), None
            if isinstance(step, Pause):
                return await asyncio.sleep(step.seconds), None
            assert isinstance(step, NextEvent)
            try:
                return await asyncio.wait_for(self._core.session(step.session).events.get(), step.timeout_s), None
            except asyncio.TimeoutError:
                raise step.late() from None
        except Exception as error:
            return None, error

    def _close_orphan(self, session: str) -> None:
        self._put(self._core.tell(self._core.requests.close(session)), own=True)  # from the reader: never refused

    def _put(self, data: bytes, stamp: tuple[str, int] | None = None, own: bool = False) -> None:
        """Queue a message for the writer; a caller's (not ``own``) is refused beyond ``max_outbox``."""
        self._started()
        self._outbox.put(data, stamp, own)
        self._ready.set()

    def _started(self) -> None:
        if self._sock is None:
            raise RuntimeError("the client is not started (use `async with AsyncClient(...)` or `await start()`)")

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
        beat = self._core.encode(protocol.Heartbeat())
        while True:
            if len(self._outbox) < self.max_outbox:  # else the writer is stuck on a full socket: never pile up
                self._outbox.put(beat, None, own=True)
                self._ready.set()
            await asyncio.sleep(self.heartbeat_s)
            self._core.check_server(self.server_silent_s)

    async def _reader(self) -> None:
        assert self._sock is not None
        while True:
            self._core.route(await self._sock.recv_multipart(copy=False))  # a chunk's frames: a part

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
