"""A loopback TCP port for a process about to be started (a server, a router, a probe server, a rendezvous).

A port the kernel hands out for ``bind(0)`` comes from the ephemeral range, the same range every outgoing connection
takes its local port from: between the pick and the child's bind, any connection on the machine may take it (one
did: a shared test server's probe port, picked at import, was taken by a client's connection minutes later). So
the port is drawn at random below that range, where the kernel never assigns one by itself, and checked free."""

from __future__ import annotations

import random
import socket
from pathlib import Path

FLOOR = 20000  # below: well-known and registered services more often listen
_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_draw = random.SystemRandom()  # never the tests' seeded ``random``: two processes must not draw the same sequence


def ephemeral_floor() -> int:
    """The lowest port the kernel assigns by itself (Linux's setting; 32768, its default, elsewhere)."""
    try:
        return int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def bindable(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, outside the ephemeral range when there is room below it."""
    ceiling = ephemeral_floor()
    if ceiling - FLOOR >= 1000:
        for _ in range(100):
            port = _draw.randrange(FLOOR, ceiling)
            if bindable(port, host):
                return port
    with socket.socket() as sock:  # no room below the range (or all taken): the kernel's pick
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
