"""scripts/check_golden.py: passes on every published fixture, compares every expected tensor, and its comparison
really rejects errors (beyond the bound, NaN, wrong shape, a tensor never compared)."""

from __future__ import annotations

import pytest
import torch

from scripts import check_golden
from tests.golden_fixtures import FIXTURES, require


def test_check_golden_passes_on_every_fixture_directory(capsys: pytest.CaptureFixture[str]) -> None:
    require(FIXTURES[0] if FIXTURES else None)
    assert check_golden.main(["--all"]) == 0
    out = capsys.readouterr().out
    names = ("t5_context", "y", "plucker_from_poses", "dit_v_c0_s0", "x0_c3", "frames_c3", "kv_cache_evicted_tokens",
             "end_to_end:x0_c0", "end_to_end:frames_c0")
    for name in names:
        assert f"ok   {name} " in out


def test_a_float_error_beyond_the_bound_fails_and_within_passes_and_nan_fails() -> None:
    expected = torch.tensor([5.0, -2.0])
    assert check_golden.compare("x", expected + 0.9e-4, expected)[0]  # bound = 2e-5 * 5
    assert not check_golden.compare("x", expected + 1.1e-4, expected)[0]
    assert not check_golden.compare("x", torch.tensor([float("nan"), -2.0]), expected)[0]


def test_every_expected_tensor_must_be_compared(tmp_path) -> None:  # type: ignore[no-untyped-def]
    fixture = require(FIXTURES[0] if FIXTURES else None)
    names = {name for name, *_ in check_golden.check(fixture)}
    assert check_golden.uncompared(fixture, names) == []
    assert check_golden.uncompared(fixture, names - {"frames_c2", "end_to_end:frames_c2"}) == ["frames_c2"]


def test_integer_facts_must_match_exactly_and_shapes_must_agree() -> None:
    assert not check_golden.compare("t", torch.tensor([999, 978]), torch.tensor([999, 977]))[0]
    assert check_golden.compare("t", torch.tensor([999, 978]), torch.tensor([999, 978]))[0]
    assert not check_golden.compare("x", torch.zeros(2, 3), torch.zeros(3, 2))[0]
