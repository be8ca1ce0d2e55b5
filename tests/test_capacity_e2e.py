"""Real-time admission and the degrade ladder on a real server (3 CPU ranks, the synthetic backend whose denoise
costs in proportion to its passes, configs/cpu-capacity.toml): a third session makes the first two step down, and
closing it lets them climb back. Expectations come from the server's own measured stage times (its ``stats``), not
from wall-clock constants, so a loaded machine changes the numbers, not the verdict."""

from __future__ import annotations

import pytest

from ipc.client import Client
from scripts.bench_capacity import MEDIA_S, Player
from scripts.local_server import LocalServer

pytestmark = pytest.mark.multiprocess


def test_a_third_session_makes_the_first_two_step_down_and_closing_it_lets_them_climb_back() -> None:
    with LocalServer("cpu-capacity", ["--capacity.ladder=all"]) as server:
        a = Player(server.endpoint)
        a.wait_for("measured", lambda c: c.index >= 3)
        b = Player(server.endpoint)
        b.wait_for("measured", lambda c: c.index >= 3)
        with Client(server.endpoint) as admin:
            two = admin.stats().capacity
        period = two.predicted_period_s
        assert period is not None and two.headroom >= 0  # two sessions keep real time at 4 steps (admitted so)
        mine = a.own_stats(lambda s: s.measured_rtf is not None)
        assert mine.steps == 4 and mine.predicted_rtf >= 1 + two.margin
        assert mine.measured_rtf >= 0.97  # it keeps real time, as predicted
        # three sessions at 4 steps would share the DiT three ways: by the server's own estimate, not in real time
        assert 1.5 * period * (1 + two.margin) > MEDIA_S

        c = Player(server.endpoint)
        for player in (a, b):
            down = player.wait_for("stepping down", lambda ch: ch.facts.steps_changed == "ladder_down")
            chunk = next(ch for ch in player.chunks if ch.index == down)
            assert chunk.facts.steps < 4
            assert all(ch.facts.steps == 4 for ch in player.chunks if ch.index < down)
        c_steps = c.wait_for("running", lambda ch: ch.index >= 1)
        assert next(ch for ch in c.chunks if ch.index == c_steps).facts.steps < 4
        with Client(server.endpoint) as admin:
            three = admin.stats().capacity
        assert three.headroom >= 0  # real time holds for all three after the ladder

        c.close()
        for player in (a, b):
            down = next(ch.index for ch in player.chunks if ch.facts.steps_changed == "ladder_down")
            up = player.wait_for("climbing back", lambda ch: ch.facts.steps_changed == "ladder_up", after=down + 1)
            assert next(ch for ch in player.chunks if ch.index == up).facts.steps == 4
        for player in (a, b):
            player.close()
        assert server.stop() == 0
