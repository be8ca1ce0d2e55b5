"""The aiohttp application: the play page, one WebSocket per tab (``/ws``), a health check, and the safety checks.

Safe by default:
- the command binds loopback unless told otherwise, and refuses a non-loopback bind without an access token;
- with a token, ``/ws`` and ``/healthz`` need ``?token=...`` (compared in constant time); the page carries the
  token from its own URL, which the gateway prints;
- the ``Host`` header must name this machine's loopback (or an ``--allow-host``) when bound to loopback, so a web
  page of another site that resolves its own name to 127.0.0.1 (DNS rebinding) cannot talk to the gateway;
- a WebSocket whose ``Origin`` is not this page's own origin (or an ``--allow-origin``) is refused: another site
  open in the same browser cannot drive the server;
- uploads and messages are size-checked before decoding (aiohttp refuses a frame over ``max_msg_size`` before
  reading it; ``page_protocol`` checks the rest);
- the gateway's own session limit answers ``busy`` like the server's.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web
from msgspec import UNSET

from ipc.aio_client import AsyncClient
from ipc.auth import is_loopback
from ipc.client import ServerError
from web.bridge import Bridge, BridgeSettings, SessionSlots

log = logging.getLogger("worldstream.web")

STATIC = Path(__file__).resolve().parent / "static"
SAMPLE_IMAGE = Path(__file__).resolve().parent.parent / "assets" / "start.png"  # the page's default start image
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WS_HEARTBEAT_S = 5.0  # a tab that vanished without closing (laptop lid, network) is noticed within ~2 of these
PAGE_HEADERS = {
    # the page loads only its own files and talks only to its own origin; the token in its URL never leaks
    "Content-Security-Policy": "default-src 'self'; img-src 'self' blob: data:; connect-src 'self'; "
                               "style-src 'self'; script-src 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


@dataclass(frozen=True)
class GatewaySettings:
    bridge: BridgeSettings
    host: str = "127.0.0.1"
    max_sessions: int = 4
    token: str | None = None
    allow_hosts: frozenset[str] = field(default_factory=frozenset)  # extra Host names (beyond loopback)
    allow_origins: frozenset[str] = field(default_factory=frozenset)  # extra WebSocket origins, "scheme://host:port"
    health_timeout_s: float = 2.0  # /healthz waits this long for its server's stats before saying it is down


def host_name(netloc: str) -> str:
    """``"localhost:8080"`` -> ``"localhost"``; ``"[::1]:8080"`` -> ``"::1"``."""
    return (urlsplit(f"//{netloc}").hostname or "").lower()


KEY_SETTINGS = web.AppKey("settings", GatewaySettings)
KEY_SLOTS = web.AppKey("slots", SessionSlots)
KEY_SOCKETS = web.AppKey("sockets", set)


def make_app(settings: GatewaySettings) -> web.Application:
    if not is_loopback(settings.host) and not settings.token:
        raise ValueError(f"binding {settings.host} (not loopback) needs an access token: anyone who reaches the port "
                         "could drive the server; pass --token, or bind 127.0.0.1 and use an SSH tunnel")
    app = web.Application(middlewares=[_check_host], client_max_size=64 * 1024)
    app[KEY_SETTINGS] = settings
    app[KEY_SLOTS] = SessionSlots(settings.max_sessions)
    app[KEY_SOCKETS] = set()
    app.router.add_get("/", _index)
    app.router.add_get("/ws", _websocket)
    app.router.add_get("/healthz", _health)
    app.router.add_get("/sample.png", _sample)
    app.router.add_static("/static/", STATIC, show_index=False)
    app.on_shutdown.append(_close_sockets)
    return app


def _allowed_hosts(settings: GatewaySettings) -> frozenset[str] | None:
    """Host names requests may carry; ``None``: any (a non-loopback bind, where the token guards)."""
    if not is_loopback(settings.host):
        return settings.allow_hosts or None
    return LOOPBACK_NAMES | settings.allow_hosts


@web.middleware
async def _check_host(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                      ) -> web.StreamResponse:
    if not request.headers.get("Host"):  # HTTP/1.0 may omit it; aiohttp then makes up this machine's own name
        raise web.HTTPBadRequest(text="a request must name its Host")
    allowed = _allowed_hosts(request.app[KEY_SETTINGS])
    if allowed is not None and host_name(request.host) not in allowed:
        raise web.HTTPForbidden(text=f"unknown host {request.host!r}: this gateway answers to {sorted(allowed)} "
                                     "(add names with --allow-host)")
    response = await handler(request)
    for name, value in PAGE_HEADERS.items():
        response.headers.setdefault(name, value)
    return response


def _check_token(request: web.Request) -> None:
    token = request.app[KEY_SETTINGS].token
    if token and not hmac.compare_digest(request.query.get("token", "").encode(), token.encode()):
        raise web.HTTPUnauthorized(text="missing or wrong access token: open the URL the gateway printed")


def _check_origin(request: web.Request) -> None:
    """Browsers always send ``Origin`` on a WebSocket: it must be this page's own origin. Clients that are not
    browsers send none; they are not the cross-site risk this guards against (the token guards them)."""
    origin = request.headers.get("Origin")
    if origin is None:
        return
    allowed = request.app[KEY_SETTINGS].allow_origins
    parts = urlsplit(origin)
    if parts.scheme in ("http", "https") and parts.netloc.lower() == request.host.lower():
        return
    if origin.rstrip("/") in allowed:
        return
    raise web.HTTPForbidden(text=f"origin {origin!r} may not open a session here (this page's origin or "
                                 "--allow-origin only)")


async def _index(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(STATIC / "index.html")


async def _sample(request: web.Request) -> web.StreamResponse:
    if not SAMPLE_IMAGE.is_file():
        raise web.HTTPNotFound(text="no sample image in this checkout: pick one")
    return web.FileResponse(SAMPLE_IMAGE)


async def server_ready(endpoint: str, timeout_s: float, token: str | None = None) -> str | None:
    """``None`` when the server (or router) behind the gateway can take a session now, else why not: it answers
    ``stats`` within ``timeout_s``, says it is warm, and (a router) has a replica up."""
    async with AsyncClient(endpoint, timeout_s=timeout_s, heartbeat_s=0, token=token) as client:
        try:
            stats = await client.stats()
        except (TimeoutError, ServerError) as error:
            return f"the server at {endpoint} does not answer ({type(error).__name__})"
    if stats.warm is False:
        return "the server is not warm"
    if stats.total is not UNSET and stats.total.replicas_up == 0:
        return "the router has no replica up"
    return None


async def _health(request: web.Request) -> web.StreamResponse:
    """200 with ``ok: true`` while the server behind the gateway is ready; 503 with ``ok: false`` and why not."""
    _check_token(request)
    settings, slots = request.app[KEY_SETTINGS], request.app[KEY_SLOTS]
    problem = await server_ready(settings.bridge.server, settings.health_timeout_s, settings.bridge.server_token)
    body = {"ok": problem is None, "server": settings.bridge.server, "sessions": slots.used,
            "max_sessions": slots.limit, "tabs": len(request.app[KEY_SOCKETS])}
    if problem is not None:
        body["why_not"] = problem
    return web.json_response(body, status=200 if problem is None else 503)


async def _websocket(request: web.Request) -> web.StreamResponse:
    _check_token(request)
    _check_origin(request)
    settings = request.app[KEY_SETTINGS]
    # max_msg_size is > 0 (pp.Limits refuses less than a start image): aiohttp reads 0 as no limit at all
    ws = web.WebSocketResponse(heartbeat=WS_HEARTBEAT_S, max_msg_size=settings.bridge.limits.max_upload_bytes)
    sockets = request.app[KEY_SOCKETS]
    sockets.add(ws)  # counted from the handshake on: whatever ends this handler (a failed handshake too) uncounts it
    try:
        await ws.prepare(request)
        log.info("tab connected from %s (%d open)", request.remote, len(sockets))
        await Bridge(ws, settings.bridge, request.app[KEY_SLOTS]).run()
    finally:
        sockets.discard(ws)
        log.info("tab gone (%d open)", len(sockets))
    return ws


async def _close_sockets(app: web.Application) -> None:
    """Gateway shutdown: every tab's WebSocket closes (all at once: each close waits for its page's answer), so
    every bridge closes its session on the server."""
    await asyncio.gather(*(ws.close(code=1001, message=b"the gateway is shutting down")
                           for ws in list(app[KEY_SOCKETS]) if ws.prepared), return_exceptions=True)
