"""The ports tests and scripts hand to the processes they start: never from the range the kernel gives outgoing
connections (where any connection may take one before the child binds it), and never one in use."""

from __future__ import annotations

import socket

from scripts.ports import FLOOR, bindable, ephemeral_floor, free_port


def test_a_drawn_port_lies_below_the_kernels_own_range_and_is_free() -> None:
    ceiling = ephemeral_floor()
    drawn = [free_port() for _ in range(50)]
    assert all(FLOOR <= port < ceiling for port in drawn), drawn
    assert all(bindable(port) for port in drawn)
    assert len(set(drawn)) > 40  # drawn at random, not one port again and again


def test_a_port_someone_listens_on_is_not_bindable() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        held.listen()
        assert not bindable(held.getsockname()[1])
