"""The router core without processes: each test plays the clients and the replicas by feeding events (with their
time) and checks what the core asks the shell to do, one rule per test."""

from __future__ import annotations

import pytest

from ipc import protocol as p
from ipc.metrics_types import SessionSummary
from runtime.router_types import (
    ChunkHead,
    ClientSent,
    ClientUnreachable,
    ClientUnreadable,
    Connect,
    OpenOrigin,
    ReplicaRefused,
    ReplicaSent,
    ReplicaUp,
    SessionOrigin,
    Tick,
    ToClient,
)
from tests.router_fleet import (
    DEAD_S,
    ROUTER_ID,
    A,
    B,
    C,
    Fleet,
    chunk,
    opened,
    stats_of,
    two_replicas_up,
)

fleet = pytest.fixture(two_replicas_up, name="fleet")


# ------------------------------------------------------------------------------------------------ placement


def test_listed_replicas_are_connected_and_down_until_they_answer() -> None:
    f = Fleet()
    assert [(o.replica, o.endpoint) for o in f.log if isinstance(o, Connect)] == [("a", "tcp://a:5555"),
                                                                              ("b", "tcp://b:5555")]
    f.client(A, p.Open(req=1, image=b"png"))
    (error,) = f.errors(A)
    assert error.code == "busy" and error.retry_after_s == 5.0 and "a down, b down" in error.message
    f.replica("a", p.HeartbeatAck(req=0))
    assert not [o for o in f.log if isinstance(o, ReplicaUp)]  # answering; up once its load is read
    f.answer_stats("a", stats_of())
    assert [o.replica for o in f.log if isinstance(o, ReplicaUp)] == ["a"]


def test_new_sessions_spread_by_share_of_capacity_until_every_replica_is_full() -> None:
    f = Fleet({"a": 2, "b": 4})
    f.up("a", "b")
    placed = [f.open(A)[1] for _ in range(6)]
    assert sorted(placed) == ["a", "a", "b", "b", "b", "b"]
    assert placed[0] == "b"  # (0 + 1) / 4 < (0 + 1) / 2: the emptier share first
    f.client(B, p.Open(req=9, image=b"png"))
    (error,) = f.errors(B)
    assert error.code == "busy" and error.req == 9 and error.retry_after_s == 5.0
    assert "a 2/2, b 4/4" in error.message
    assert len(f.core.sessions) == 6 and not f.core.opens  # the refusal changed nothing


def test_sessions_of_other_clients_seen_in_stats_count_as_load(fleet: Fleet) -> None:
    fleet.answer_stats("a", stats_of(open_sessions=2))  # two direct clients fill a
    assert [fleet.open(A)[1] for _ in range(2)] == ["b", "b"]
    fleet.client(A, p.Open(req=5, image=b"png"))
    assert fleet.errors(A)[-1].code == "busy"


def test_a_tie_goes_to_the_replica_with_the_shorter_recent_chunk_period(fleet: Fleet) -> None:
    sid_a, _ = fleet.open(A)  # on a (the name breaks the first tie)
    sid_b, _ = fleet.open(B)  # on b
    for chunks_a, chunks_b in ((0, 0), (5, 20)):  # over 1.1 s: a session's chunk every 0.22 s on a, 0.055 s on b
        fleet.step(Tick(), dt=1.1)
        fleet.answer_stats("a", stats_of(open_sessions=1, chunks=chunks_a, per_session={sid_a: {}}))
        fleet.answer_stats("b", stats_of(open_sessions=1, chunks=chunks_b, per_session={sid_b: {}}))
    assert fleet.core.replicas["b"].period_s < fleet.core.replicas["a"].period_s
    assert fleet.open(C)[1] == "b"


def test_a_replica_answering_busy_gets_the_open_placed_on_another(fleet: Fleet) -> None:
    fleet.client(A, p.Open(req=3, image=b"png"))
    first = fleet.sent_open()
    fleet.replica(first.replica, p.Error(req=first.message.req, code="busy", message="at its limit", retry_after_s=5))
    second = fleet.sent_open()
    assert second.replica != first.replica and second.message.req != first.message.req
    assert second.message.image == b"png" and not fleet.errors(A)
    fleet.replica(second.replica, opened(second.message.req, "0000000000aa"))
    assert fleet.to(A, p.Opened)[-1].req == 3


def test_a_replica_whose_stats_say_it_drains_gets_no_open_even_when_it_has_no_session_to_hand_off() -> None:
    fleet = Fleet({"a": 4, "b": 4})
    fleet.up("a", "b")
    fleet.answer_stats("a", stats_of(draining=True))  # drained by an operator: nothing to hand off, no notice
    for req in range(3, 7):
        fleet.client(A, p.Open(req=req, image=b"png"))
        assert fleet.sent_open().replica == "b"
    fleet.answer_stats("a", stats_of())  # a later reply without it changes nothing on this connection
    fleet.client(A, p.Open(req=7, image=b"png"))
    assert fleet.sent_open().replica == "b"


def test_an_open_no_replica_can_take_gets_busy_after_each_refused(fleet: Fleet) -> None:
    fleet.client(A, p.Open(req=3, image=b"png"))
    first = fleet.sent_open()
    fleet.step(ReplicaRefused(first.replica, fleet.generation[first.replica], OpenOrigin(first.message.req)))
    second = fleet.sent_open()
    assert second.replica != first.replica
    fleet.replica(second.replica, p.Error(req=second.message.req, code="busy", message="full", retry_after_s=5))
    (error,) = fleet.errors(A)
    assert error.code == "busy" and error.req == 3
    assert not fleet.core.opens and all(r.opening == 0 for r in fleet.core.replicas.values())


# ------------------------------------------------------------------------------------------------ forwarding


def test_an_open_gets_the_clients_request_id_back_and_so_do_its_errors(fleet: Fleet) -> None:
    fleet.client(A, p.Open(req=41, image=b"GIF8"))
    sent = fleet.sent_open()
    assert sent.message.req != 41  # the router's own request id on the replica
    fleet.replica(sent.replica, p.Error(req=sent.message.req, code="bad_image", message="could not be decoded"))
    (error,) = fleet.errors(A)
    assert (error.req, error.code, error.message) == (41, "bad_image", "could not be decoded")
    assert not fleet.core.opens and not fleet.core.sessions


def test_chunks_and_replies_of_a_session_reach_its_client_as_the_same_payload(fleet: Fleet) -> None:
    sid, name = fleet.open(A)
    payload = p.encode(chunk(sid, 0))
    out = fleet.step(ReplicaSent(name, fleet.generation[name], ChunkHead(sid), payload))
    assert out == [ToClient(A, payload, sid)] and out[0].message is payload  # forwarded, never re-encoded
    control = p.Control(req=7, session=sid, index=0)
    raw = p.encode(control)
    out = fleet.step(ClientSent(A, control, raw))
    assert len(out) == 1 and out[0].replica == name and out[0].message == control
    assert out[0].raw is raw  # the client's own bytes, sent as they are while no token is in use
    fleet.replica(name, p.Accepted(req=7, session=sid, index=0))
    fleet.replica(name, p.Closed(session=sid, reason="complete", summary=SessionSummary(chunks=1)))
    assert fleet.to(A, p.Accepted)[-1].req == 7 and fleet.to(A, p.Closed)[-1].summary == SessionSummary(chunks=1)
    assert sid not in fleet.core.sessions and not fleet.core.replicas[name].sessions
    assert fleet.core.chunks_forwarded == 1


def test_a_session_is_only_reachable_by_its_client_with_the_servers_error(fleet: Fleet) -> None:
    sid, name = fleet.open(A)
    fleet.clear()
    for message in (p.Control(req=2, session=sid, index=0), p.Close(req=3, session=sid),
                    p.ControlState(req=4, session=sid, keys=["w"], revision=1)):
        fleet.client(B, message)
    assert not fleet.to_replica(name)  # nothing reached the replica
    assert [(e.req, e.code, e.message) for e in fleet.errors(B)] == [
        (req, "unknown_session", f"no session {sid!r} for this client") for req in (2, 3, 4)]
    fleet.client(A, p.Control(req=5, session="nope", index=0))
    assert fleet.errors(A)[-1].message == "no session 'nope' for this client"


def test_a_message_for_a_session_that_ended_is_dropped(fleet: Fleet) -> None:
    sid, name = fleet.open(A)
    fleet.replica(name, p.Closed(session=sid, reason="client"))
    fleet.clear()
    fleet.replica(name, chunk(sid, 3))
    fleet.replica("b" if name == "a" else "a", chunk(sid, 3))  # another replica naming it: not its session
    assert not [o for o in fleet.log if isinstance(o, ToClient)]


def test_bad_input_gets_bad_message_with_its_request_id_and_changes_nothing(fleet: Fleet) -> None:
    fleet.open(A)
    before = len(fleet.core.sessions)
    fleet.step(ClientUnreadable(B, "invalid 'open' message: Expected `int`, got `str` - at `$.seed`", 12))
    (error,) = fleet.errors(B)
    assert (error.req, error.code) == (12, "bad_message") and "$.seed" in error.message
    assert len(fleet.core.sessions) == before and fleet.core.rejects["bad_message"] == 1


def test_a_session_message_meeting_a_full_replica_connection_is_refused_with_a_retry_hint(fleet: Fleet) -> None:
    sid, name = fleet.open(A)
    fleet.step(ReplicaRefused(name, fleet.generation[name], SessionOrigin(A, 8, sid, "control")))
    (error,) = fleet.errors(A)
    assert (error.req, error.session, error.code) == (8, sid, "control_backpressure") and error.retry_after_s > 0
    fleet.step(ReplicaRefused(name, fleet.generation[name], SessionOrigin(A, 9, sid, "save")))
    (error,) = fleet.errors(A)[1:]  # a save is no control: what a server answers a save it cannot take now
    assert (error.req, error.code) == (9, "busy") and error.retry_after_s > 0


def test_a_late_opened_is_closed_on_its_replica_and_leaves_nothing_behind(fleet: Fleet) -> None:
    fleet.client(A, p.Open(req=1, image=b"png"))
    sent = fleet.sent_open()
    fleet.advance(31, answering=("a", "b"))  # router.open_timeout_s = 30
    (error,) = fleet.errors(A)
    assert error.code == "failed" and error.req == 1 and f"replica {sent.replica} did not open" in error.message
    fleet.clear()
    fleet.replica(sent.replica, opened(sent.message.req, "00000000late"))
    closes = fleet.to_replica(sent.replica, p.Close)
    assert [c.message.session for c in closes] == ["00000000late"] and not fleet.to(A, p.Opened)
    assert not fleet.core.sessions


def test_a_session_id_already_held_on_another_replica_is_refused_and_closed_there(fleet: Fleet) -> None:
    sid, name = fleet.open(A)
    fleet.client(B, p.Open(req=2, image=b"png"))
    sent = fleet.sent_open()
    assert sent.replica != name
    fleet.replica(sent.replica, opened(sent.message.req, sid))
    assert fleet.errors(B)[-1].code == "failed" and "in use" in fleet.errors(B)[-1].message
    assert [c.message.session for c in fleet.to_replica(sent.replica, p.Close)] == [sid]
    assert fleet.core.sessions[sid].client == A and fleet.core.sessions[sid].replica == name


# ------------------------------------------------------------------------------------------------ clients


def test_sessions_of_a_silent_client_are_closed_on_their_replica(fleet: Fleet) -> None:
    sid, name = fleet.open(A)
    other, _ = fleet.open(B)
    for _ in range(12):
        fleet.advance(1.0, answering=("a", "b"))
        fleet.client(B, p.Heartbeat())
    closes = [c.message.session for c in fleet.to_replica(name, p.Close)]
    assert set(closes) == {sid}  # B kept beating: its session stays
    fleet.replica(name, p.Closed(session=sid, reason="client"))
    assert sid not in fleet.core.sessions and other in fleet.core.sessions


def test_a_close_the_replica_never_answered_is_sent_again_until_closed(fleet: Fleet) -> None:
    sid, name = fleet.open(A)
    fleet.clear()
    fleet.step(ClientUnreachable(A, sid, "full"))  # the close may be lost (a full link, a fresh connection)
    fleet.advance(DEAD_S / 2, answering=("a", "b"))
    assert len(fleet.to_replica(name, p.Close)) == 1  # not before replica_dead_s
    fleet.advance(DEAD_S, answering=("a", "b"))
    assert len(fleet.to_replica(name, p.Close)) == 2  # no `closed`: asked again, never left open on the replica
    fleet.replica(name, p.Closed(session=sid, reason="client"))
    fleet.advance(3 * DEAD_S, answering=("a", "b"))
    assert len(fleet.to_replica(name, p.Close)) == 2 and sid not in fleet.core.sessions


def test_heartbeat_acks_carry_the_routers_id_so_a_client_sees_a_restarted_router(fleet: Fleet) -> None:
    sid, _ = fleet.open(A)
    fleet.client(A, p.Heartbeat(req=7))
    fleet.client(A, p.Heartbeat(req=8, session=sid))
    assert [ack.server for ack in fleet.to(A, p.HeartbeatAck)] == [ROUTER_ID, ROUTER_ID]


def test_a_client_that_stops_reading_has_its_session_closed_never_buffered(fleet: Fleet) -> None:
    sid, name = fleet.open(A)
    fleet.clear()
    fleet.step(ClientUnreachable(A, sid, "full"))
    assert [c.message.session for c in fleet.to_replica(name, p.Close)] == [sid]
    fleet.replica(name, chunk(sid, 0))
    assert not [o for o in fleet.log if isinstance(o, ToClient)]  # dropped while it closes


def test_a_gone_client_resumes_with_a_heartbeat_and_only_its_owner_may(fleet: Fleet) -> None:
    sid, name = fleet.open(A)
    fleet.step(ClientUnreachable(A, sid, "gone"))
    fleet.clear()
    fleet.replica(name, chunk(sid, 0))
    assert not [o for o in fleet.log if isinstance(o, ToClient)]  # dropped while away
    fleet.client(B, p.Heartbeat(req=3, session=sid))
    assert fleet.errors(B)[-1].message == f"no session {sid!r} to resume"
    fleet.client(A, p.Heartbeat(req=4, session=sid))
    assert fleet.to(A, p.HeartbeatAck)[-1].session == sid
    fleet.replica(name, chunk(sid, 1))
    assert fleet.to(A, p.Chunk)[-1].facts.index == 1
    assert not fleet.to_replica(name, p.Heartbeat)  # answered by the router itself


def test_a_client_may_resume_a_session_its_replica_is_closing_and_hears_the_closed_as_from_a_server(
        fleet: Fleet) -> None:
    sid, name = fleet.open(A)
    fleet.step(ClientUnreachable(A, sid, "full"))  # it stopped reading: the router closes the session
    fleet.clear()
    fleet.client(A, p.Heartbeat(req=5, session=sid))  # back, reading again, before the replica's closed
    assert fleet.to(A, p.HeartbeatAck)[-1].session == sid
    fleet.replica(name, p.Closed(session=sid, reason="client"))
    assert [c.session for c in fleet.to(A, p.Closed)] == [sid] and sid not in fleet.core.sessions
