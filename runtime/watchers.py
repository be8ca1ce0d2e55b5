"""Spectators of running sessions, for both cores and both shells (runtime/core.py, runtime/router.py and their
ranks/ shells). Pure: no socket, no clock (``now`` comes with every call); beside ``runtime.clients``, which keeps
the owners.

- **Who may watch** (``Watchers``, in a core). Each session gets a watch token when it is opened (unguessable:
  ``secrets.token_urlsafe``); its owner shares it. ``watch`` with the right token subscribes read-only from the
  session's next chunk; a wrong token and an unknown session get the same ``unknown_session`` words (a token
  reveals nothing about which sessions exist); tokens are compared in constant time. At most ``max_watchers`` per
  session (one more: ``busy``). A watcher cannot act on the session (``refuse``: ``watch_only`` for its controls,
  its close, anything but ``unwatch``). A watcher silent past the client timeout is dropped (``silent``); so is
  one whose identity disconnected (the shell's send says "gone"). When the session ends its watchers get
  ``closed`` (``end``). Memory: at most ``max_watchers`` per session, the sessions being bounded by the core.
- **What a watcher is sent** (``Feeds``, in a shell). Each watcher has its own outbox of at most ``bound`` chunks in
  front of its ZeroMQ queue (``server.send_hwm`` messages). A chunk that finds it full drops the oldest one waiting
  (counted); before the next chunk it gets, a watcher is told how many it missed (``protocol.Missed``). Sends never
  block (the shell's send is non-blocking): a watcher that does not read only loses chunks, so the player's
  emission and the other watchers never wait for it. A payload is kept as the shell made it (encoded once per
  chunk and shared by the player and every watcher; the router's is the replica's frame, never decoded).
"""

from __future__ import annotations

import hmac
import secrets
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ipc import protocol
from ipc.error_codes import ErrorCode
from runtime.client_types import ClientError, EndWatch, ToClient
from runtime.parts import Answer, Ending, Part

if TYPE_CHECKING:
    from runtime.session import Session

MAX_WATCHERS = 8  # per session, the default of [server] max_watchers and [router] max_watchers
FEED_CHUNKS = 2  # chunks waiting for one watcher beyond its ZeroMQ queue; more drop the oldest
BUSY_RETRY_S = 5.0  # hint to a watcher refused at the limit
Send = Callable[[bytes, Any], str | None]  # (identity, payload or message) -> None, "gone" or "full"


def new_token() -> str:
    return secrets.token_urlsafe(24)  # 192 bits


class Watchers(Part):
    """The watchers of each session and their tokens (see the module docstring); on rank 0 a part of each session
    (``runtime.parts``): its end ends its watchers."""

    def __init__(self, max_watchers: int, timeout_s: float, make_token: Callable[[], str] = new_token) -> None:
        self.max_watchers = max_watchers
        self.timeout_s = timeout_s
        self.make_token = make_token
        self.tokens: dict[str, str] = {}  # session -> its watch token, while it runs
        self._of: dict[str, dict[bytes, None]] = {}  # session -> its watchers, in the order they came
        self._heard: OrderedDict[bytes, float] = OrderedDict()  # watcher identity -> last heard, oldest first
        self._watching: dict[bytes, dict[str, None]] = {}  # watcher identity -> the sessions it watches

    def grant(self, sid: str, token: str | None = None) -> str:
        """``sid`` can be watched from now on; its token (a new one, or ``token``: the router keeps its replica's)."""
        self.tokens[sid] = token if token is not None else self.make_token()
        return self.tokens[sid]

    def watch(self, who: bytes, sid: str, token: str, now: float, owner: bytes | None = None) -> None:
        """Subscribe ``who`` to ``sid`` (again: nothing changes). ``owner``: the session's client, which cannot
        watch its own session (it gets every chunk already)."""
        expected = self.tokens.get(sid)
        if expected is None or not hmac.compare_digest(token.encode(), expected.encode()):
            raise ClientError(ErrorCode.UNKNOWN_SESSION, f"no session {sid!r} to watch with this token")
        if who == owner:
            raise ClientError(ErrorCode.BAD_REQUEST, f"this client owns session {sid}: its chunks come to it already")
        watchers = self._of.setdefault(sid, {})
        if who in watchers:
            self.heard(who, now)
            return
        if len(watchers) >= self.max_watchers:
            raise ClientError(ErrorCode.BUSY, f"session {sid} has its limit of {self.max_watchers} watchers "
                              "(server.max_watchers)", retry_after_s=BUSY_RETRY_S)
        watchers[who] = None
        self._watching.setdefault(who, {})[sid] = None
        self._heard[who] = now
        self._heard.move_to_end(who)

    def unwatch(self, who: bytes, sid: str) -> None:
        if not self.remove(who, sid):
            raise ClientError(ErrorCode.UNKNOWN_SESSION, f"this client does not watch session {sid!r}")

    def unwatched(self, who: bytes, sid: str) -> EndWatch:
        """``unwatch``: ``who`` stops watching ``sid``, its feed ended at once with a ``closed`` of its own."""
        self.unwatch(who, sid)
        return EndWatch(who, sid, protocol.Closed(session=sid, reason="unwatched"), keep=False)

    def watches(self, who: bytes, sid: str) -> bool:
        return who in self._of.get(sid, ())

    def refuse(self, who: bytes, sid: str | None, kind: str) -> None:
        """``watch_only`` when ``who`` watches ``sid`` (it can only look: a control, a close, ... is its owner's)."""
        if sid is not None and self.watches(who, sid):
            raise ClientError(ErrorCode.WATCH_ONLY,
                              f"this client watches session {sid}: only its owner can send {kind}")

    def of(self, sid: str) -> tuple[bytes, ...]:
        """The watchers of ``sid``, in the order they came."""
        return tuple(self._of.get(sid, ()))

    def count(self) -> int:
        return sum(len(w) for w in self._of.values())

    def heard(self, who: bytes, now: float) -> None:
        """Any message from ``who``: a watcher's timeout starts again (others are not kept here)."""
        if who in self._heard:
            self._heard[who] = now
            self._heard.move_to_end(who)

    def silent(self, now: float) -> list[tuple[bytes, str]]:
        """Every (watcher, session) whose watcher was silent past the timeout, removed; the longest silent first."""
        silent: list[bytes] = []
        for who, heard in self._heard.items():
            if now - heard <= self.timeout_s:
                break  # in order of last heard: every later one was heard more recently
            silent.append(who)
        out = [(who, sid) for who in silent for sid in self._watching[who]]
        for who, sid in out:
            self.remove(who, sid)
        return out

    def end(self, sid: str) -> tuple[bytes, ...]:
        """``sid`` ended: its token is void and its watchers (returned, to be told) are removed."""
        self.tokens.pop(sid, None)
        watchers = self.of(sid)
        for who in watchers:
            self.remove(who, sid)
        return watchers

    def watching(self, who: bytes, message: protocol.Watch, session: Session | None, fps: float,
                 now: float) -> ToClient:  # fmt: skip
        """A spectator subscribes (``watch``): its ``watching`` names the session's geometry now."""
        self.watch(who, message.session, message.token, now, None if session is None else session.client)
        assert session is not None  # a token exists only while its session runs
        return ToClient(who, protocol.Watching(req=message.req, **session.header(fps).as_fields()))

    def ended(self, sid: str, reason: str, error: str | None, keep: bool) -> list[EndWatch]:
        """``sid`` ended (or the server stops): each of its watchers gets a ``closed`` of its own (``keep``: after
        the chunks its feed still holds)."""
        return [EndWatch(who, sid, protocol.Closed(session=sid, reason=reason, error=error), keep)
                for who in self.end(sid)]

    def ending(self, sid: str, now: float, end: Ending) -> list[Answer]:
        """A closed session's watchers get their ``closed`` after its last chunks; a dropped one's at once."""
        return list(self.ended(sid, end.reason, end.error, keep=not end.dropped))

    def ended_all(self, reason: str, error: str) -> list[EndWatch]:
        """The server stops: every watcher of every session gets its ``closed`` now."""
        return [end for sid in list(self.tokens) for end in self.ended(sid, reason, error, keep=False)]

    def remove(self, who: bytes, sid: str) -> bool:
        """``who`` no longer watches ``sid``; False when it did not."""
        watchers = self._of.get(sid)
        if watchers is None or who not in watchers:
            return False
        del watchers[who]
        if not watchers:
            del self._of[sid]
        sessions = self._watching[who]
        del sessions[sid]
        if not sessions:
            del self._watching[who]
            del self._heard[who]
        return True


# ---------------------------------------------------------------------------------------------- shells


@dataclass
class Feed:
    """One watcher's outbox for one session."""

    chunks: deque[Any] = field(default_factory=deque)  # payloads waiting, oldest first
    missed: int = 0  # chunks dropped since the last one sent (told in a ``Missed`` before the next)
    total: int = 0  # chunks dropped so far
    final: Any = None  # the ``closed`` that ends the feed, sent after the chunks waiting
    expires: float = float("inf")  # once ending: a watcher that does not read its closed by then is forgotten


class Feeds:
    """Every watcher's outbox in a shell (see the module docstring). Keys are (watcher identity, session)."""

    def __init__(self, bound: int = FEED_CHUNKS, linger_s: float = 10.0) -> None:
        self.bound = max(1, bound)
        self.linger_s = linger_s  # an ending feed waits this long for its watcher to read
        self.feeds: dict[tuple[bytes, str], Feed] = {}
        self.dropped = 0  # chunks dropped for slow watchers, all feeds together (stats)

    def put(self, who: bytes, sid: str, payload: Any) -> None:
        """A chunk for a watcher: queued, the oldest one waiting dropped when the outbox is full."""
        feed = self.feeds.setdefault((who, sid), Feed())
        if feed.final is not None:
            return  # it is ending: nothing more is sent before its closed
        if len(feed.chunks) >= self.bound:
            feed.chunks.popleft()
            feed.missed += 1
            feed.total += 1
            self.dropped += 1
        feed.chunks.append(payload)

    def end(self, who: bytes, sid: str, final: Any, keep: bool, now: float) -> None:
        """The watcher's stream ends with ``final`` (its ``closed``): after the chunks waiting (``keep``: the
        session's last chunks) or instead of them (it unwatched, timed out, the server stops). A watcher that has
        not read it ``linger_s`` later is forgotten (nothing is held for good for one that never reads)."""
        feed = self.feeds.setdefault((who, sid), Feed())
        if not keep:
            feed.chunks.clear()
            feed.missed = 0
        feed.final, feed.expires = final, now + self.linger_s

    def drop(self, who: bytes, sid: str) -> None:
        self.feeds.pop((who, sid), None)

    def flush(self, send: Send, now: float) -> list[tuple[bytes, str]]:
        """Send what each feed holds, oldest first, until its watcher's queue is full; feeds that sent their
        ``closed`` (or waited past ``linger_s`` for it) are forgotten. Returns the (watcher, session) whose identity
        is gone (their feeds are dropped)."""
        gone: list[tuple[bytes, str]] = []
        for key in list(self.feeds):
            feed = self.feeds[key]
            why = self._flush_one(key, feed, send)
            if why == "gone":
                gone.append(key)
            if why in ("gone", "done") or now > feed.expires:
                del self.feeds[key]
        return gone

    def _flush_one(self, key: tuple[bytes, str], feed: Feed, send: Send) -> str | None:
        who, sid = key
        while feed.chunks:
            if feed.missed:
                why = send(who, protocol.Missed(session=sid, chunks=feed.missed, total=feed.total))
                if why is not None:
                    return why
                feed.missed = 0
            why = send(who, feed.chunks[0])
            if why is not None:
                return why
            feed.chunks.popleft()
        if feed.final is not None:
            why = send(who, feed.final)
            return "done" if why is None else why
        return None

    def __iter__(self) -> Iterator[tuple[bytes, str]]:
        return iter(self.feeds)
