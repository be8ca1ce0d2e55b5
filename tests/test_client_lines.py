"""The rules of ``ipc.client_lines``: a client's queue is played by a counter (``Queue``) standing for the ROUTER's
per-peer send queue; the multi-process burst tests (tests/test_burst.py) run the same class behind a real socket."""

from __future__ import annotations

from ipc import protocol
from ipc.client_lines import NOT_READING, ClientLines, Lost

A, B = b"client-a", b"client-b"


class Queue:
    """The send queues of a ROUTER's peers: ``room`` messages each, emptied when the peer ``reads``."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.queued: dict[bytes, list[bytes]] = {}
        self.gone: set[bytes] = set()
        self.read: dict[bytes, list[bytes]] = {}

    def send(self, who: bytes, data: bytes) -> str | None:
        if who in self.gone:
            return "gone"
        queue = self.queued.setdefault(who, [])
        if len(queue) >= self.room:
            return "full"
        queue.append(data)
        return None

    def reads(self, who: bytes) -> list[bytes]:
        got, self.queued[who] = self.queued.get(who, []), []
        self.read.setdefault(who, []).extend(got)
        return got


def reply(req: int) -> bytes:
    return protocol.encode(protocol.Error(req=req, code="x", message=str(req)))


def test_a_burst_of_replies_beyond_the_queue_waits_and_arrives_in_order() -> None:
    queue = Queue(room=4)
    lines = ClientLines(queue.send, max_waiting=100)
    for req in range(64):
        assert lines.send(A, reply(req), "s1") == []
    assert lines.waiting(A) == 60
    while lines.waiting(A):
        queue.reads(A)
        assert lines.flush() == []
    queue.reads(A)
    assert queue.read[A] == [reply(req) for req in range(64)]


def test_a_chunk_behind_waiting_replies_waits_too_and_keeps_its_place() -> None:
    queue = Queue(room=2)
    lines = ClientLines(queue.send, max_waiting=100)
    for req in range(3):
        lines.send(A, reply(req), "s1")
    assert lines.send(A, b"chunk", "s1", chunk=True) == []  # a queue full of replies says nothing of the stream
    lines.send(A, reply(3), "s1")
    while lines.waiting(A):
        queue.reads(A)
        lines.flush()
    queue.reads(A)
    assert queue.read[A] == [reply(0), reply(1), reply(2), b"chunk", reply(3)]


def test_a_second_chunk_while_one_waits_drops_the_client_and_tells_it() -> None:
    queue = Queue(room=2)
    lines = ClientLines(queue.send, max_waiting=100)
    lines.send(A, b"c0", "s1", chunk=True)
    lines.send(A, b"c1", "s1", chunk=True)
    assert lines.send(A, b"c2", "s1", chunk=True) == []  # waits: the queue is full
    assert lines.send(A, b"c3", "s1", chunk=True) == [Lost(A, "s1", "full")]
    queue.reads(A)  # it reads again, later: what it is told comes after what its queue held
    lines.flush()
    told = [protocol.decode(data, "server") for data in queue.reads(A)]
    assert len(told) == 1 and isinstance(told[0], protocol.Error)
    assert (told[0].code, told[0].session) == (NOT_READING, "s1")


def test_more_waiting_than_the_limit_drops_the_client_and_its_named_sessions() -> None:
    queue = Queue(room=1)
    lines = ClientLines(queue.send, max_waiting=3)
    lost = [lost for req in range(5) for lost in lines.send(A, reply(req), "s1" if req == 2 else None)]
    assert lost == [Lost(A, "s1", "full")]
    assert lines.waiting(A) == 1  # its notice only: bounded


def test_a_disconnected_client_loses_its_line_and_its_sessions_may_resume() -> None:
    queue = Queue(room=1)
    lines = ClientLines(queue.send, max_waiting=100)
    lines.send(A, reply(0), "s1")
    lines.send(A, reply(1), "s1")
    lines.send(A, reply(2), "s2")
    queue.gone.add(A)
    assert lines.flush() == [Lost(A, "s1", "gone"), Lost(A, "s2", "gone")]
    assert lines.waiting(A) == 0
    assert lines.send(A, reply(3), "s1") == [Lost(A, "s1", "gone")]


def test_one_clients_line_does_not_hold_up_another() -> None:
    queue = Queue(room=1)
    lines = ClientLines(queue.send, max_waiting=100)
    lines.send(A, reply(0), None)
    lines.send(A, reply(1), None)
    assert lines.send(B, reply(9), None) == [] and queue.reads(B) == [reply(9)]
    assert lines.waiting(A) == 1 and lines.waiting(B) == 0


def test_replies_past_the_byte_bound_drop_the_client_though_few_messages_wait() -> None:
    queue = Queue(room=1)
    lines = ClientLines(queue.send, max_waiting=1000, max_bytes=3 * len(reply(0)))
    lost = [lost for req in range(5) for lost in lines.send(A, reply(req), "s1")]  # 1 queued, 3 wait, the 5th: over
    assert lost == [Lost(A, "s1", "full")]
    assert lines.waiting(A) == 1  # its notice only
    queue.reads(A)
    lines.flush()
    assert lines.waiting(A) == 0 and protocol.decode(queue.queued[A][0], "server").code == NOT_READING
