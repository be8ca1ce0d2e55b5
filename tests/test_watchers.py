"""Spectators without processes: the watcher bookkeeping (``runtime.watchers.Watchers``), each watcher's outbox
(``Feeds``) with a send that fails the way a ROUTER socket does, and the coordinator core's rules for watchers
(played by ``tests.core_job.Job``)."""

from __future__ import annotations

from typing import Any

import pytest

from ipc import protocol as p
from runtime.client_types import ClientError, ClientSent, ClientUnreachable, EndWatch, Tick
from runtime.core_types import EmitChunk
from runtime.watchers import Feeds, Watchers
from tests.core_job import A, B, Job, control

W1, W2, W3 = b"watcher-1", b"watcher-2", b"watcher-3"


def refusal(call: Any) -> tuple[str, str]:
    with pytest.raises(ClientError) as caught:
        call()
    return caught.value.code, str(caught.value)


# ---- Watchers


def test_tokens_are_long_random_and_differ_per_session() -> None:
    watchers = Watchers(8, 10.0)
    tokens = {watchers.grant(f"s{i}") for i in range(50)}
    assert len(tokens) == 50 and all(len(t) >= 32 for t in tokens)


def test_a_wrong_token_and_an_unknown_session_get_the_same_words() -> None:
    watchers = Watchers(8, 10.0)
    token = watchers.grant("s1")
    last = "x" if token[-1] != "x" else "y"  # a token may end with x
    wrong = refusal(lambda: watchers.watch(W1, "s1", token[:-1] + last, 0.0))
    unknown = refusal(lambda: watchers.watch(W1, "s2", token, 0.0))
    assert wrong[0] == unknown[0] == "unknown_session"
    assert wrong[1].replace("s1", "?") == unknown[1].replace("s2", "?")  # nothing tells the two apart
    watchers.watch(W1, "s1", token, 0.0)
    assert watchers.of("s1") == (W1,)


def test_watchers_beyond_the_limit_are_refused_busy_and_a_repeated_watch_takes_no_seat() -> None:
    watchers = Watchers(2, 10.0)
    token = watchers.grant("s1")
    watchers.watch(W1, "s1", token, 0.0)
    watchers.watch(W1, "s1", token, 0.1)  # again: still one seat
    watchers.watch(W2, "s1", token, 0.0)
    code, text = refusal(lambda: watchers.watch(W3, "s1", token, 0.0))
    assert code == "busy" and "limit of 2 watchers" in text
    watchers.unwatch(W1, "s1")
    watchers.watch(W3, "s1", token, 0.0)  # a seat freed
    assert watchers.of("s1") == (W2, W3)


def test_the_owner_cannot_watch_its_own_session_and_a_watcher_cannot_act_on_it() -> None:
    watchers = Watchers(8, 10.0)
    token = watchers.grant("s1")
    assert refusal(lambda: watchers.watch(A, "s1", token, 0.0, owner=A))[0] == "bad_request"
    watchers.watch(W1, "s1", token, 0.0, owner=A)
    code, text = refusal(lambda: watchers.refuse(W1, "s1", "control"))
    assert code == "watch_only" and "only its owner can send control" in text
    watchers.refuse(A, "s1", "control")  # the owner is not a watcher: nothing to refuse
    watchers.refuse(W1, "s2", "close")  # another session: not this rule's business


def test_unwatching_a_session_not_watched_is_refused() -> None:
    watchers = Watchers(8, 10.0)
    watchers.grant("s1")
    assert refusal(lambda: watchers.unwatch(W1, "s1"))[0] == "unknown_session"


def test_silent_watchers_are_dropped_and_hearing_from_one_keeps_it() -> None:
    watchers = Watchers(8, 2.0)
    t1, t2 = watchers.grant("s1"), watchers.grant("s2")
    watchers.watch(W1, "s1", t1, 0.0)
    watchers.watch(W1, "s2", t2, 0.0)
    watchers.watch(W2, "s1", t1, 0.5)
    watchers.heard(W2, 1.9)
    assert watchers.silent(2.0) == []
    assert sorted(watchers.silent(2.5)) == [(W1, "s1"), (W1, "s2")]
    assert watchers.of("s1") == (W2,) and watchers.of("s2") == ()
    watchers.heard(W1, 3.0)  # no longer a watcher: not remembered again
    assert watchers.silent(10.0) == [(W2, "s1")] and watchers.count() == 0


def test_an_ended_session_returns_its_watchers_and_its_token_is_void() -> None:
    watchers = Watchers(8, 10.0)
    token = watchers.grant("s1")
    watchers.watch(W1, "s1", token, 0.0)
    watchers.watch(W2, "s1", token, 0.0)
    assert watchers.end("s1") == (W1, W2)
    assert watchers.count() == 0 and watchers.silent(100.0) == []
    assert refusal(lambda: watchers.watch(W1, "s1", token, 0.0))[0] == "unknown_session"


# ---- Feeds


class Peer:
    """A ROUTER peer as a non-blocking send sees it: takes up to ``room`` messages, then "full" (or "gone")."""

    def __init__(self, room: int = 1_000) -> None:
        self.room = room
        self.got: list[Any] = []
        self.gone = False

    def send(self, who: bytes, item: Any) -> str | None:
        if self.gone:
            return "gone"
        if len(self.got) >= self.room:
            return "full"
        self.got.append(item)
        return None


def test_a_slow_watcher_drops_its_oldest_chunks_and_is_told_how_many_before_the_next() -> None:
    feeds, peer = Feeds(bound=2), Peer(room=1)
    for i in range(6):
        feeds.put(W1, "s1", f"chunk{i}")
        feeds.flush(peer.send, 0.0)
    assert peer.got == ["chunk0"]  # its queue took one; of the five after it, the newest two wait
    assert [*feeds.feeds[(W1, "s1")].chunks] == ["chunk4", "chunk5"] and feeds.dropped == 3
    peer.room = 100  # it reads again
    feeds.flush(peer.send, 0.0)
    assert peer.got[1:] == [p.Missed(session="s1", chunks=3, total=3), "chunk4", "chunk5"]
    feeds.put(W1, "s1", "chunk6")
    feeds.flush(peer.send, 0.0)
    assert peer.got[-1] == "chunk6"  # nothing missed since: no notice


def test_one_slow_watcher_never_holds_back_another() -> None:
    feeds, slow, fast = Feeds(bound=2), Peer(room=0), Peer()

    def send(who: bytes, item: Any) -> str | None:
        return (slow if who == W1 else fast).send(who, item)

    for i in range(10):
        for who in (W1, W2):
            feeds.put(who, "s1", i)
        feeds.flush(send, 0.0)
    assert fast.got == list(range(10)) and slow.got == []
    assert feeds.feeds[(W1, "s1")].total == 8


def test_an_ending_feed_sends_its_last_chunks_then_its_closed_and_is_forgotten() -> None:
    feeds, peer = Feeds(bound=4), Peer(room=0)
    closed = p.Closed(session="s1", reason="complete")
    feeds.put(W1, "s1", "last")
    feeds.end(W1, "s1", closed, keep=True, now=0.0)
    feeds.put(W1, "s1", "late")  # nothing after the end
    feeds.flush(peer.send, 0.0)
    peer.room = 10
    feeds.flush(peer.send, 0.1)
    assert peer.got == ["last", closed] and not feeds.feeds


def test_an_unwatch_discards_what_waits_and_a_watcher_that_never_reads_is_forgotten() -> None:
    feeds, peer = Feeds(bound=4, linger_s=5.0), Peer(room=0)
    feeds.put(W1, "s1", "a")
    feeds.put(W1, "s1", "b")
    closed = p.Closed(session="s1", reason="unwatched")
    feeds.end(W1, "s1", closed, keep=False, now=1.0)
    assert feeds.flush(peer.send, 2.0) == [] and [*feeds.feeds[(W1, "s1")].chunks] == []
    feeds.flush(peer.send, 6.5)  # past linger_s: it never read its closed
    assert not feeds.feeds


def test_a_watcher_that_disconnected_is_reported_gone_and_its_feed_dropped() -> None:
    feeds, peer = Feeds(), Peer()
    peer.gone = True
    feeds.put(W1, "s1", "a")
    assert feeds.flush(peer.send, 0.0) == [(W1, "s1")] and not feeds.feeds


# ---- the coordinator core


def watched(job: Job, *watchers: bytes) -> tuple[str, str]:
    sid = job.open(A)
    (opened,) = job.to(A, p.Opened)
    for who in watchers:
        job.send(who, p.Watch(req=next(job.req), session=sid, token=opened.watch_token))
    return sid, opened.watch_token


def test_a_watcher_is_answered_with_the_geometry_and_named_on_every_later_chunk() -> None:
    job = Job()
    sid = job.open(A)
    control(job, sid, 0)
    job.chunk(sid, 0)
    (opened,) = job.to(A, p.Opened)
    job.send(W1, p.Watch(req=41, session=sid, token=opened.watch_token))
    (watching,) = job.to(W1, p.Watching)
    assert (watching.req, watching.session, watching.height, watching.width) == (41, sid, 160, 256)
    control(job, sid, 1)
    job.chunk(sid, 1)
    first, second = job.emitted(sid)
    assert first.watchers == () and second.watchers == (W1,) and second.to == A


def test_a_watcher_control_or_close_is_refused_watch_only_and_changes_nothing() -> None:
    job = Job()
    sid, _ = watched(job, W1)
    out = job.send(W1, p.Control(req=5, session=sid, index=0, control=p.ChunkControl()))
    out += job.send(W1, p.Close(req=6, session=sid))
    assert [e.code for e in job.to(W1, p.Error, out)] == ["watch_only", "watch_only"]
    assert job.core.scheduler.next_control_index(sid) == 0 and sid in job.core.sessions
    control(job, sid, 0)  # its owner still can
    assert job.core.scheduler.next_control_index(sid) == 1


def test_watchers_get_their_own_closed_after_the_session_ends_and_on_unwatch() -> None:
    job = Job()
    sid, _ = watched(job, W1, W2)
    out = job.send(W1, p.Unwatch(req=9, session=sid))
    ((end,),) = [[o for o in out if isinstance(o, EndWatch)]]
    assert (end.identity, end.closed.reason, end.keep) == (W1, "unwatched", False)
    job.play({A: sid}, 4)
    ends = [o for o in job.log if isinstance(o, EndWatch) and o.identity == W2]
    assert [(e.closed.reason, e.keep) for e in ends] == [("complete", True)]
    assert all(o.watchers == (W2,) for o in job.emitted(sid))  # W1 left before the first chunk


def test_a_disconnected_or_silent_watcher_is_dropped_without_touching_the_session() -> None:
    job = Job(server={"client_timeout_s": 1.0})
    sid, _ = watched(job, W1, W2)
    job.step(ClientUnreachable(W1, sid, "gone"))
    assert job.core.watchers.of(sid) == (W2,) and sid in job.core.sessions
    job.step(ClientSent(A, p.Heartbeat()), dt=1.5)  # the owner is heard; the watcher has been silent since
    out = job.step(Tick())
    ends = [o for o in out if isinstance(o, EndWatch)]
    assert [(e.identity, e.closed.reason) for e in ends] == [(W2, "disconnect")]
    assert job.core.watchers.count() == 0


def test_a_watcher_refused_busy_beyond_max_watchers() -> None:
    job = Job(server={"max_watchers": 1})
    sid, token = watched(job, W1)
    out = job.send(W2, p.Watch(req=3, session=sid, token=token))
    (error,) = job.to(W2, p.Error, out)
    assert error.code == "busy" and "limit of 1 watchers" in error.message and error.retry_after_s
    out = job.send(B, p.Watch(req=4, session=sid, token="nope"))
    assert [e.code for e in job.to(B, p.Error, out)] == ["unknown_session"]
    assert not [o for o in job.log if isinstance(o, EmitChunk)]
