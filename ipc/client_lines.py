"""What a server (the coordinator, the router) sends its clients when their ZeroMQ queue is full: a line each.

A ROUTER's send queue per client (``server.send_hwm`` messages) bounds what a client that does not read costs (a
480x832 chunk is 14 MB). But a burst of requests is answered within one loop turn, faster than ZeroMQ moves the
replies onto the wire, so replies beyond that queue used to be lost, and a lost reply that named a session closed the
session as if its client had stopped reading. The rules here:

- **Replies and notices wait, never vanish.** One that finds the client's queue full waits in the client's line, and
  everything sent to that client afterwards waits behind it: the client reads in the order the core chose. Each loop
  turn ``flush`` sends what the queue takes.
- **Only a stream that is not read drops a client.** A chunk that finds the queue full waits in the line too (a queue
  full of replies says nothing about the stream), but a second chunk while one still waits means the client has not
  read a queue of messages plus a whole chunk: it stopped reading its stream (``full``, its session is closed).
- **Bounded.** At most ``max_waiting`` messages, and ``MAX_WAITING_BYTES`` of them besides the one chunk, wait per
  client (a client that sends that many requests without reading one answer stopped reading too). Memory per
  client: that and one chunk.
- **A dropped client is told.** Its line is replaced by one ``not_reading`` error per session it loses, delivered
  if it reads again (it may: a debugger, a frozen tab).
- **Gone** (disconnected): its line is dropped; the sessions named in it are reported ``gone`` (they may resume).

Owned by the loop thread that owns the client socket. The socket is behind ``send`` (``ipc.transport.send_or_why``
on rank 0, the router's own): tests play the client's queue with a plain function.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ipc import protocol

log = logging.getLogger(__name__)

Why = Literal["gone", "full"]
# (identity, data) -> None when queued, else "gone" or "full"; data: bytes, or a zmq.Frame forwarded as received
Send = Callable[[bytes, Any], "str | None"]
MAX_WAITING = 1024  # messages waiting per client (``server.max_waiting``; the router's too)
MAX_WAITING_BYTES = 16 << 20  # bytes of replies and notices waiting per client (a stats reply is a few KB)
NOT_READING = "not_reading"  # the error code of a client dropped because it stopped reading


@dataclass(frozen=True)
class Lost:
    """A session whose client cannot be sent to: ``gone`` (disconnected, may resume) or ``full`` (not reading)."""

    identity: bytes
    session: str
    why: Why


@dataclass
class _Waiting:
    data: Any  # bytes, or a zmq.Frame forwarded as received (the router)
    session: str | None
    chunk: bool


class ClientLines:
    """Per-client lines of messages that met a full queue (see the module docstring)."""

    def __init__(self, send: Send, max_waiting: int = MAX_WAITING, max_bytes: int = MAX_WAITING_BYTES) -> None:
        self._send = send
        self.max_waiting = max_waiting
        self.max_bytes = max_bytes
        self._lines: dict[bytes, deque[_Waiting]] = {}
        self._bytes: dict[bytes, int] = {}  # what waits in each line besides chunks

    def waiting(self, who: bytes) -> int:
        line = self._lines.get(who)
        return 0 if line is None else len(line)

    def send(self, who: bytes, data: Any, session: str | None, chunk: bool = False) -> list[Lost]:
        """Send to ``who`` now, or queue it behind what already waits for it. Returns the sessions lost by it."""
        line = self._lines.get(who)
        if line is None:
            why = self._send(who, data)
            if why is None:
                return []
            if why == "gone":
                return [] if session is None else [Lost(who, session, "gone")]
            line = self._lines[who] = deque()
        elif (len(line) >= self.max_waiting or (chunk and any(w.chunk for w in line))  # a chunk waits: not read
              or (not chunk and self._bytes.get(who, 0) + len(data) > self.max_bytes)):
            return self._drop(who, line, session)
        line.append(_Waiting(data, session, chunk))
        if not chunk:
            self._bytes[who] = self._bytes.get(who, 0) + len(data)
        return []

    def flush(self) -> list[Lost]:
        """Send what each client's queue takes now, in order, never waiting. Returns the sessions lost meanwhile."""
        lost: list[Lost] = []
        for who in list(self._lines):
            line = self._lines[who]
            while line:
                why = self._send(who, line[0].data)
                if why == "full":
                    break
                if why == "gone":  # disconnected: what waits is dropped as a send to it would be
                    self.forget(who)
                    lost += [Lost(who, sid, "gone") for sid in _sessions(line)]
                    break
                sent = line.popleft()
                if not sent.chunk:
                    self._bytes[who] -= len(sent.data)
            if not line and who in self._lines:
                self.forget(who)
        return lost

    def forget(self, who: bytes) -> None:
        self._lines.pop(who, None)
        self._bytes.pop(who, None)

    def _drop(self, who: bytes, line: deque[_Waiting], session: str | None) -> list[Lost]:
        sessions = _sessions(line, session)
        log.info("client %s stopped reading: %d messages wait for it; dropping them and its sessions %s",
                 who.decode(errors="replace"), len(line), sessions)
        told = [protocol.Error(session=sid, code=NOT_READING,
                               message=f"this client did not read {len(line)} messages: session {sid} was closed")
                for sid in sessions] or [protocol.Error(code=NOT_READING, message=f"this client did not read "
                                                        f"{len(line)} messages: they were dropped")]
        self._lines[who] = deque(_Waiting(protocol.encode(error), None, False) for error in told)
        self._bytes[who] = sum(len(w.data) for w in self._lines[who])
        return [Lost(who, sid, "full") for sid in sessions]


def _sessions(line: deque[_Waiting], also: str | None = None) -> list[str]:
    """The sessions named in ``line`` (then ``also``), each once, in order."""
    named = dict.fromkeys(w.session for w in line if w.session is not None)
    if also is not None:
        named[also] = None
    return list(named)
