"""The live control service: taps, held keys, mouse motion and revisions turned into per-chunk snapshots."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipc import protocol
from ipc.protocol import KEYS, MAX_MOUSE_DEGREES, ChunkControl
from runtime.control_service import NO_REVISION, ControlStateError, CutOrderError, LiveControls


def state(keys: str = "", revision: int = 0, mouse: tuple[float, float] = (0.0, 0.0),
          taps: str = "") -> protocol.ControlState:
    return protocol.ControlState(req=0, session="s", keys=list(keys), mouse=mouse, taps=list(taps), revision=revision)


def test_tap_is_consumed_by_exactly_one_chunk_even_if_released_before_the_cut() -> None:
    live = LiveControls()
    live.update(state(keys="", taps="w", revision=1))  # pressed and released before any cut
    first = live.cut(0, 0)
    second = live.cut(1, 0)
    assert first is not None and first.keys == frozenset("w")
    assert second is not None and second.keys == frozenset()


def test_tap_goes_to_the_next_chunk_not_yet_submitted() -> None:
    live = LiveControls()
    assert live.cut(0, 0) == ChunkControl(revision=NO_REVISION)
    live.update(state(taps="j", revision=1))  # arrives while chunk 0 is being produced
    assert live.cut(1, 0) == ChunkControl(keys=frozenset("j"), revision=1)
    assert live.cut(2, 1) == ChunkControl(revision=1)


def test_held_state_is_cut_at_most_one_chunk_ahead_of_the_chunk_being_produced() -> None:
    live = LiveControls()
    live.update(state(keys="w", revision=1))
    assert live.cut(0, 0) is not None
    assert live.cut(1, 0) is not None
    assert live.cut(2, 0) is None  # would be two ahead of chunk 0
    assert live.next_index == 2
    assert live.cut(2, 1) is not None  # chunk 0 emitted: chunk 1 is being produced


def test_release_replaces_snapshots_not_yet_submitted_but_not_submitted_ones() -> None:
    live = LiveControls()
    live.update(state(keys="wd", revision=1))
    submitted = [live.cut(0, 0), live.cut(1, 0)]
    assert live.cut(2, 0) is None  # chunk 2 would copy "wd", but it may not be cut yet
    live.update(state(keys="", revision=2))  # release
    assert submitted == [ChunkControl(keys=frozenset("wd"), revision=1)] * 2
    assert live.cut(2, 1) == ChunkControl(keys=frozenset(), revision=2)


def test_new_state_replaces_pending_snapshot() -> None:
    live = LiveControls()
    live.update(state(keys="w", revision=1))
    live.cut(0, 0)
    live.cut(1, 0)
    live.update(state(keys="a", revision=2))
    live.update(state(keys="al", revision=3))
    assert live.cut(2, 1) == ChunkControl(keys=frozenset("al"), revision=3)


def test_mouse_motion_goes_into_the_next_snapshot_only() -> None:
    live = LiveControls()
    live.update(state(mouse=(1.5, -0.5), revision=1))
    live.update(state(mouse=(2.0, 1.0), revision=2))
    assert live.cut(0, 0) == ChunkControl(mouse=(3.5, 0.5), revision=2)
    assert live.cut(1, 0) == ChunkControl(mouse=(0.0, 0.0), revision=2)


def test_mouse_motion_is_kept_while_a_cut_is_refused() -> None:
    live = LiveControls()
    live.cut(0, 0)
    live.cut(1, 0)
    live.update(state(mouse=(4.0, 0.0), revision=1))
    assert live.cut(2, 0) is None
    live.update(state(mouse=(1.0, 2.0), revision=2))
    snapshot = live.cut(2, 1)
    assert snapshot is not None and snapshot.mouse == (5.0, 2.0)


def test_idle_session_keeps_running_with_a_still_camera() -> None:
    live = LiveControls()
    snapshots = [live.cut(i, max(0, i - 1)) for i in range(5)]
    assert snapshots == [ChunkControl(revision=NO_REVISION)] * 5


def test_pause_when_idle_pauses_until_the_next_input() -> None:
    live = LiveControls(pause_when_idle=True)
    assert live.cut(0, 0) is None
    live.update(state(keys="s", revision=1))
    assert live.cut(0, 0) == ChunkControl(keys=frozenset("s"), revision=1)
    live.update(state(keys="", revision=2))
    assert live.idle and live.cut(1, 0) is None
    live.update(state(taps="d", revision=3))
    assert live.cut(1, 0) == ChunkControl(keys=frozenset("d"), revision=3)
    assert live.cut(2, 1) is None  # the tap was consumed: idle again
    live.update(state(mouse=(0.0, 2.0), revision=4))
    assert live.cut(2, 1) == ChunkControl(mouse=(0.0, 2.0), revision=4)


def test_snapshot_carries_the_revision_of_the_latest_state_folded_in() -> None:
    live = LiveControls()
    assert live.cut(0, 0) == ChunkControl(revision=NO_REVISION)
    live.update(state(keys="w", revision=7))
    live.update(state(keys="wa", revision=9))
    assert live.cut(1, 0) == ChunkControl(keys=frozenset("wa"), revision=9)


@pytest.mark.parametrize("revision", [3, 2])
def test_stale_or_repeated_revision_is_rejected_and_changes_nothing(revision: int) -> None:
    live = LiveControls()
    live.update(state(keys="w", mouse=(1.0, 0.0), revision=3))
    with pytest.raises(ControlStateError, match="not newer") as err:
        live.update(state(keys="s", mouse=(9.0, 9.0), taps="i", revision=revision))
    assert err.value.reason == "stale_revision"
    assert live.cut(0, 0) == ChunkControl(keys=frozenset("w"), mouse=(1.0, 0.0), revision=3)


def test_key_names_are_case_insensitive() -> None:
    live = LiveControls()
    live.update(state(keys="Wa", taps="J", mouse=(1.0, -2.5), revision=4))
    assert live.cut(0, 0) == ChunkControl(keys=frozenset("waj"), mouse=(1.0, -2.5), revision=4)


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (state(keys="wq", revision=1), "unknown_keys"),
        (state(taps="x", revision=1), "unknown_keys"),
        (state(revision=-1), "malformed"),
        (state(mouse=(math.nan, 0.0), revision=1), "malformed"),
        (state(mouse=(0.0, math.inf), revision=1), "malformed"),
    ],
)
def test_bad_live_input_is_rejected_with_a_reason_and_changes_nothing(bad: protocol.ControlState,
                                                                      reason: str) -> None:
    live = LiveControls()
    live.update(state(keys="w", mouse=(1.0, 0.0), revision=0))
    with pytest.raises(ControlStateError) as err:
        live.update(bad)
    assert err.value.reason == reason
    assert live.revision == 0 and live.cut(0, 0) == ChunkControl(keys=frozenset("w"), mouse=(1.0, 0.0), revision=0)


@pytest.mark.parametrize(
    "body",
    [
        {"keys": "wasd", "revision": 1},
        {"keys": [1], "revision": 1},
        {"keys": [], "revision": True},
        {"keys": [], "revision": "3"},
        {"keys": [], "mouse": [1.0], "revision": 1},
        {"keys": [], "mouse": ["1", 0.0], "revision": 1},
    ],
)
def test_live_state_of_the_wrong_types_never_reaches_the_service(body: dict[str, object]) -> None:
    import msgspec

    data = msgspec.msgpack.encode({"v": protocol.PROTOCOL_VERSION, "type": "control_state", "req": 1, "session": "s",
                                   **body})
    with pytest.raises(protocol.ProtocolViolation, match="invalid 'control_state' message") as err:
        protocol.decode(data, "client")
    assert err.value.req == 1  # the reply reaches the request


def test_out_of_order_cut_is_a_caller_error_and_changes_nothing() -> None:
    live = LiveControls()
    live.update(state(taps="w", revision=1))
    with pytest.raises(CutOrderError):
        live.cut(1, 0)
    with pytest.raises(CutOrderError):
        live.cut(0, 1)  # chunk 1 cannot be in production without control 0
    assert live.next_index == 0
    assert live.cut(0, 0) == ChunkControl(keys=frozenset("w"), revision=1)


key_sets = st.frozensets(st.sampled_from(sorted(KEYS)))
events = st.one_of(
    st.tuples(
        st.just("state"),
        key_sets,
        st.lists(st.sampled_from(sorted(KEYS)), max_size=3),
        st.tuples(st.sampled_from([0.0, 0.5, -1.25, 3.0]), st.sampled_from([0.0, 0.25, -2.0])),
        st.integers(1, 3),
    ),
    st.tuples(st.just("cut")),
    st.tuples(st.just("emit")),
)


@settings(max_examples=300, deadline=None)
@given(timeline=st.lists(events, max_size=60), pause_when_idle=st.booleans())
def test_random_timelines_keep_every_invariant(timeline: list[tuple], pause_when_idle: bool) -> None:
    live = LiveControls(pause_when_idle=pause_when_idle)
    current = 0  # chunk being produced: lowest index not yet emitted
    revision = NO_REVISION
    held: frozenset[str] = frozenset()
    taps_pending: set[str] = set()
    mouse_in = [0.0, 0.0]  # total motion received
    mouse_out = [0.0, 0.0]  # total motion given out in snapshots
    mouse_pending = [0.0, 0.0]
    submitted: list[ChunkControl] = []
    for event in timeline:
        if event[0] == "state":
            _, keys, taps, mouse, step = event
            revision = max(revision, 0) + step
            live.update(protocol.ControlState(req=0, session="s", keys=sorted(keys), mouse=mouse, taps=taps,
                                              revision=revision))
            held = keys
            taps_pending |= set(taps)
            mouse_in = [mouse_in[0] + mouse[0], mouse_in[1] + mouse[1]]
            mouse_pending = [mouse_pending[0] + mouse[0], mouse_pending[1] + mouse[1]]
        elif event[0] == "emit":
            if current < len(submitted):  # only a chunk that has its control can be emitted
                current += 1
        else:
            index = len(submitted)
            idle = not held and not taps_pending and mouse_pending == [0.0, 0.0]
            snapshot = live.cut(index, current)
            if index > current + 1 or (pause_when_idle and idle):
                assert snapshot is None
                continue
            assert snapshot is not None
            assert snapshot.keys == held | taps_pending  # each pending tap lands here, and only here
            assert snapshot.revision == revision
            assert snapshot.mouse == pytest.approx(tuple(mouse_pending))
            mouse_out = [mouse_out[0] + snapshot.mouse[0], mouse_out[1] + snapshot.mouse[1]]
            taps_pending, mouse_pending = set(), [0.0, 0.0]
            submitted.append(snapshot)
        assert len(submitted) <= current + 2  # never more than the chunk being produced and the next
        assert live.next_index == len(submitted)
    assert [o + p for o, p in zip(mouse_out, mouse_pending)] == pytest.approx(mouse_in)


def test_mouse_motion_beyond_a_full_turn_per_chunk_is_clamped_not_an_error() -> None:
    live = LiveControls()
    live.update(state(mouse=(300.0, -300.0), revision=1))
    live.update(state(mouse=(300.0, -300.0), revision=2))
    snapshot = live.cut(0, 0)
    assert snapshot is not None and snapshot.mouse == (MAX_MOUSE_DEGREES, -MAX_MOUSE_DEGREES)
