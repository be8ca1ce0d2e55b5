"""The operator command: one request to a server or router, with an exit code a probe or a script can act on.

    python -m runtime.ctl stats --endpoint tcp://127.0.0.1:5555       # the stats reply as JSON (or worldstream-ctl)
    python -m runtime.ctl health --probe 127.0.0.1:9100                # GET /health of rank 0's or the router's probes
    python -m runtime.ctl ready --probe http://node7:9100              # GET /ready: 0 ready, 1 not (warming, draining)
    python -m runtime.ctl drain --endpoint tcp://127.0.0.1:5555       # drain as a SIGTERM does: save, hand off, exit 0

Exit codes: 0 ok (healthy, ready, answered); 1 not ready or not healthy (the probe answered, and said no); 2 a usage
error, or nothing answered (no server at the endpoint within --timeout, no probe server at the address); 3 the
server refused the request (``unauthorized``: the client token is missing or another; or any other error reply,
printed as JSON on stderr). The protocol commands present the client token (``--token-file``, else
$WORLDSTREAM_TOKEN, else the file $WORLDSTREAM_TOKEN_FILE names: never the token itself on a command line).

A protocol command is one small function: it builds its request and hands it to ``ask``, which sends it with the
token, waits for the reply of the same request id and maps what happened to the exit code. Torch-free: it runs from
a client-only install.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from ipc import auth, protocol, tolerant

OK, NO, UNREACHABLE, REFUSED = 0, 1, 2, 3  # the exit codes (the module docstring); 2 is argparse's usage error too
OPERATOR_FILE_ENV = "WORLDSTREAM_OPERATOR_TOKEN_FILE"  # drain's default: a file holding the operator token
REQ = 1  # the one request id a command uses (its reply is matched by it)
MAX_REPLY_BYTES = 1 << 26  # a stats reply lists every replica's view; far below this


class Failed(Exception):
    """A command ends with ``code`` and says ``why`` on stderr."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


def ask(args: argparse.Namespace, request: Any, answer: type) -> Any:
    """Send ``request`` (carrying the client token, when there is one) to ``args.endpoint`` and return the reply of
    its request id. An ``error`` reply is ``Failed(REFUSED)``; no reply within ``args.timeout``,
    ``Failed(UNREACHABLE)``."""
    token = auth.client_token(token_file=args.token_file)
    if token is not None:
        request = msgspec.structs.replace(request, auth=token)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
    try:
        sock.connect(args.endpoint)
        sock.send(protocol.encode(request))
        deadline = time.monotonic() + args.timeout
        while (left := deadline - time.monotonic()) > 0 and sock.poll(int(left * 1000)):
            reply = tolerant.decode(sock.recv(), "server", max_bytes=MAX_REPLY_BYTES)
            if getattr(reply, "req", None) != request.req:
                continue  # a job-wide notice, or a newer server's message of a type this side does not know
            if isinstance(reply, protocol.Error):
                print(json.dumps(protocol.to_builtins(reply)), file=sys.stderr)
                raise Failed(REFUSED, f"{args.endpoint} refused {request.__struct_config__.tag}: {reply.code}")
            if not isinstance(reply, answer):  # another kind of reply under our request id: no answer to act on
                raise Failed(UNREACHABLE, f"{args.endpoint} answered {request.__struct_config__.tag} with a "
                                          f"{type(reply).__struct_config__.tag}")
            return reply
    except protocol.ProtocolViolation as error:
        raise Failed(UNREACHABLE, f"{args.endpoint} answered what this side cannot read: {error}") from None
    except zmq.ZMQError as error:
        raise Failed(UNREACHABLE, f"cannot connect to {args.endpoint}: {error}") from None
    finally:
        sock.close()
    raise Failed(UNREACHABLE, f"no answer from {args.endpoint} within {args.timeout:g} s")


def stats(args: argparse.Namespace) -> int:
    """The protocol's ``stats``: the server's (or router's) counters, sessions and ranks, as JSON on stdout."""
    reply = ask(args, protocol.Stats(req=REQ), protocol.StatsReply)
    print(json.dumps(protocol.to_builtins(reply.stats), indent=2))
    return OK


def drain(args: argparse.Namespace) -> int:
    """The protocol's ``drain``, with the server's operator token (``server.operator_token_file``): the server stops
    admitting, saves every session and hands it off, then exits 0 (``server.drain_s``); prints the sessions it hands
    off and the seconds before it stops. A router, or a server without that token, refuses (3)."""
    token = auth.read_token(args.operator_token_file or os.environ.get(OPERATOR_FILE_ENV, ""), what="operator token")
    if token is None:
        raise Failed(UNREACHABLE, f"drain needs the operator token: --operator-token-file or ${OPERATOR_FILE_ENV}")
    reply = ask(args, protocol.Drain(req=REQ, operator=token), protocol.Draining)
    print(json.dumps({"sessions": reply.sessions, "left_s": reply.left_s}))
    return OK


def probe(args: argparse.Namespace, path: str) -> int:
    """GET ``path`` of the probe server at ``args.probe``: its JSON body on stdout; 0 on 200, 1 on another status
    (503: not ready), 2 when nothing answers."""
    base = args.probe if "://" in args.probe else f"http://{args.probe}"
    url = base.rstrip("/") + path
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as answer:
            status, body = answer.status, answer.read()
    except urllib.error.HTTPError as error:  # 503 and the like: the probe answered "no"
        status, body = error.code, error.read()
    except (urllib.error.URLError, OSError, ValueError) as error:
        raise Failed(UNREACHABLE, f"no probe server answers at {url}: {getattr(error, 'reason', error)}") from None
    print(body.decode(errors="replace").strip())
    return OK if status == 200 else NO


def health(args: argparse.Namespace) -> int:
    """``/health``: the process is alive (its probe server answers)."""
    return probe(args, "/health")


def ready(args: argparse.Namespace) -> int:
    """``/ready``: every rank in and warm and not draining (a router: a replica up)."""
    return probe(args, "/ready")


# name -> (what it does, whether it talks the protocol (else HTTP to the probe server), the function)
COMMANDS: dict[str, tuple[str, bool, Callable[[argparse.Namespace], int]]] = {
    "stats": ("the stats reply as JSON", True, stats),
    "health": ("GET /health of the probe server", False, health),
    "ready": ("GET /ready of the probe server (exit 1 while not ready)", False, ready),
    "drain": ("drain the server: save and hand off every session, then exit 0", True, drain),
}


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="worldstream-ctl", description=__doc__.split("\n\n")[0],
                                  epilog="Exit codes: 0 ok, 1 not ready or not healthy, 2 usage error or nothing "
                                         "answered, 3 refused (unauthorized or another error reply).")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (summary, protocol_command, _) in COMMANDS.items():
        sub = commands.add_parser(name, help=summary, description=summary)
        if protocol_command:
            sub.add_argument("--endpoint", default="tcp://127.0.0.1:5555",
                             help="the server's or router's client endpoint (default: %(default)s)")
            sub.add_argument("--token-file", default=None,
                             help=f"a file holding the client token (default ${auth.TOKEN_ENV}, else the file "
                                  f"${auth.TOKEN_FILE_ENV} names)")
        else:
            sub.add_argument("--probe", required=True,
                             help="the probe server: host:port or a URL (metrics.prometheus_host/_port on rank 0, "
                                  "router.metrics_host/_port on the router)")
        if name == "drain":
            sub.add_argument("--operator-token-file", default=None,
                             help=f"a file holding the server's operator token (default: the file ${OPERATOR_FILE_ENV} "
                                  "names)")
        sub.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer (%(default)s)")
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not args.timeout > 0:
        print("worldstream-ctl: --timeout must be > 0", file=sys.stderr)
        return UNREACHABLE
    try:
        return COMMANDS[args.command][2](args)
    except auth.TokenError as error:
        print(f"worldstream-ctl: {error}", file=sys.stderr)
        return UNREACHABLE
    except Failed as failed:
        print(f"worldstream-ctl: {failed}", file=sys.stderr)
        return failed.code


if __name__ == "__main__":
    sys.exit(main())
