"""The router core at its edges, without processes (issue 21): exact load while opens cross stats replies, a
replica's identity (its server id) deciding restarts instead of registrations and timing, the router refusing
itself as a replica, hostile stats read as typed values, and session messages that meet a full replica link.
Each test plays clients and replicas by feeding events to ``RouterCore`` (the ``Fleet`` of ``tests.router_fleet``)."""

from __future__ import annotations

import math
from typing import Any

import msgspec

from ipc import protocol as p
from runtime.replicas import State
from runtime.router_config import ReplicaEntry, RouterSection
from runtime.router_types import (
    Connect,
    RegisterSent,
    ReplicaDown,
    ReplicaRefused,
    SessionOrigin,
    Tick,
    ToRegistrant,
    ToReplica,
)
from tests.router_fleet import DEAD_S, ROUTER_ID, A, B, Fleet, opened, stats_of


def ack(server: str, req: int = 0) -> p.HeartbeatAck:
    return p.HeartbeatAck(req=req, server=server)


def registered(f: Fleet, message: p.Register) -> p.Registered:
    (answer,) = [o.message for o in f.step(RegisterSent(b"peer", message)) if isinstance(o, ToRegistrant)]
    return answer


def register(name: str, incarnation: str, endpoint: str = "", **fields: Any) -> p.Register:
    return p.Register(name=name, endpoint=endpoint or f"tcp://{name}:5555", max_sessions=2, layout="cpu-mini",
                      incarnation=incarnation, **fields)


# ------------------------------------------------------------------------------------------------ 1. exact load


def test_a_stats_reply_that_already_counts_an_open_in_flight_does_not_count_it_twice() -> None:
    f = Fleet({"a": 2})
    f.up("a")
    f.client(A, p.Open(req=1, image=b"png"))
    first = f.sent_open()
    # the replica accepted the open (its image still decoding, its `opened` not read yet) and then answered the
    # stats poll: that session is in its open_sessions and, as the router's, in the per_session it shows the router
    f.answer_stats("a", stats_of(open_sessions=1, per_session={"00000000000a": {"chunks": 0}}))
    f.client(B, p.Open(req=2, image=b"png"))
    assert not f.errors(B), f.errors(B)  # 1 of 2 taken: room for B, not "busy (a 2/2)"
    second = f.sent_open()
    assert second.replica == "a" and second.message.req != first.message.req
    assert f.core.replicas["a"].load == 2
    f.replica("a", opened(first.message.req, "00000000000a"))
    f.replica("a", opened(second.message.req, "00000000000b"))
    assert f.core.replicas["a"].load == 2 and len(f.to(A, p.Opened)) == len(f.to(B, p.Opened)) == 1


def test_sessions_of_other_clients_are_the_replicas_sessions_it_does_not_show_the_router() -> None:
    f = Fleet({"a": 3})
    f.up("a")
    sid, _ = f.open(A)
    f.answer_stats("a", stats_of(open_sessions=2, per_session={sid: {}}))  # one session of a direct client
    assert f.core.replicas["a"].load == 2
    f.open(B)
    f.client(A, p.Open(req=9, image=b"png"))
    assert f.errors(A)[-1].code == "busy" and "a 3/3" in f.errors(A)[-1].message


# ------------------------------------------------------------------------------------------------ 6. the router itself


def test_a_replica_answering_with_the_routers_own_id_is_refused_and_never_takes_sessions() -> None:
    f = Fleet({"a": 2}, register_bind="tcp://127.0.0.1:5561")
    f.up("a")
    assert registered(f, register("loop", "x", "tcp://127.0.0.1:5560")).ok  # not known yet to be the router
    f.replica("loop", ack(ROUTER_ID))
    loop = f.core.replicas["loop"]
    assert loop.state is State.DOWN and "this router itself" in loop.down_reason
    for _ in range(3):
        f.advance(1.0, answering=("a",))
        f.replica("loop", ack(ROUTER_ID))
    assert loop.state is State.DOWN
    answer = registered(f, register("loop", "x", "tcp://127.0.0.1:5560"))
    assert not answer.ok and "this router itself" in answer.message
    assert [f.open(A)[1] for _ in range(2)] == ["a", "a"]  # nothing placed on the loop
    assert registered(f, register("loop", "y", "tcp://elsewhere:5555")).ok  # it may move to a real replica
    f.replica("loop", ack("y"))
    f.answer_stats("loop", stats_of())
    assert loop.state is State.UP


# ------------------------------------------------------------------------------------------------ 7. hostile stats


HOSTILE = {
    "huge counts": stats_of(chunks=2**64 - 1) | {"frames_emitted": 2**64 - 1, "open_sessions": 2**63},
    "huge floats": stats_of() | {"uptime_s": 1e300, "chunks_emitted": 1e300},
    "not finite": stats_of() | {"uptime_s": math.inf},
    "wrong types": stats_of(rejects=["busy"], errors={"x": "many"}, sessions=7, per_session={"s": "?"}),
    "nested": stats_of() | {"deep": [[[[[[[[[[[[1]]]]]]]]]]]]},
    "negative": stats_of(open_sessions=-3),
}


def test_hostile_stats_mark_their_replica_down_with_the_reason_and_leave_the_router_whole() -> None:
    for what, stats in HOSTILE.items():
        f = Fleet({"a": 2, "b": 2})
        f.up("a", "b")
        sid, name = f.open(A)
        f.step(Tick(), dt=1.1)
        f.answer_stats(name, stats)
        replica = f.core.replicas[name]
        assert replica.state is State.DOWN, what
        assert "unusable stats" in replica.down_reason, (what, replica.down_reason)
        down = [o for o in f.log if isinstance(o, ReplicaDown)]
        assert down and down[-1].replica == name, what
        assert f.errors(A)[-1].session == sid  # its sessions end: a replica that says nonsense is not trusted
        f.client(B, p.Stats(req=3))
        (reply,) = f.to(B, p.StatsReply)
        p.decode(p.encode(reply), "server", max_bytes=1 << 30)  # encodable and decodable by every client
        assert reply.stats.replicas[name].down_reason == replica.down_reason, what
        f.replica(name, ack(""))  # it answers again at once: it stays down for a while, never flapping
        assert replica.state is State.DOWN, what


def test_a_replica_whose_stats_nest_as_deep_as_allowed_reaches_every_client_readable() -> None:
    from runtime.replicas import MAX_STATS_DEPTH, nesting

    f = Fleet({"a": 2})
    f.up("a")
    deepest: Any = 1
    for _ in range(MAX_STATS_DEPTH - 1):
        deepest = [deepest]
    stats = stats_of() | {"deep": deepest}
    assert nesting(stats) == MAX_STATS_DEPTH
    f.answer_stats("a", stats)
    f.client(A, p.Stats(req=1))
    (reply,) = f.to(A, p.StatsReply)
    assert p.decode(p.encode(reply), "server").stats.replicas["a"].stats["deep"] == deepest  # shown as it came


def test_a_replica_whose_stats_nest_a_routers_stats_is_shown_without_them() -> None:
    f = Fleet({"a": 2})
    f.up("a")
    nested = stats_of() | {"layout": "router", "replicas": {"x": {"stats": {"replicas": {}}}}, "total": {}}
    f.answer_stats("a", nested)
    f.client(A, p.Stats(req=1))
    shown = f.to(A, p.StatsReply)[-1].stats.replicas["a"].stats
    assert shown["layout"] == "router" and "replicas" not in shown and "total" not in shown


# ------------------------------------------------------------------------------------------------ 8. re-registration


def test_registrations_at_a_live_listed_replicas_endpoint_never_end_its_sessions() -> None:
    f = Fleet({"a": 2}, register_bind="tcp://127.0.0.1:5561")
    f.replica("a", ack("server-a"))
    f.step(Tick())
    f.answer_stats("a", stats_of())
    sid, _ = f.open(A)
    answers = []
    for incarnation in ("one", "two", "three"):  # strangers, or a registrant that is not the process there
        f.advance(DEAD_S + 0.5, answering=("a",))
        f.replica("a", ack("server-a"))
        answers.append(registered(f, register("a", incarnation)))
    assert sid in f.core.sessions and not f.errors(A)
    assert all(not a.ok and "server-a" in a.message for a in answers)  # server-a answers there: it is alive
    for _ in range(3):  # the replica itself, again and again: nothing changes
        f.advance(DEAD_S + 0.5, answering=("a",))
        assert registered(f, register("a", "server-a")).ok
    assert sid in f.core.sessions and not f.errors(A) and f.core.replicas["a"].state is State.UP


def test_a_replica_answering_as_a_new_server_restarted_whatever_registrations_say() -> None:
    f = Fleet({"a": 2})
    f.replica("a", ack("one"))
    f.step(Tick())
    f.answer_stats("a", stats_of())
    sid, _ = f.open(A)
    f.replica("a", ack("two"))  # a requeued job at the same endpoint, before the router saw the old one silent
    error = f.errors(A)[-1]
    assert error.session == sid and error.code == "rank_failed" and "restarted" in error.message
    assert f.core.replicas["a"].state is State.DOWN  # a fresh connection: nothing queued for "one" reaches "two"
    f.replica("a", ack("two"))
    assert f.core.replicas["a"].state is State.DOWN  # answering: up once its load is read
    f.answer_stats("a", stats_of())
    assert f.core.replicas["a"].state is State.UP


# ------------------------------------------------------------------------------------------------ 9. rejoin race


def test_a_restarted_registered_replica_takes_sessions_only_once_its_registration_is_known() -> None:
    f = Fleet({}, register_bind="tcp://127.0.0.1:5561")
    assert registered(f, register("r", "one")).ok
    f.replica("r", ack("one"))
    f.step(Tick())
    f.answer_stats("r", stats_of())
    old, _ = f.open(A)
    f.advance(DEAD_S + 0.5)  # the job died: silent, down, its session ends
    assert f.errors(A)[-1].session == old and f.core.replicas["r"].state is State.DOWN
    f.replica("r", ack("two"))  # the requeued job answers pings at the old endpoint before it registers
    f.step(Tick())
    f.client(B, p.Open(req=5, image=b"png"))
    assert f.errors(B)[-1].code == "busy"  # not placed on a replica whose incarnation is unknown
    assert registered(f, register("r", "two")).ok
    f.replica("r", ack("two"))
    f.step(Tick())
    f.answer_stats("r", stats_of())
    sid, name = f.open(B)
    assert name == "r"
    for _ in range(3):
        f.advance(0.5, answering=("r",))
        assert registered(f, register("r", "two")).ok
    assert sid in f.core.sessions and not [e for e in f.errors(B) if e.session == sid]


def test_a_restarted_listed_replica_rejoins_on_its_new_id_and_its_registration_ends_nothing() -> None:
    f = Fleet({"a": 2}, register_bind="tcp://127.0.0.1:5561")
    assert registered(f, register("a", "one")).ok
    f.replica("a", ack("one"))
    f.step(Tick())
    f.answer_stats("a", stats_of())
    f.advance(DEAD_S + 0.5)
    f.replica("a", ack("two"))  # its new incarnation is known from its id: it takes sessions at once
    f.step(Tick())
    f.answer_stats("a", stats_of())
    sid, _ = f.open(B)
    assert registered(f, register("a", "two")).ok  # its registration, arriving late, declares nothing
    f.advance(0.5, answering=("a",))
    assert sid in f.core.sessions and not f.errors(B)


def test_a_registered_replica_moves_only_once_its_old_endpoint_stopped_answering() -> None:
    f = Fleet({}, register_bind="tcp://127.0.0.1:5561")
    assert registered(f, register("r", "one")).ok
    f.replica("r", ack("one"))
    f.step(Tick())
    f.answer_stats("r", stats_of())
    sid, _ = f.open(A)
    answers = []
    for _ in range(3):  # a rival under its name (a second array with the same names) is refused while r answers
        f.advance(DEAD_S, answering=("r",))
        answers.append(registered(f, register("r", "rival", "tcp://node9:5555")))
    assert sid in f.core.sessions and not f.errors(A)
    assert all(not a.ok and "live replica" in a.message for a in answers)
    f.advance(DEAD_S + 0.5)  # r's job died
    assert registered(f, register("r", "rival", "tcp://node9:5555")).ok
    assert [o.endpoint for o in f.log if isinstance(o, Connect)][-1] == "tcp://node9:5555"
    f.replica("r", ack("rival"))
    f.answer_stats("r", stats_of())
    assert f.core.replicas["r"].state is State.UP


# ------------------------------------------------------------------------------------------------ 10. full link


def test_a_close_meeting_a_full_replica_link_is_taken_over_and_sent_again_never_answered_busy() -> None:
    f = Fleet({"a": 2})
    f.up("a")
    sid, _ = f.open(A)
    f.clear()
    f.client(A, p.Close(req=4, session=sid))
    f.step(ReplicaRefused("a", f.generation["a"], SessionOrigin(A, 4, sid, "close")))
    assert not f.errors(A)  # a server never answers a close with busy
    f.step(Tick(), dt=0.1)
    closes = [o for o in f.to_replica("a") if isinstance(o.message, p.Close)]
    assert [c.message.session for c in closes] == [sid, sid]  # the client's (refused), then the router's again
    assert closes[0].raw is not None and closes[1].raw is None  # the second is the router's own
    f.replica("a", p.Closed(session=sid, reason="client"))
    assert f.to(A, p.Closed)[-1].reason == "client" and sid not in f.core.sessions


def test_control_states_meeting_a_full_replica_link_are_folded_into_one_and_sent_when_it_drains() -> None:
    f = Fleet({"a": 2})
    f.up("a")
    sid, _ = f.open(A)
    f.clear()
    first = p.ControlState(req=4, session=sid, keys=["w"], mouse=(1.0, 0.0), taps=["j"], revision=1)
    (sent,) = [o for o in f.client(A, first) if isinstance(o, ToReplica)]
    f.step(ReplicaRefused("a", f.generation["a"], sent.origin))  # what the shell reports of it
    assert not f.errors(A)  # a server never refuses a valid control_state
    second = p.ControlState(req=5, session=sid, keys=["a"], mouse=(2.0, 0.5), taps=["k"], revision=2)
    f.client(A, second)
    sent = [o.message for o in f.to_replica("a")]
    folded = [m if isinstance(m, p.ControlState) else p.decode(m, "client") for m in sent][-1]
    assert folded.revision == 2 and folded.keys == ["a"] and folded.mouse == (3.0, 0.5)
    assert sorted(folded.taps) == ["j", "k"] and not f.errors(A)


def test_the_router_config_requires_a_registration_token_off_loopback(tmp_path: Any) -> None:
    import pytest

    from runtime.config import ConfigError
    from runtime.router_config import load

    path = tmp_path / "router.toml"
    path.write_text('[router]\nregister_bind = "tcp://0.0.0.0:5561"\n')
    with pytest.raises(ConfigError, match="register_token"):
        load(path)
    assert load(path, ["--router.register_token=0123456789abcdef"]).router.register_token
    path.write_text('[router]\nregister_bind = "tcp://127.0.0.1:5561"\n')
    assert load(path).router.register_token == ""  # loopback: only this host's jobs reach it


def test_a_replica_link_queues_at_most_router_replica_queue_mb_each_way() -> None:
    import zmq

    from router.shell import RouterShell
    from runtime.router_config import RouterConfig

    config = RouterConfig(router=RouterSection(port=0), replicas=[ReplicaEntry(name="a", endpoint="tcp://127.0.0.1:9")])
    shell = RouterShell(config, zmq.Context())
    try:
        shell._carry_out(shell.core.step([Tick()], 0.0))  # connects the listed replica
        sock = shell.links["a"].sock
        budget = config.router.replica_queue_mb * 2**20
        largest = sock.getsockopt(zmq.MAXMSGSIZE)  # -1 (any size) before
        assert largest > 0 and sock.getsockopt(zmq.RCVHWM) * largest <= budget  # was 1000 x any size
        assert sock.getsockopt(zmq.SNDHWM) * config.router.max_message_bytes <= budget
        assert largest >= 480 * 832 * 3 * 12  # a 480x832 chunk fits
    finally:
        shell._close()


def test_a_session_whose_chunks_exceed_what_the_router_forwards_is_refused_and_closed_on_its_replica() -> None:
    f = Fleet({"a": 2}, max_chunk_mb=8)
    f.up("a")
    f.client(A, p.Open(req=1, image=b"png"))
    sent = f.sent_open()
    f.replica("a", msgspec.structs.replace(opened(sent.message.req, "0000000000aa"), height=480, width=832))
    error = f.errors(A)[-1]
    assert error.req == 1 and error.code == "failed" and "router.max_chunk_mb" in error.message
    assert [c.message.session for c in f.to_replica("a", p.Close)] == ["0000000000aa"] and not f.core.sessions

