"""Where the golden fixtures are, and the rule for their absence: outside CI a test skips with the reason; in CI
(``CI`` set) a missing fixture fails, so conformance can never pass by skipping."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from scripts.check_golden import GOLDEN_DIR, fixture_dirs

FIXTURES: list[Path] = fixture_dirs()


def require(fixture: Path | None) -> Path:
    """The fixture directory, or a skip (a failure in CI) naming where the fixtures were looked for."""
    if fixture is not None and (fixture / "config.json").is_file():
        return fixture
    reason = f"no golden fixtures under {GOLDEN_DIR} (the shared folder beside the checkout is absent)"
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; conformance must not be skipped in CI")
    pytest.skip(reason)


def fixture_params() -> list[object]:
    """Parameters for one test per fixture directory; one ``missing`` case when there are none (never zero tests)."""
    return list(FIXTURES) or [pytest.param(None, id="missing")]
