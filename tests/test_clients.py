"""The client front door (runtime/clients.py) alone: a pure state machine fed identities, sessions and times."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from ipc import protocol as p
from runtime.client_types import ClientError, ClientUnreachable, ToClient
from runtime.clients import Clients

A, B, C, D, E = (f"client-{c}".encode() for c in "abcde")
TIMEOUT = 10.0


@dataclass
class S:
    id: str
    client: bytes
    owner: bytes
    gone: bool = False


def session(sid: str, who: bytes) -> S:
    return S(sid, who, who)


def front(max_peers: int = 1024) -> Clients[S]:
    return Clients("server-1", TIMEOUT, max_peers)


# ---- bounded memory


def test_an_identity_that_owns_a_session_is_never_forgotten_and_others_go_least_recently_heard_first() -> None:
    clients = front(max_peers=3)
    clients.heard(A, 0.0)
    clients.add(session("s1", A), 0.0)
    for t, who in enumerate((B, C, D, E), start=1):
        clients.heard(who, float(t))
    assert clients.peers == {A, D, E}  # B then C forgotten, one at a time; A, the oldest, kept: it owns s1
    clients.heard(D, 5.0)  # heard again: now the most recent
    clients.heard(B, 6.0)
    assert clients.peers == {A, D, B}


def test_identities_with_sessions_may_exceed_the_bound_and_others_are_not_kept_beside_them() -> None:
    clients = front(max_peers=2)
    for n, who in enumerate((A, B, C)):
        clients.heard(who, 0.0)
        clients.add(session(f"s{n}", who), 0.0)
    clients.heard(D, 1.0)
    assert clients.peers == {A, B, C}  # each owns a live session: bounded by the sessions admitted, not forgotten


def test_an_identity_whose_last_session_ended_may_be_forgotten_again() -> None:
    clients = front(max_peers=2)
    clients.add(session("s1", A), 0.0)
    clients.add(session("s2", A), 0.0)
    clients.remove("s1")
    clients.heard(B, 1.0)
    clients.heard(C, 2.0)
    assert A in clients.peers  # s2 still lives
    assert clients.remove("s2") is not None and clients.remove("s2") is None
    clients.heard(D, 3.0)
    assert clients.peers == {A, D} and clients.of(A) == []  # A counts as heard when its last session ended
    clients.heard(E, 4.0)
    assert clients.peers == {D, E}


# ---- ownership and resume


def test_only_its_client_reaches_a_session_and_a_stranger_cannot_tell_it_exists() -> None:
    clients = front()
    clients.add(session("s1", A), 0.0)
    assert clients.owned(A, "s1").id == "s1"
    for who, sid in ((B, "s1"), (A, "nope")):
        with pytest.raises(ClientError) as refused:
            clients.owned(who, sid)
        assert (refused.value.code, str(refused.value)) == ("unknown_session", f"no session {sid!r} for this client")


def test_a_heartbeat_is_acked_with_the_server_id_and_one_naming_a_session_resumes_it_for_its_owner_only() -> None:
    clients = front()
    s1 = session("s1", A)
    clients.add(s1, 0.0)
    assert clients.heartbeat(C, p.Heartbeat(req=1), 1.0) == ToClient(C, p.HeartbeatAck(req=1, server="server-1"))
    assert clients.unreachable(ClientUnreachable(A, "s1", "gone")) is None and s1.gone
    with pytest.raises(ClientError, match="no session 's1' to resume"):
        clients.heartbeat(B, p.Heartbeat(req=2, session="s1"), 2.0)
    assert s1.gone and s1.client == A  # a refused resume changes nothing
    ack = clients.heartbeat(A, p.Heartbeat(req=3, session="s1"), 3.0)
    assert ack == ToClient(A, p.HeartbeatAck(req=3, session="s1", server="server-1")) and not s1.gone


def test_a_session_that_moved_to_another_identity_is_indexed_under_it() -> None:
    clients = front()
    s1 = S("s1", A, B)  # opened by B, reached at A: B's reconnect takes it back
    clients.add(s1, 0.0)
    clients.heartbeat(B, p.Heartbeat(req=1, session="s1"), 1.0)
    assert s1.client == B and clients.of(B) == [s1] and clients.of(A) == []
    assert clients.owned(B, "s1") is s1


# ---- gone, full, silent


def test_a_gone_client_is_waited_for_and_a_full_one_has_its_session_closed_once() -> None:
    clients = front()
    s1, s2 = session("s1", A), session("s2", B)
    clients.add(s1, 0.0)
    clients.add(s2, 0.0)
    assert clients.unreachable(ClientUnreachable(A, "s1", "gone")) is None and s1.gone
    assert clients.unreachable(ClientUnreachable(B, "s2", "full")) is s2 and s2.gone
    assert clients.unreachable(ClientUnreachable(B, "s2", "full")) is None  # reported again: already handled
    assert clients.unreachable(ClientUnreachable(C, "s1", "full")) is None  # an identity the session is not at


def test_silent_lists_the_sessions_of_clients_silent_past_the_timeout_and_any_message_refreshes_them_all() -> None:
    clients = front()
    a1, a2, b1 = session("a1", A), session("a2", A), session("b1", B)
    clients.add(a1, 0.0)
    clients.add(b1, 1.0)
    clients.add(a2, 2.0)  # a new session counts as hearing from A
    assert clients.silent(11.5) == [b1]
    clients.heard(B, 11.5)  # any message, e.g. a stats request
    assert clients.silent(12.5) == [a1, a2]
    assert clients.silent(22.0) == [a1, a2, b1]  # the longest silent first
    clients.remove("b1")
    assert clients.silent(30.0) == [a1, a2]


# ---- answers and notices


def test_a_refusal_answers_its_request_with_the_code_the_reason_and_the_retry_hint() -> None:
    out = front().refusal(A, ClientError("busy", "x" * 5000, retry_after_s=5.0), 7, "s1")
    assert out.identity == A and isinstance(out.message, p.Error)
    assert (out.message.req, out.message.session, out.message.code, out.message.retry_after_s) == (7, "s1", "busy", 5.0)
    assert len(out.message.message) < 5000  # clipped to what the wire takes


def test_a_notice_reaches_every_reachable_session_and_every_identity_without_one() -> None:
    clients = front(max_peers=3)
    a1, a2, b1 = session("a1", A), session("a2", A), session("b1", B)
    for s in (a1, a2, b1):
        clients.add(s, 0.0)
    for t, who in enumerate((C, D, E), start=1):
        clients.heard(who, float(t))  # past max_peers: C and D forgotten, never the session owners
    clients.unreachable(ClientUnreachable(B, "b1", "gone"))
    out = clients.notices("rank_failed", "rank 3 died", lambda s: p.Closed(session=s.id, reason="shutdown"))
    assert [(o.identity, type(o.message).__name__, o.message.session, o.session) for o in out] == [
        (A, "Error", "a1", "a1"), (A, "Closed", "a1", "a1"),
        (A, "Error", "a2", "a2"), (A, "Closed", "a2", "a2"),  # each stream of A ends, not only its first
        (B, "Error", None, None),  # b1's client is gone: told plainly, in case it reconnected without resuming
        (E, "Error", None, None)]  # E owns nothing
    assert {o.message.code for o in out if isinstance(o.message, p.Error)} == {"rank_failed"}
