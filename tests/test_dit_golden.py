"""The DiT, camera path, schedule and streaming loop reproduce every golden fixture within a fifth of the fixture
bound (the fixture bound itself is what ``scripts/check_golden.py`` and the other model tests hold)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scripts.check_golden import compare
from scripts.golden_dit import checks
from tests.golden_fixtures import fixture_params, require

DIT_KEYS = {"dit_v_c0_s0", "latents_all", "plucker_from_poses", "relative_poses", "c2ws_infer", "intrinsics_scaled"}
# The fixture's bound says what conforms; the DiT's float32 errors measure 1.0-1.7e-6 against bounds of 6.6e-5 to
# 1.2e-4 there, so it cannot see a 3x RMSNorm epsilon (errors 2.2-3.2e-5). A fifth of it still leaves 8x headroom
# over what we measure and catches that change.
REGRESSION_FRACTION = 0.2


@pytest.mark.parametrize("fixture", fixture_params())
def test_every_dit_tensor_of_the_fixture_is_within_the_bound(fixture: Path | None) -> None:
    fixture = require(fixture)
    torch.set_num_threads(1)
    failures, seen = [], set()
    for name, actual, expected in checks(fixture):
        seen.add(name)
        ok, error, _, bound = compare(name, actual, expected)
        if expected.is_floating_point():
            ok, bound = ok and error <= REGRESSION_FRACTION * bound, REGRESSION_FRACTION * bound
        if not ok:
            failures.append(f"{name}: max error {error:.3e} > {bound:.3e} (shapes {tuple(actual.shape)}, "
                            f"{tuple(expected.shape)})")
    assert not failures, "\n".join(failures)
    assert seen >= DIT_KEYS and any(n.startswith("dit_v_refresh_c") for n in seen), sorted(seen)
