"""InOrder: exactly-once, in-order acceptance with retries recognised and gaps/conflicts rejected."""

from __future__ import annotations

import pytest

from runtime.ordering import InOrder, OrderingError, Verdict


def test_accepts_indices_in_order_and_moves_the_cursor_by_one() -> None:
    order = InOrder()
    assert [order.accept(i, f"p{i}") for i in range(3)] == [Verdict.ACCEPTED] * 3
    assert order.expected == 3
    assert order.accepted == 3


def test_retry_with_same_payload_is_a_duplicate_and_changes_nothing() -> None:
    order = InOrder()
    order.accept(0, "a")
    order.accept(1, "b")
    assert order.accept(0, "a") is Verdict.DUPLICATE
    assert order.expected == 2


def test_retry_with_a_different_payload_is_a_conflict() -> None:
    order = InOrder()
    order.accept(0, "a")
    with pytest.raises(OrderingError) as info:
        order.accept(0, "other")
    assert info.value.kind == "conflict"
    assert info.value.expected == 1
    assert order.expected == 1


def test_gap_is_rejected_naming_the_expected_index() -> None:
    order = InOrder()
    order.accept(0)
    with pytest.raises(OrderingError, match="expected index 1") as info:
        order.accept(2)
    assert info.value.kind == "gap"
    assert order.expected == 1


def test_index_older_than_the_memory_is_stale_not_a_duplicate() -> None:
    order = InOrder(memory=2)
    for i in range(5):
        order.accept(i, i)
    assert order.accept(3, 3) is Verdict.DUPLICATE
    with pytest.raises(OrderingError) as info:
        order.accept(1, 1)
    assert info.value.kind == "stale"


def test_index_before_start_is_invalid() -> None:
    order = InOrder(start=5)
    with pytest.raises(OrderingError) as info:
        order.accept(-1)
    assert info.value.kind == "invalid"
    assert order.accept(5) is Verdict.ACCEPTED


def test_check_is_a_pure_query() -> None:
    order = InOrder()
    assert order.check(0, "a") is Verdict.ACCEPTED
    assert order.check(0, "a") is Verdict.ACCEPTED
    assert order.expected == 0


def test_memory_stays_bounded_over_a_long_stream() -> None:
    order = InOrder(memory=3)
    for i in range(10_000):
        order.accept(i, i)
    assert len(order._memory) == 3


def test_rejects_bad_construction() -> None:
    with pytest.raises(ValueError):
        InOrder(start=-1)
    with pytest.raises(ValueError):
        InOrder(memory=0)
