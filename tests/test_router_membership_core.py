"""The router core without processes: replicas joining, leaving and restarting, registration, the fleet's stats,
shutdown and the router's pieces (peek, config). Harness: ``tests.router_fleet``."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from ipc import protocol as p
from ipc import relay
from ipc.metrics_types import Distribution, SessionCounts, SessionSummary
from runtime.clients import MAX_PEERS
from runtime.config import ConfigError
from runtime.core_types import ClientError
from runtime.replicas import IllegalTransition, Replica, State
from runtime.router import MAX_REASONS
from runtime.router_config import load
from runtime.router_types import (
    ClientUnreadable,
    Connect,
    Disconnect,
    RegisterSent,
    ReplicaDown,
    ReplicaUp,
    ShellTimes,
    ShutdownRequested,
    Stop,
    Tick,
    ToRegistrant,
)
from tests.router_fleet import (
    DEAD_S,
    A,
    B,
    C,
    Fleet,
    chunk,
    stats_of,
    two_replicas_up,
)

fleet = pytest.fixture(two_replicas_up, name="fleet")


# ------------------------------------------------------------------------------------------------ membership


def test_a_silent_replica_goes_down_its_sessions_end_naming_it_and_new_sessions_go_elsewhere(fleet: Fleet) -> None:
    sid_a, _ = fleet.open(A)
    sid_b, _ = fleet.open(B)
    assert fleet.core.sessions[sid_b].replica == "b"
    fleet.advance(DEAD_S + 0.5, answering=("a",))
    (down,) = [o for o in fleet.log if isinstance(o, ReplicaDown)]
    assert down.replica == "b" and down.sessions_lost == 1 and "stopped answering" in down.reason
    (error,) = fleet.errors(B)
    assert error.code == "rank_failed" and error.session == sid_b and "replica b (tcp://b:5555)" in error.message
    closed = fleet.to(B, p.Closed)[-1]
    assert closed.session == sid_b and closed.reason == "failed" and "replica b" in closed.error
    assert not fleet.errors(A) and sid_a in fleet.core.sessions  # a's session streams on
    assert fleet.open(C)[1] == "a"
    fleet.client(B, p.Control(req=9, session=sid_b, index=0))
    assert fleet.errors(B)[-1].code == "unknown_session"


def test_a_replica_saying_its_job_ends_goes_down_at_once_and_its_opens_go_elsewhere(fleet: Fleet) -> None:
    _, name = fleet.open(A)
    fleet.client(B, p.Open(req=2, image=b"png"))
    pending = fleet.sent_open()
    assert pending.replica != name  # b got the second open; make that one end
    fleet.clear()
    fleet.replica(pending.replica, p.Error(code="rank_failed", message="rank 1 is gone; the job is ending"))
    down = [o for o in fleet.log if isinstance(o, ReplicaDown)]
    assert down and down[0].replica == pending.replica and "rank 1 is gone" in down[0].reason
    moved = fleet.sent_open()
    assert moved.replica == name and not fleet.errors(B)  # the client never saw it
    assert [o.generation for o in fleet.log if isinstance(o, Connect)] == [fleet.generation[pending.replica]]


def test_a_down_replica_rejoins_on_a_fresh_connection_and_takes_sessions_again(fleet: Fleet) -> None:
    fleet.open(A)
    old = fleet.generation["b"]
    fleet.advance(DEAD_S + 0.5, answering=("a",))
    assert fleet.generation["b"] == old + 1 and fleet.core.replicas["b"].state is State.DOWN
    fleet.clear()
    fleet.replica("b", p.HeartbeatAck(req=0), generation=old)  # the old connection: ignored
    assert fleet.core.replicas["b"].state is State.DOWN
    fleet.replica("b", p.HeartbeatAck(req=0))
    fleet.answer_stats("b", stats_of())  # its load on the new connection, read before it takes sessions
    assert fleet.core.replicas["b"].state is State.UP and [o.replica for o in fleet.log if isinstance(o, ReplicaUp)]
    assert fleet.open(B)[1] == "b"


def test_a_replica_whose_uptime_went_back_restarted_and_its_sessions_end(fleet: Fleet) -> None:
    sid, name = fleet.open(A)
    other, other_name = fleet.open(B)
    for uptime, other_uptime in ((20.0, 20.0), (0.5, 21.1)):
        fleet.step(Tick(), dt=1.1)
        fleet.answer_stats(name, stats_of(uptime=uptime))
        fleet.answer_stats(other_name, stats_of(uptime=other_uptime))
    error = fleet.errors(A)[-1]
    assert error.code == "rank_failed" and error.session == sid and "restarted" in error.message
    assert f"replica {name}" in error.message and sid not in fleet.core.sessions
    assert other in fleet.core.sessions and not fleet.errors(B)  # the other replica's session stays
    assert fleet.core.replicas[name].state is State.UP  # it serves: it takes new sessions


def test_a_replica_registers_itself_and_a_new_incarnation_at_a_new_endpoint_takes_over_once_the_old_is_down(
) -> None:
    f = Fleet({}, register_bind="tcp://127.0.0.1:5561")
    register = p.Register(name="n7", endpoint="tcp://node7:5555", max_sessions=3, layout="split7", incarnation="one")
    out = f.step(RegisterSent(b"peer", register))
    assert Connect("n7", "tcp://node7:5555", 1) in out and ToRegistrant(b"peer", p.Registered(ok=True)) in out
    f.replica("n7", p.HeartbeatAck(req=0, server="one"))  # its server answers with the id it registered
    f.step(Tick())
    f.answer_stats("n7", stats_of())
    sid, name = f.open(A)
    assert name == "n7" and f.core.replicas["n7"].max_sessions == 3
    f.step(RegisterSent(b"peer", register))  # the heartbeat: nothing changes
    assert sid in f.core.sessions
    f.clear()
    rival = msgspec.structs.replace(register, incarnation="two", endpoint="tcp://node9:5555")
    (refused,) = [o.message for o in f.step(RegisterSent(b"peer2", rival)) if isinstance(o, ToRegistrant)]
    assert not refused.ok and "held by a live replica" in refused.message  # "one" answers: alive
    assert sid in f.core.sessions and not f.errors(A)
    f.advance(DEAD_S + 0.5)  # "one" stops answering (its job died): down, its session ends
    error = f.errors(A)[-1]
    assert error.code == "rank_failed" and "replica n7" in error.message and "stopped answering" in error.message
    f.step(RegisterSent(b"peer2", rival))
    assert [(o.endpoint, o.generation) for o in f.log if isinstance(o, Connect)][-1] == ("tcp://node9:5555", 3)
    f.replica("n7", p.HeartbeatAck(req=0, server="two"))
    f.step(Tick())
    f.answer_stats("n7", stats_of())
    assert f.open(B)[1] == "n7"


def test_registrations_with_a_wrong_token_bad_fields_or_beyond_the_limit_are_refused() -> None:
    f = Fleet({"a": 2}, register_bind="tcp://127.0.0.1:5561", register_token="s3cret", max_replicas=2)
    good = p.Register(name="r", endpoint="tcp://r:1", max_sessions=1, layout="x", incarnation="i", token="s3cret")
    cases = [(msgspec.structs.replace(good, token="guess"), "token"),
             (msgspec.structs.replace(good, endpoint="http://r:1"), "must start with"),
             (msgspec.structs.replace(good, name=""), "replica name"),
             (msgspec.structs.replace(good, max_sessions=0), "max_sessions")]
    for message, why in cases:
        (answer,) = [o.message for o in f.step(RegisterSent(b"p", message)) if isinstance(o, ToRegistrant)]
        assert not answer.ok and why in answer.message
    assert list(f.core.replicas) == ["a"]
    assert f.step(RegisterSent(b"p", good))[-1] == ToRegistrant(b"p", p.Registered(ok=True))
    (answer,) = [o.message for o in f.step(RegisterSent(b"p", msgspec.structs.replace(good, name="third")))
                 if isinstance(o, ToRegistrant)]
    assert not answer.ok and "limit of 2 replicas" in answer.message and len(f.core.replicas) == 2


def test_a_registered_replica_down_for_long_is_forgotten_and_a_listed_one_stays() -> None:
    f = Fleet({"a": 2}, register_bind="tcp://127.0.0.1:5561", forget_after_s=5.0)
    f.step(RegisterSent(b"p", p.Register(name="r", endpoint="tcp://r:1", max_sessions=1, layout="x",
                                         incarnation="i")))
    f.advance(6.0)
    assert list(f.core.replicas) == ["a"] and Disconnect("r") in f.log


# ------------------------------------------------------------------------------------------------ stats, ending


def test_stats_sum_the_up_replicas_and_show_a_client_only_its_own_sessions(fleet: Fleet) -> None:
    sid_a, name_a = fleet.open(A)
    sid_b, name_b = fleet.open(B)
    fleet.step(Tick(), dt=1.1)
    for name, sid in ((name_a, sid_a), (name_b, sid_b)):
        fleet.answer_stats(name, stats_of(open_sessions=1, chunks=4, rejects={"busy": 1},
                                          per_session={sid: {"chunks": 4}},
                                          capacity={"headroom": 0.5, "sessions": {sid: {"steps": 4}}}))
    fleet.step(ShellTimes(Distribution(count=2, p50=0.0002)))
    fleet.client(A, p.Stats(req=5))
    (reply,) = fleet.to(A, p.StatsReply)
    stats = reply.stats
    assert reply.req == 5 and stats.layout == "router"
    assert stats.chunks_emitted == 8 and stats.sessions == SessionCounts(open=2, total=2)
    assert stats.total and stats.total.replicas_up == 2 and stats.total.max_sessions == 4
    assert stats.total.rejects == {"busy": 2}
    assert stats.per_session == {sid_a: SessionSummary(chunks=4, replica=name_a)}  # not B's
    assert stats.replicas and set(stats.replicas) == {"a", "b"} and stats.replicas[name_a].sessions == 1
    shown = [r.stats for r in stats.replicas.values()]  # each replica's own stats as the router shows them
    assert all(s is not None and "per_session" not in s and "sessions" not in s["capacity"] for s in shown)
    assert all(s is not None and s["capacity"]["headroom"] == 0.5 for s in shown)  # no session ids
    assert sid_a.encode() not in p.encode(p.StatsReply(req=0, stats=msgspec.structs.replace(stats, per_session={})))
    assert stats.router and stats.router.chunk_hold_s == Distribution(count=2, p50=0.0002)  # the shell's own
    assert stats.router.client_messages == 3  # two opens and this stats
    assert not fleet.to_replica(name_a, p.Stats)  # answered from what the router knows


def test_a_replica_with_malformed_stats_is_down_and_the_fleets_stats_stay_whole(fleet: Fleet) -> None:
    sid, name = fleet.open(A)
    fleet.step(Tick(), dt=1.1)
    fleet.answer_stats(name, stats_of(chunks=3, rejects=["busy"], errors={"x": "many"}, sessions=7,
                                      per_session={sid: "?"}) | {"frames_emitted": float("inf")})
    fleet.client(B, p.Stats(req=6))
    (reply,) = fleet.to(B, p.StatsReply)
    assert reply.stats.replicas[name].state == "down" and reply.stats.total.replicas_up == 1
    assert "unusable stats" in reply.stats.replicas[name].down_reason
    assert fleet.errors(A)[-1].session == sid and not fleet.core.sessions


def test_shutdown_closes_every_session_on_its_replica_and_tells_its_client(fleet: Fleet) -> None:
    sid, name = fleet.open(A)
    fleet.client(C, p.Heartbeat())
    fleet.clear()
    out = fleet.step(ShutdownRequested())
    assert [c.message.session for c in fleet.to_replica(name, p.Close)] == [sid]
    assert fleet.errors(A)[-1].code == "shutdown" and fleet.to(A, p.Closed)[-1].reason == "shutdown"
    assert fleet.errors(C)[-1].code == "shutdown"
    assert isinstance(out[-1], Stop) and out[-1].code == 0
    assert fleet.step(Tick()) == []  # nothing more after a stop


def test_remembered_peers_and_reject_reasons_stay_bounded(fleet: Fleet) -> None:
    fleet.open(A)
    for n in range(MAX_PEERS + 50):
        fleet.step(ClientUnreadable(f"peer-{n}".encode(), "not a msgpack message"), dt=0.0001)
    assert len(fleet.core.clients.peers) <= MAX_PEERS and A in fleet.core.clients.peers  # a client with a session stays
    for n in range(MAX_REASONS + 10):
        fleet.core._refuse(B, ClientError(f"code{n}", "x"), None)
    assert len(fleet.core.rejects) <= MAX_REASONS and fleet.core.rejects["other"] > 0


def test_a_replica_moves_only_along_its_transitions() -> None:
    replica = Replica(name="a", endpoint="tcp://a:1", max_sessions=1, listed=True, since=0.0)
    with pytest.raises(IllegalTransition, match="down -> down"):
        replica.move(State.DOWN, 1.0)
    assert replica.state is State.DOWN and replica.since == 0.0
    replica.move(State.UP, 2.0)
    assert replica.state is State.UP and replica.since == 2.0


# ------------------------------------------------------------------------------------------------ pieces


def test_peek_reads_a_chunks_session_whatever_its_size_and_rejects_what_is_not_a_message() -> None:
    big = p.encode(msgspec.structs.replace(chunk("0123456789ab", 4), frames=bytes(2 * 1024 * 4096 * 3),
                                             shape=(2, 1024, 4096, 3)))
    head = relay.peek(memoryview(big))
    assert (head.type, head.session) == ("chunk", "0123456789ab")
    for bad in (b"\x93\x01\x02\x03", b"\xc1", msgspec.msgpack.encode({"type": 3}),
                msgspec.msgpack.encode({"type": "chunk", "v": 9})):
        with pytest.raises(p.ProtocolViolation):
            relay.peek(bad)


def test_router_config_rejects_unknown_keys_duplicate_names_and_bad_deadlines(tmp_path: Path) -> None:
    def write(text: str) -> Path:
        path = tmp_path / "router.toml"
        path.write_text(text)
        return path

    entry = '[[replicas]]\nname = "a"\nendpoint = "tcp://a:5555"\n'
    assert load(write(entry)).replicas[0].max_sessions == 4
    with pytest.raises(ConfigError, match="valid keys of \\[router\\]"):
        load(write("[router]\nprot = 1\n" + entry))
    with pytest.raises(ConfigError, match="unique"):
        load(write(entry + entry))
    with pytest.raises(ConfigError, match="heartbeat_s"):
        load(write(entry), ["--router.heartbeat_s=9"])
    with pytest.raises(ConfigError, match="must start with"):
        load(write('[[replicas]]\nname = "a"\nendpoint = "a:5555"\n'))
    with pytest.raises(ConfigError, match="nothing to route to"):
        load(write("[router]\nport = 1\n"))
    assert load(write("[router]\nregister_bind = \"tcp://127.0.0.1:0\"\n")).replicas == []
    shipped = load("router")  # configs/router/router.toml, by its bare name
    assert shipped.router.port == 5560 and shipped.router.register_bind.endswith(":5561")


def test_a_replica_registers_under_its_name_and_a_reachable_endpoint() -> None:
    from router.registration import advertised
    from runtime.config import ReplicaConfig, ServerConfig

    router = "tcp://r:5561"
    assert advertised(ReplicaConfig(router=router), ServerConfig(host="127.0.0.1"), 5555) == (
        "127.0.0.1:5555", "tcp://127.0.0.1:5555")
    name, endpoint = advertised(ReplicaConfig(router=router, name="n1"), ServerConfig(host="0.0.0.0"), 6000)
    assert name == "n1" and endpoint != "tcp://0.0.0.0:6000" and endpoint.endswith(":6000")  # the node's name
    assert advertised(ReplicaConfig(router=router, advertise_host="node7.cluster"), ServerConfig(host="0.0.0.0"),
                      6000) == ("node7.cluster:6000", "tcp://node7.cluster:6000")


def test_a_server_config_with_a_router_that_is_not_an_endpoint_is_rejected() -> None:
    from runtime import config as config_mod

    with pytest.raises(ConfigError, match=r"replica\.router must be a ZeroMQ endpoint"):
        config_mod.load("cpu-mini", ["--replica.router=router-host:5561"])
    assert config_mod.load("cpu-mini", ["--replica.router=tcp://router-host:5561"]).replica.name == ""


def test_a_registration_cannot_move_a_listed_replica() -> None:
    f = Fleet({"a": 2}, register_bind="tcp://127.0.0.1:5561")
    f.up("a")
    sid, _ = f.open(A)
    thief = p.Register(name="a", endpoint="tcp://elsewhere:5555", max_sessions=2, layout="x", incarnation="i")
    (refused,) = [o.message for o in f.step(RegisterSent(b"peer", thief)) if isinstance(o, ToRegistrant)]
    assert not refused.ok and "listed replica" in refused.message
    assert f.core.replicas["a"].endpoint == "tcp://a:5555" and sid in f.core.sessions and not f.errors(A)


def test_a_new_session_goes_to_the_replica_with_the_most_real_time_headroom_less_its_opens_in_flight() -> None:
    fleet = Fleet({"a": 8, "b": 8})
    fleet.up("a", "b")
    # a holds one session using 70 % of its real-time budget, b two sessions using 40 % between them
    fleet.answer_stats("a", {**stats_of(open_sessions=1), "capacity": {"headroom": 0.3}})
    fleet.answer_stats("b", {**stats_of(open_sessions=2), "capacity": {"headroom": 0.6}})
    assert fleet.core.replicas["b"].headroom() == pytest.approx(0.6)
    fleet.client(A, p.Open(req=1, image=b"png"))  # not answered yet: b's open in flight takes about 0.2 of it
    assert fleet.core.replicas["b"].opening == 1 and fleet.core.replicas["b"].headroom() == pytest.approx(0.4)
    fleet.client(A, p.Open(req=2, image=b"png"))  # b (0.4) still before a (0.3), whatever the session counts
    fleet.client(A, p.Open(req=3, image=b"png"))  # b would be at 0.2 now: a
    assert (fleet.core.replicas["a"].opening, fleet.core.replicas["b"].opening) == (1, 2)


def test_a_fold_of_two_valid_live_inputs_is_one_the_server_accepts_and_keeps_the_steps_asked() -> None:
    """Two states folded at a full replica link: motion summed but held to one state's limit (the server refuses
    a single state beyond it), taps of both, the later keys and revision, a steps request not lost."""
    turn = p.MAX_MOUSE_DEGREES - 60
    first = p.ControlState(req=1, session="s", keys=["w"], mouse=(turn, -turn), taps=["a"], revision=3, steps=2)
    second = p.ControlState(req=2, session="s", keys=["d"], mouse=(turn, -turn), taps=["j"], revision=4)
    folded = first.fold(second)
    p.check_input_state(folded)  # would raise "mouse yaw must be finite and within ±360" unclamped
    assert folded.mouse == (p.MAX_MOUSE_DEGREES, -p.MAX_MOUSE_DEGREES)
    assert (folded.keys, folded.taps, folded.revision, folded.req, folded.steps) == (["d"], ["a", "j"], 4, 2, 2)


def test_a_newer_replicas_stats_with_fields_this_router_does_not_know_keep_it_up(fleet: Fleet) -> None:
    """Additions anywhere in a replica's stats (a chunk's control in a session's recent chunks included) are dropped,
    never a reason to mark the replica down and end its sessions."""
    sid, name = fleet.open(A)
    fleet.step(Tick(), dt=1.1)
    recent = {"index": 0, "frames": 4, "control": {"keys": ["w"], "revision": 2, "sprint": True}, "new": 1}
    fleet.answer_stats(name, stats_of(chunks=3, per_session={sid: {"chunks": 3, "recent_chunks": [recent],
                                                                   "decode_s": {"p95": 0.1}}})
                       | {"gpu": {"name": "H200"}})
    fleet.client(A, p.Stats(req=7))
    (reply,) = fleet.to(A, p.StatsReply)
    assert reply.stats.replicas[name].state == "up" and reply.stats.total.replicas_up == 2  # both of the fleet
    assert reply.stats.per_session[sid].chunks == 3
    assert reply.stats.per_session[sid].recent_chunks[0].control.keys == frozenset({"w"})
    assert reply.stats.replicas[name].stats["gpu"] == {"name": "H200"}  # shown as it came, never read
    assert fleet.core.sessions
