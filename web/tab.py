"""A browser tab in Python: the page protocol over a WebSocket, minus the drawing (tests and benchmarks).

    async with connect(port) as tab:
        opened = await tab.open(prompt="a forest", num_chunks=8)
        await tab.state(1, keys="w")
        closed = await tab.next("closed")
        tab.frames  # [(arrival, header, picture bytes)]
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp

from web import page_protocol as pp

SAMPLE_IMAGE = Path(__file__).resolve().parent.parent / "assets" / "start.png"


class Tab:
    """A WebSocket to the gateway speaking the page protocol (what play.js does, minus the drawing). It records
    every message and frame it receives: meant for tests and benchmarks of bounded length."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.texts: list[dict[str, Any]] = []
        self.frames: list[tuple[float, dict[str, int], bytes]] = []  # (arrival, header, picture)

    async def next(self, *types: str, timeout_s: float = 20.0) -> dict[str, Any]:
        """The next text message of one of ``types`` (frames and other messages on the way are recorded)."""
        deadline = time.monotonic() + timeout_s
        while True:
            message = await self.ws.receive(timeout=max(0.01, deadline - time.monotonic()))
            if message.type == aiohttp.WSMsgType.BINARY:
                header = pp.read_frame(message.data)
                self.frames.append((time.monotonic(), header, message.data[header["header"]:]))
                continue
            if message.type != aiohttp.WSMsgType.TEXT:
                raise ConnectionError(f"the gateway closed the WebSocket: {message.type} {message.data!r}")
            data = json.loads(message.data)
            data["_received"] = time.monotonic()  # the tab's arrival time (not part of the protocol)
            self.texts.append(data)
            if data["type"] in types:
                return data

    async def drain(self, seconds: float) -> None:
        """Record whatever arrives for ``seconds`` (e.g. the last chunk's frames, still playing after ``closed``)."""
        with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
            await self.next("none", timeout_s=seconds)

    async def open(self, image: bytes | None = None, **request: Any) -> dict[str, Any]:
        """Open a session (``image``: the sample image when not given); the ``opened`` or ``error`` reply."""
        image = SAMPLE_IMAGE.read_bytes() if image is None else image
        await self.ws.send_bytes(pp.open_message(request, image))
        return await self.next("opened", "error")

    async def state(self, revision: int, keys: str = "", mouse: tuple[float, float] = (0.0, 0.0),
                    taps: str = "") -> None:
        await self.ws.send_str(json.dumps({"type": "state", "keys": list(keys), "mouse": list(mouse),
                                           "taps": list(taps), "revision": revision}))

    async def set_prompt(self, prompt: str) -> dict[str, Any]:
        """A new prompt mid-session: the ``prompt`` reply (revision, first chunk) or the ``error``."""
        await self.ws.send_str(json.dumps({"type": "prompt", "prompt": prompt}))
        return await self.next("prompt", "error")

    async def watch(self, session: str, token: str) -> dict[str, Any]:
        """Watch another tab's session read-only: the ``watching`` or ``error`` reply."""
        await self.ws.send_str(json.dumps({"type": "watch", "session": session, "token": token}))
        return await self.next("watching", "error")

    async def save(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """Save the tab's session: the ``saved`` reply (snapshot id, chunk, costs) or the ``error``."""
        await self.ws.send_str(json.dumps({"type": "save"}))
        return await self.next("saved", "error", timeout_s=timeout_s)

    async def fork(self, snapshot: str, **request: Any) -> dict[str, Any]:
        """Open a session from a snapshot (no image): the ``opened`` or ``error`` reply."""
        await self.ws.send_bytes(pp.open_message({**request, "restore": snapshot}, b""))
        return await self.next("opened", "error")

    async def close_session(self, timeout_s: float = 20.0) -> dict[str, Any]:
        """Stop the session: its ``closed`` (or the ``error`` saying there is none, e.g. it ended meanwhile)."""
        await self.ws.send_str(json.dumps({"type": "close"}))
        return await self.next("closed", "error", timeout_s=timeout_s)


@asynccontextmanager
async def connect(port: int, token: str | None = None, origin: str | None = "same",
                  host: str | None = None) -> AsyncIterator[Tab]:
    """A tab connected to the gateway on 127.0.0.1:``port``. ``origin``: "same" (what the page sends), another
    origin, or ``None`` (none, like a client that is not a browser); ``host`` overrides the Host header."""
    headers = {}
    if origin is not None:
        headers["Origin"] = f"http://127.0.0.1:{port}" if origin == "same" else origin
    if host is not None:
        headers["Host"] = host
    query = f"?token={token}" if token is not None else ""
    async with aiohttp.ClientSession() as session, \
            session.ws_connect(f"ws://127.0.0.1:{port}/ws{query}", headers=headers) as ws:
        opened = Tab(ws)
        hello = await opened.next("hello")
        if hello["version"] != pp.PAGE_PROTOCOL_VERSION:
            raise ConnectionError(f"the gateway speaks page protocol {hello['version']}, not "
                                  f"{pp.PAGE_PROTOCOL_VERSION}")
        yield opened
