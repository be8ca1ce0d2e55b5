"""One fold of live input (issue 29, point 5): ``InputState.fold`` is the rule rank 0's live control service and the
router (a state that meets a full replica link) both fold by, so input folded on its way and input folded on rank 0
come to the same chunk control."""

from __future__ import annotations

from functools import reduce

from ipc import protocol as p
from ipc.values import clamp_turn
from runtime.control_service import LiveControls
from runtime.router_types import ReplicaRefused, ToReplica
from tests.router_fleet import A, Fleet

LIMIT = p.MAX_MOUSE_DEGREES


def state(revision: int, keys: str = "", mouse: tuple[float, float] = (0.0, 0.0), taps: str = "",
          steps: int | None = None, session: str = "s") -> p.ControlState:  # fmt: skip
    return p.ControlState(req=10 + revision, session=session, keys=list(keys), mouse=mouse, taps=list(taps),
                          revision=revision, steps=steps)


def test_a_fold_holds_the_summed_turn_to_one_states_limit_in_both_directions() -> None:
    folded = state(1, mouse=(LIMIT, -LIMIT)).fold(state(2, mouse=(1.0, -1.0)))
    assert folded.mouse == (LIMIT, -LIMIT)
    p.check_input_state(folded)  # a fold of two valid states is one the server takes
    assert state(1, mouse=(300.0, 5.0)).fold(state(2, mouse=(-100.0, 5.0))).mouse == (200.0, 10.0)


def test_a_fold_takes_the_later_revisions_keys_and_request_whichever_way_round_it_is_called() -> None:
    older, newer = state(3, keys="W", taps="jA", steps=2), state(4, keys="d", taps="ak")
    for folded in (older.fold(newer), newer.fold(older)):
        assert (folded.keys, folded.revision, folded.req) == (["d"], 4, 14)
        assert folded.taps == ["j", "a", "k"]  # the older's taps first, each once, lower-case
        assert folded.steps == 2  # the older's steps request is kept: the newer one said nothing of steps
    assert older.fold(state(4, steps=1)).steps == 1  # a newer steps request wins


def test_a_fold_of_plain_input_states_keeps_their_type() -> None:
    folded = p.InputState(keys=["w"], revision=1).fold(p.InputState(taps=["i"], mouse=(2.0, 0.0), revision=2))
    assert folded == p.InputState(keys=[], taps=["i"], mouse=(2.0, 0.0), revision=2)


def test_the_router_and_rank_0_fold_a_sequence_of_live_inputs_to_the_same_chunk_control() -> None:
    """Four states, each meeting a full replica link, reach the replica as one folded state; rank 0 folds the same
    four arriving one by one. Both cut the same control, the turn beyond the limit included (rank 0 used to sum
    and clamp at the cut: 300 degrees where the router's fold had sent 260)."""
    f = Fleet({"a": 2})
    f.up("a")
    sid, _ = f.open(A)
    sequence = [state(1, "w", (200.0, 10.0), "j", session=sid), state(2, "wd", (200.0, 0.0), session=sid),
                state(3, "d", (-100.0, -30.0), "k", session=sid), state(4, "D", (5.0, 0.0), "J", session=sid)]
    for message in sequence:
        for out in f.client(A, message):
            if isinstance(out, ToReplica) and out.origin is not None and out.origin.kind == "control_state":
                f.step(ReplicaRefused("a", f.generation["a"], out.origin))  # the link is full: folded again
    routed = f.core.sessions[sid].state
    assert routed is not None and routed.revision == 4  # the four folded into one, waiting for the link

    through_router, direct = LiveControls(), LiveControls()
    through_router.update(routed)
    for message in sequence:
        direct.update(message)
    assert through_router.cut(0, 0) == direct.cut(0, 0) == p.ChunkControl(
        keys=frozenset("djk"), mouse=(LIMIT - 100.0 + 5.0, -20.0), revision=4)
    assert routed == reduce(lambda a, b: a.fold(b), sequence)  # the router folds by the rule, not a copy of it


def test_the_router_refuses_live_input_a_server_would_refuse_before_folding_it_in() -> None:
    """Input that waits for a full link is folded on the router: it is checked first, as a server checks it, so a
    non-finite or out-of-range turn or an unknown key is refused there and never spoils what is folded."""
    f = Fleet({"a": 2})
    f.up("a")
    sid, _ = f.open(A)
    for out in f.client(A, state(1, "w", (10.0, 0.0), session=sid)):
        if isinstance(out, ToReplica) and out.origin is not None and out.origin.kind == "control_state":
            f.step(ReplicaRefused("a", f.generation["a"], out.origin))  # the link is full: it waits, folded
    held = f.core.sessions[sid].state
    assert held is not None and held.revision == 1
    bad = [state(2, "w", (float("nan"), 0.0), session=sid), state(3, "w", (float("inf"), 0.0), session=sid),
           state(4, "w", (LIMIT + 1.0, 0.0), session=sid), state(5, "w", taps="?", session=sid)]
    for message in bad:
        f.client(A, message)
    assert [e.code for e in f.errors(A)][-4:] == ["malformed", "malformed", "malformed", "unknown_keys"]
    assert f.core.sessions[sid].state == held  # nothing of them was folded in
    assert clamp_turn(float("nan")) == clamp_turn(float("-inf")) == 0.0  # and the fold's own clamp is total
