"""The DiT, camera path, schedule and streaming loop reproduce every golden fixture within tolerance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scripts.golden_dit import checks

GOLDEN = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "golden"
FIXTURES = sorted(p for p in GOLDEN.iterdir() if (p / "config.json").exists()) if GOLDEN.is_dir() else []


@pytest.mark.skipif(not FIXTURES, reason=f"no golden fixtures under {GOLDEN}")
@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda p: p.name)
def test_every_dit_tensor_of_the_fixture_is_within_tolerance(fixture: Path) -> None:
    torch.set_num_threads(1)
    failures, seen = [], 0
    for name, actual, expected in checks(fixture):
        seen += 1
        if tuple(actual.shape) != tuple(expected.shape):
            failures.append(f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
            continue
        if not expected.is_floating_point():
            if not torch.equal(actual.to(expected.dtype), expected):
                failures.append(f"{name}: {actual.tolist()} != {expected.tolist()}")
            continue
        err = (actual.double() - expected.double()).abs().max().item()
        tol = 1e-4 * max(1.0, expected.double().abs().max().item())
        if not err <= tol:
            failures.append(f"{name}: max error {err:.3e} > {tol:.3e}")
    assert seen > 0
    assert not failures, "\n".join(failures)
