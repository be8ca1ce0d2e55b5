"""One browser tab: its WebSocket, its ``AsyncClient``, at most one session at a time, and the tasks serving it,
all in one ``TabTasks`` (so none can outlive the tab, none can fail unseen, and none survives a lost cancel):

- the **reader**: validates each page message and acts on it (open or fork, live state, prompt, save, close, stats,
  trace); a bad message gets an ``error`` and changes nothing;
- the **chunk pump** of the open session: takes every chunk from the client, sends its facts to the page at once
  (text, never dropped) and hands its frames to the playout (only the newest chunk's are kept);
- the **sender**: the only task that writes to the WebSocket: pending text messages first, then the frame the
  playout says is due, encoded on a worker thread; one frame in flight at a time;
- plus an **error pump** forwarding the errors no request waits for (a rejected live state, a stage failure, the
  server shutting down).

A tab that goes away (closed, reloaded, network lost: aiohttp's WebSocket heartbeat notices) ends them all: its
tasks are stopped and awaited, then an open still in flight, and only then, with nothing left to race it for the
session's events, is its session closed on the server and its slot of the gateway's session limit returned. A task
that fails ends the tab the same way, its WebSocket closed with 1011 and the reason (never a stream that silently
stops).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import WSMsgType, web

from ipc.aio_client import AsyncClient
from ipc.client import (
    ChunkResult,
    ServerError,
    SessionClosed,
    SessionDraining,
    SessionInfo,
    SessionMigrated,
    UnknownSession,
    closed_summary,
)
from ipc.error_codes import ErrorCode
from ipc.metrics_types import SessionSummary, given
from ipc.protocol import StreamHeader
from web import page_messages as pm
from web import page_protocol as pp
from web.chunks import Timeline, chrome_trace, page_chunk
from web.playout import Playout, encode_frame
from web.tab_tasks import TabTasks

log = logging.getLogger("worldstream.web")

MAX_OUTBOX = 256  # text messages waiting for the page (one per chunk): a page this far behind has stopped reading
TRACE_CHUNKS = 2000  # chunks of a session kept for its Chrome trace (bounded: long sessions keep the last ones)
IDLE_WAIT_S = 3600.0  # how long the pump waits for a chunk before looking again (a paused session is silent)
CLOSE_TIMEOUT_S = 30.0  # a close drains the chunks in flight first: seconds each at 480x832 on a busy CPU


@dataclass(frozen=True)
class BridgeSettings:
    server: str  # the worldstream server's ZeroMQ endpoint
    frame_format: str = "jpeg"
    quality: int = 80
    limits: pp.Limits = field(default_factory=pp.Limits)
    request_timeout_s: float = 30.0  # open (image decode + every role's cache init) and the other requests
    server_token: str | None = None  # the client token the server (or router) requires (``ipc.auth``); None: none


class SessionSlots:
    """The gateway's session limit, shared by its tabs: a slot is held from the open request to the close."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the session limit must be >= 1, got {limit}")
        self.limit = limit
        self.used = 0

    def acquire(self) -> bool:
        if self.used >= self.limit:
            return False
        self.used += 1
        return True

    def release(self) -> None:
        self.used -= 1
        assert self.used >= 0, "a slot was released twice"


class Bridge:
    def __init__(self, ws: web.WebSocketResponse, settings: BridgeSettings, slots: SessionSlots) -> None:
        self.ws = ws
        self.settings = settings
        self.slots = slots
        self.client: AsyncClient | None = None
        self.session: SessionInfo | None = None
        self.playout: Playout | None = None
        self.playing: ChunkResult | None = None
        self.timeline: collections.deque[Timeline] = collections.deque(maxlen=TRACE_CHUNKS)
        self.watching = False  # the session is another tab's, watched read-only (``watch``)
        self.frames_sent = 0
        self.bytes_sent = 0
        self._opening: asyncio.Future[None] | None = None  # the open request in flight, if any
        self._outbox: collections.deque[str] = collections.deque()
        self._wake = asyncio.Event()
        self._tasks = TabTasks()  # the tab's tasks
        self._pump: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Serve the tab until its WebSocket closes (or one of its tasks fails); then close its session and free
        everything."""
        try:
            self._tasks.spawn(self._sender())
            self.send(pm.Hello(version=pp.PAGE_PROTOCOL_VERSION, format=self.settings.frame_format,
                               limits=pm.PageLimits(max_upload_bytes=self.settings.limits.max_upload_bytes),
                               max_sessions=self.slots.limit))
            failure = await self._tasks.run(self._read())
            if failure is not None:
                log.error("a task of this tab failed: closing it", exc_info=failure)
                reason = f"the gateway failed: {failure!r}"[:120]  # a close reason holds at most 123 bytes
                with contextlib.suppress(Exception):
                    await self.ws.close(code=1011, message=reason.encode())
        finally:
            self._pump = None  # every task of the tab is done: nothing reads the session's events now
            try:
                if self._opening is not None:  # an open still in flight (bounded by the client's request timeout)
                    await asyncio.wait({self._opening})
                    error = None if self._opening.cancelled() else self._opening.exception()
                    if error is not None:  # the reader that would have raised it is gone
                        log.warning("opening a session failed as its tab went away: %r", error)
                await self._close_session()
            finally:
                if self.session is not None:  # the close itself was cancelled (the gateway stopping)
                    stopped = SessionSummary(reason="unknown", error="the gateway stopped while closing")
                    self._finish(self.session, stopped)
                if self.client is not None:
                    await self.client.aclose()

    async def _read(self) -> None:
        async for message in self.ws:
            if not self._tasks.wanted():
                return
            if message.type == WSMsgType.TEXT:
                await self._on_text(message.data)
            elif message.type == WSMsgType.BINARY:
                await self._on_binary(message.data)
            elif message.type == WSMsgType.ERROR:
                log.info("websocket error: %s", self.ws.exception())

    def send(self, message: pm.PageMessage) -> None:
        """Queue a text message for the page (the sender writes it before any further frame)."""
        if self._tasks.stopping:  # the tab is over (its session's last words go nowhere)
            return
        if len(self._outbox) >= MAX_OUTBOX:
            log.warning("the page stopped reading (%d messages waiting): closing its connection", len(self._outbox))
            self._outbox.clear()
            self._tasks.spawn(self.ws.close(code=1008, message=b"the page stopped reading"))
            return
        self._outbox.append(pm.encode(message))
        self._wake.set()

    def error(self, code: str, message: str, retry_after_s: float | None = None, session: str | None = None) -> None:
        self.send(pm.Error(code=code, message=message, retry_after_s=retry_after_s, session=session))

    # ------------------------------------------------------------------------------------------ page messages

    async def _on_text(self, data: str) -> None:
        try:
            request = pp.parse_text(data)
        except pp.PageError as error:
            self.error(error.code, error.message)
            return
        if isinstance(request, pp.StateRequest):
            self._on_state(request)
        elif isinstance(request, pp.CloseRequest):
            if self.session is None:
                self.error(ErrorCode.NO_SESSION, "no session is open in this tab")
            else:
                await self._close_session()
        elif isinstance(request, pp.PromptRequest):
            self._tasks.spawn(self._on_prompt(request))  # answered once encoded: input keeps flowing meanwhile
        elif isinstance(request, pp.SaveRequest):
            self._tasks.spawn(self._on_save())  # answered once written: the stream goes on meanwhile
        elif isinstance(request, pp.StatsRequest):
            await self._on_stats()
        elif isinstance(request, pp.WatchRequest):
            await self._on_watch(request)
        else:
            await self._on_trace()

    async def _on_binary(self, data: bytes) -> None:
        try:
            request, image = pp.parse_open(data, self.settings.limits)
        except pp.PageError as error:
            self.error(error.code, error.message)
            return
        if not self._take_slot():
            return
        # The open runs on even if the tab goes away meanwhile (a cancel mid-request would lose the session the
        # server is opening): the teardown waits for it and closes what it opened.
        self._opening = asyncio.ensure_future(self._open(request, image))
        await asyncio.shield(self._opening)

    def _take_slot(self) -> bool:
        """A slot of the gateway's limit for a new session or watch of this tab, or False (the page was told why)."""
        if self.session is not None or (self._opening is not None and not self._opening.done()):
            self.error(ErrorCode.BAD_REQUEST, "a session is already open in this tab: stop it first")
            return False
        if not self.slots.acquire():
            self.error(ErrorCode.BUSY, f"this gateway serves at most {self.slots.limit} sessions at once and all are "
                       "in use", retry_after_s=2.0)
            return False
        return True

    async def _open(self, request: pp.OpenRequest, image: bytes) -> None:
        """Open the session on the server (its slot is held): record it, or return the slot with the error."""
        try:
            client = await self._client()
            info = await client.open(image, prompt=request.prompt, seed=request.seed, num_chunks=request.num_chunks,
                                     live=True, pause_when_idle=request.pause_when_idle, restore=request.restore)
        except ServerError as error:
            self.slots.release()
            self.error(error.code, error.message, error.retry_after_s)
            return
        except TimeoutError:
            self.slots.release()
            self.error(ErrorCode.SERVER_UNREACHABLE, f"no answer from the worldstream server at {self.settings.server} "
                                             f"within {self.settings.request_timeout_s:.0f} s: is it running?")
            return
        except BaseException:  # anything else (a request the client cannot send): no session
            self.slots.release()
            raise
        # From here the slot is the session's: the page's close or the tab's teardown closes it and returns it.
        self.session, self.watching = info, False
        log.info("session %s opened", info.id)
        if self._tasks.stopping:  # the tab went away while the server opened it
            return
        self.playout, self.playing = Playout(info.fps), None
        self.timeline.clear()
        self._pump = self._tasks.spawn(self._chunk_pump(client, info))
        self.send(pm.Opened(**StreamHeader.of(info).as_fields(), format=self.settings.frame_format,
                            watch_token=info.watch_token, first_chunk=info.first_chunk, restored=request.restore))

    async def _on_watch(self, request: pp.WatchRequest) -> None:
        """Watch another tab's session read-only (a share link): a slot of the gateway's limit, like a session."""
        if not self._take_slot():
            return
        try:
            client = await self._client()
            watch = await client.watch(request.session, request.token, timeout_s=IDLE_WAIT_S)
        except (ServerError, TimeoutError) as error:
            self.slots.release()
            self.error(getattr(error, "code", ErrorCode.SERVER_UNREACHABLE), getattr(error, "message", str(error)),
                       getattr(error, "retry_after_s", None))
            return
        info = watch.info
        self.session, self.watching = info, True
        self.playout, self.playing = Playout(info.fps), None
        self.timeline.clear()
        self._pump = self._tasks.spawn(self._chunk_pump(client, info))
        self.send(pm.Watching(**StreamHeader.of(info).as_fields(), format=self.settings.frame_format))

    def _on_state(self, state: pp.StateRequest) -> None:
        if self.session is None or self.client is None:
            self.error(ErrorCode.NO_SESSION, "no session is open in this tab: input is ignored until one is")
            return
        if self.watching:
            self.error(ErrorCode.WATCH_ONLY, "this tab watches another tab's session: only its player steers it",
                       session=self.session.id)
            return
        # Never refused, never queued: the SDK keeps the newest unsent state of the session (a flood of input costs
        # one message); a stale revision is rank 0's to refuse, its error comes back through the error pump.
        self.client.control_state(self.session.id, state)

    async def _on_prompt(self, request: pp.PromptRequest) -> None:
        info, client = self.session, self.client
        if info is None or client is None:
            self.error(ErrorCode.NO_SESSION, "no session is open in this tab: start one with this prompt instead")
            return
        try:
            reply = await client.set_prompt(info.id, request.prompt)
        except (ServerError, TimeoutError) as error:
            self.error(getattr(error, "code", ErrorCode.SERVER_UNREACHABLE), getattr(error, "message", str(error)),
                       getattr(error, "retry_after_s", None), session=info.id)
            return
        self.send(pm.Prompt(session=info.id, revision=reply.revision, chunk=reply.chunk))

    async def _on_save(self) -> None:
        info, client = self.session, self.client
        if info is None or client is None:
            self.error(ErrorCode.NO_SESSION, "no session is open in this tab: nothing to save")
            return
        try:
            snapshot = await client.save(info.id)  # a watching tab's is refused by the server (watch_only)
        except (ServerError, TimeoutError) as error:
            self.error(getattr(error, "code", ErrorCode.SERVER_UNREACHABLE), getattr(error, "message", str(error)),
                       getattr(error, "retry_after_s", None), session=info.id)
            return
        self.send(pm.Saved(session=info.id, snapshot=snapshot.id, chunk=snapshot.chunk, bytes=snapshot.bytes,
                           files=snapshot.files, pause_s=snapshot.pause_s, write_s=snapshot.write_s,
                           wait_s=snapshot.wait_s))

    async def _on_stats(self) -> None:
        if self.client is None:
            self.error(ErrorCode.NO_SESSION, "no session has been opened in this tab yet")
            return
        try:
            stats = await self.client.stats()
        except (ServerError, TimeoutError) as error:
            self.error(getattr(error, "code", ErrorCode.SERVER_UNREACHABLE), str(error))
            return
        session = stats.per_session.get(self.session.id) if self.session else None
        server = {"open_sessions": stats.open_sessions, "layout": stats.layout,
                  "schedule": given(stats.schedule), "dit_idle": given(stats.dit_idle)}
        self.send(pm.Stats(session=_brief(session) if session else None, server=_plain(server),
                           gateway={"sessions": self.slots.used, "max_sessions": self.slots.limit,
                                    "frames_sent": self.frames_sent, "bytes_sent": self.bytes_sent}))

    async def _on_trace(self) -> None:
        if not self.timeline:
            self.error(ErrorCode.NO_TRACE, "no chunk has arrived in this tab yet: nothing to trace")
            return
        chunks = list(self.timeline)
        trace = await asyncio.to_thread(chrome_trace, chunks)
        self.send(pm.Trace(session=chunks[-1][0], trace=trace))

    # ------------------------------------------------------------------------------------------ session

    async def _client(self) -> AsyncClient:
        if self.client is None:
            self.client = await AsyncClient(self.settings.server, timeout_s=self.settings.request_timeout_s,
                                            token=self.settings.server_token).start()
            if not self._tasks.stopping:
                self._tasks.spawn(self._error_pump(self.client))
        return self.client

    async def _chunk_pump(self, client: AsyncClient, info: SessionInfo) -> None:
        loop = asyncio.get_running_loop()
        while self._tasks.wanted():
            try:
                chunk = await client.next_chunk(info.id, timeout_s=IDLE_WAIT_S)
                if not self._tasks.wanted():  # stopped while the chunk came: its cancel was lost (see TabTasks)
                    return
            except TimeoutError:
                continue
            except SessionClosed as closed:
                self._finish(info, closed_summary(closed.closed))
                return
            except SessionMigrated as moved:  # its replica died: the router resumed it from its snapshot elsewhere
                assert self.playout is not None
                self.playout.rewind()
                self.send(pm.Migrated(session=info.id, chunk=moved.chunk, replica=moved.replica))
                continue
            except SessionDraining as drained:  # the server stops (no router in front): the snapshot is the way back
                self.send(pm.Draining(session=info.id, snapshot=drained.snapshot, chunk=drained.chunk))
                continue  # its `closed` (drained) follows
            except ServerError:
                continue  # the session's failure or the server's end: the error pump reports it, `closed` follows
            self.timeline.append((chunk.session, chunk.facts))
            assert self.playout is not None
            if self.playout.chunk is not None and chunk.index <= self.playout.chunk:
                self.playout.rewind()  # chunks again after a migration whose notice a watcher's full feed dropped
            self.playout.push(chunk.index, int(chunk.frames.shape[0]), loop.time())
            self.playing = chunk
            self.send(page_chunk(chunk, self.playout.dropped))

    async def _close_session(self) -> None:
        """Close the open session on the server (page stop or tab gone), wait for its summary, return the slot."""
        info, client = self.session, self.client
        if info is None or client is None:
            return
        pump, self._pump = self._pump, None
        if pump is not None:
            await self._tasks.stop(pump)  # it must not race close() for the session's events
        if self.session is not info:  # the session ended by itself meanwhile
            return
        try:
            if self.watching:
                summary = await client.unwatch(info.id, timeout_s=CLOSE_TIMEOUT_S)
            else:
                summary = await client.close(info.id, timeout_s=CLOSE_TIMEOUT_S)
        except UnknownSession:  # it closed by itself just before: its `closed` is already here
            try:
                summary = await client.wait_closed(info.id, timeout_s=2.0)
            except TimeoutError:
                summary = SessionSummary(reason="unknown", error="the server no longer holds the session")
        except (ServerError, TimeoutError) as error:
            summary = SessionSummary(reason="unknown", error=f"closing failed: {error}")
        self._finish(info, summary)  # (cancelled before this, the session stays recorded: the teardown closes it)

    def _finish(self, info: SessionInfo, summary: SessionSummary) -> None:
        """The session is over: tell the page, return the slot (exactly once per session)."""
        if self.session is not info:
            return
        self.session, self._pump = None, None  # the playout still shows what is left of the last chunk
        self.slots.release()
        reason, error = given(summary.reason), given(summary.error)
        self.send(pm.Closed(session=info.id, reason=reason, error=error, summary=_brief(summary)))
        log.info("session %s closed (%s)", info.id, reason)

    async def _error_pump(self, client: AsyncClient) -> None:
        while self._tasks.wanted():
            error = await client.error(timeout_s=IDLE_WAIT_S)
            if error is not None:
                self.error(error.code, error.message, error.retry_after_s, error.session)

    # ------------------------------------------------------------------------------------------ sending

    async def _sender(self) -> None:
        with contextlib.suppress(ConnectionError):  # the tab went away under a write: the reader sees it end
            await self._send_until_closed()

    async def _send_until_closed(self) -> None:
        loop = asyncio.get_running_loop()
        fmt, quality = self.settings.frame_format, self.settings.quality
        while not self.ws.closed and self._tasks.wanted():
            self._wake.clear()  # before looking: anything queued from here on sets it again
            while self._outbox:
                await self.ws.send_str(self._outbox.popleft())
            taken = self.playout.take(loop.time()) if self.playout is not None else None
            if taken is not None and self.playing is not None:
                playing = self.playing
                index = taken[1]
                picture = await asyncio.to_thread(encode_frame, playing.frames[index], fmt, quality)
                data = pp.frame_message(fmt, playing.index, index, int(playing.frames.shape[0]), playing.revision,
                                        picture)
                await self.ws.send_bytes(data)
                self.frames_sent += 1
                self.bytes_sent += len(data)
                continue
            due = self.playout.next_due() if self.playout is not None else None
            woken = asyncio.ensure_future(self._wake.wait())
            try:  # asyncio.wait, not wait_for: it never swallows a cancel
                await asyncio.wait({woken}, timeout=None if due is None else max(0.0, due - loop.time()))
            finally:
                woken.cancel()


def _brief(summary: SessionSummary) -> dict[str, Any]:
    """A session summary as the page reads it (its wire map), without its per-chunk tail (the page has every chunk
    already)."""
    out = _plain(summary)
    del out["recent_chunks"]
    if not summary.session:  # a partial one (a router's replica, this gateway's reason): only what it says
        empty = _EMPTY_SUMMARY
        out = {k: v for k, v in out.items() if k not in empty or v != empty[k]}
    return out


_EMPTY_SUMMARY = msgspec.to_builtins(SessionSummary())


def _plain(value: Any) -> Any:
    """A typed value as the map it is on the wire (fields left unset left out)."""
    return msgspec.to_builtins(value)
