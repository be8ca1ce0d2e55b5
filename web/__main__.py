"""Start the web gateway against a running worldstream server and print the page's URL.

    python -m web --server tcp://127.0.0.1:5555                 # http://127.0.0.1:8080/
    python -m web --server tcp://127.0.0.1:5555 --port 0 --token "$(openssl rand -hex 16)"

It binds 127.0.0.1 unless ``--host`` says otherwise (a non-loopback bind needs ``--token``). On a cluster keep it
on loopback and tunnel: ``ssh -N -L 8080:127.0.0.1:8080 node`` on your machine, then open the printed URL there.
Stop it with Ctrl-C or SIGTERM: every tab's session is closed on the server first.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiohttp import web

from ipc import auth
from ipc.aio_client import AsyncClient
from ipc.client_errors import ServerError
from runtime import logs
from web import page_protocol as pp
from web.bridge import BridgeSettings
from web.gateway import GatewaySettings, make_app

TOKEN_ENV = "WORLDSTREAM_WEB_TOKEN"
MAX_UPLOAD_MB = 1024.0  # far beyond any start image; a bound all the same (inf is not one)
SHUTDOWN_S = 20.0  # on SIGTERM, tabs get this long to close their sessions before their handlers are cancelled


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m web", description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", default="tcp://127.0.0.1:5555", help="the worldstream server's endpoint")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=8080, help="port to bind; 0 picks a free one")
    parser.add_argument("--token", default=os.environ.get(TOKEN_ENV),
                        help=f"access token the page must carry (default ${TOKEN_ENV}; required off loopback)")
    parser.add_argument("--server-token-file", default="",
                        help="a file holding the client token the server (or router) requires; default "
                             f"${auth.TOKEN_ENV}, else the file ${auth.TOKEN_FILE_ENV} names (never the token itself "
                             "on the command line)")
    parser.add_argument("--max-sessions", type=int, default=4, help="sessions this gateway holds at once")
    parser.add_argument("--format", choices=sorted(pp.FORMATS), default="jpeg", help="frame encoding")
    parser.add_argument("--quality", type=int, default=80, help="JPEG/WebP quality 1..100")
    parser.add_argument("--max-upload-mb", type=float, default=8.0,
                        help=f"largest start image upload (at least {pp.MIN_UPLOAD_BYTES / 2**20:g}; it also bounds "
                             "every WebSocket message)")
    parser.add_argument("--allow-host", action="append", default=[], help="extra Host name to answer to")
    parser.add_argument("--allow-origin", action="append", default=[],
                        help="extra WebSocket origin allowed to open sessions, e.g. https://example.org")
    parser.add_argument("--port-file", type=Path, help="write the bound port here once serving (for scripts)")
    parser.add_argument("--check-timeout", type=float, default=10.0,
                        help="seconds to wait at start for the server to answer (0: do not check)")
    parser.add_argument("--health-timeout", type=float, default=2.0,
                        help="seconds /healthz waits for the server's stats before answering 503")
    parser.add_argument("--log-level", default=os.environ.get("WORLDSTREAM_LOG", "INFO"),
                        help="DEBUG, INFO, WARNING or ERROR (default: $WORLDSTREAM_LOG, else INFO)")
    parser.add_argument("--log-format", choices=logs.FORMATS, default=logs.default_format(),
                        help="text lines, or one JSON object a line (default: $WORLDSTREAM_LOG_FORMAT, else text)")
    args = parser.parse_args(argv)
    if not 1 <= args.quality <= 100:
        parser.error(f"--quality must be in 1..100, got {args.quality}")
    if not pp.MIN_UPLOAD_BYTES <= args.max_upload_mb * 2**20 <= MAX_UPLOAD_MB * 2**20:  # NaN fails too
        parser.error(f"--max-upload-mb must be in {pp.MIN_UPLOAD_BYTES / 2**20:g}..{MAX_UPLOAD_MB} (a real bound: "
                     f"0 would lift the WebSocket message limit), got {args.max_upload_mb:g}")
    if args.max_sessions < 1:
        parser.error(f"--max-sessions must be >= 1, got {args.max_sessions}")
    if not args.health_timeout > 0:
        parser.error(f"--health-timeout must be > 0, got {args.health_timeout}")
    return args


def settings_of(args: argparse.Namespace) -> GatewaySettings:
    bridge = BridgeSettings(server=args.server, frame_format=args.format, quality=args.quality,
                            limits=pp.Limits(max_upload_bytes=int(args.max_upload_mb * 2**20)),
                            server_token=auth.client_token(token_file=args.server_token_file))
    return GatewaySettings(bridge=bridge, host=args.host, max_sessions=args.max_sessions, token=args.token or None,
                           allow_hosts=frozenset(h.lower() for h in args.allow_host),
                           allow_origins=frozenset(o.rstrip("/") for o in args.allow_origin),
                           health_timeout_s=args.health_timeout)


async def check_server(endpoint: str, timeout_s: float, token: str | None = None) -> str | None:
    """``None`` when the server answers ``stats`` in time, else why not."""
    async with AsyncClient(endpoint, timeout_s=timeout_s, heartbeat_s=0, token=token) as client:
        try:
            stats = await client.stats()
        except TimeoutError:
            return f"no worldstream server answers at {endpoint} (waited {timeout_s:.0f} s): start one first " \
                   "(python launch.py --config cpu-tiny), or give --server"
        except ServerError as error:  # ``unauthorized``: a token missing or another
            return f"the server at {endpoint} refused: {error.code} (its client token: --server-token-file)"
    logging.getLogger("worldstream.web").info("server %s: layout %s, %s open sessions", endpoint,
                                              stats.layout, stats.open_sessions)
    return None


async def serve(args: argparse.Namespace) -> int:
    try:
        settings = settings_of(args)
        app = make_app(settings)
    except ValueError as error:  # an unreadable token file too (``auth.TokenError``)
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.check_timeout > 0:
        problem = await check_server(args.server, args.check_timeout, settings.bridge.server_token)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=SHUTDOWN_S)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = runner.addresses[0][1]
    shown = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{shown}:{port}/" + (f"?token={settings.token}" if settings.token else "")
    print(f"worldstream web gateway: {url}  (server {args.server}; Ctrl-C to stop)", flush=True)
    # the log line leaves the token out (the printed URL is for the person who started it)
    logging.getLogger("worldstream.web").info("gateway on http://%s:%d/ for server %s", shown, port, args.server)
    if args.port_file:
        args.port_file.write_text(str(port))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("stopping: closing every tab's session", flush=True)
    await runner.cleanup()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(sig)  # the loop closes next; a late signal must not write to its wake-up fd
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logs.configure("gateway", args.log_level, args.log_format)
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
