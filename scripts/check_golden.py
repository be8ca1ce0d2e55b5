"""Conformance against the golden fixtures of the official implementation.

    python scripts/check_golden.py --fixture ../shared/fixtures/golden/tiny-a     # one directory
    python scripts/check_golden.py --all                                          # every directory found
    python scripts/check_golden.py --all --compile                                # the DiT compiled (blocks)

Recomputes every expected tensor the project can (umT5, camera rays, VAE condition encode, every DiT call of
the stream with the rolling KV cache, the decoded frames, and the whole chain from raw inputs to frames) with this
project's code, prints one line per tensor
(name, max abs error, max abs expected, bound) and exits non-zero if any float tensor exceeds
``2e-5 * max(1, max|expected|)`` (the fixture README's bound; NaN fails), any integer fact (timesteps, cache
counters) differs at all, or any tensor of ``expected.safetensors`` was not compared (a check that stopped
producing a tensor fails instead of passing quietly). Sizes are read from each fixture's config.json, so fixture
sets never seen before are checked the same way.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts import golden_dit, golden_e2e, golden_vae_t5

GOLDEN_DIR = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "golden"
RELATIVE_BOUND = 2e-5  # times max(1, max|expected|): ~10x what thread counts and independent implementations differ by


def fixture_dirs(root: Path = GOLDEN_DIR) -> list[Path]:
    return sorted(p for p in root.iterdir() if (p / "config.json").exists()) if root.is_dir() else []


def compare(name: str, actual: torch.Tensor, expected: torch.Tensor) -> tuple[bool, float, float, float]:
    """(ok, max abs error, max abs expected, bound) of one tensor."""
    if tuple(actual.shape) != tuple(expected.shape):
        return False, float("inf"), float(expected.abs().max()) if expected.numel() else 0.0, 0.0
    if not expected.is_floating_point():
        error = float((actual.to(torch.int64) - expected.to(torch.int64)).abs().max()) if expected.numel() else 0.0
        return error == 0.0, error, float(expected.abs().max()) if expected.numel() else 0.0, 0.0
    expected64, actual64 = expected.double(), actual.double()
    scale = float(expected64.abs().max()) if expected.numel() else 0.0
    bound = RELATIVE_BOUND * max(1.0, scale)
    error = float((actual64 - expected64).abs().max()) if expected.numel() else 0.0
    return error <= bound, error, scale, bound  # NaN: the comparison is False, so NaN fails


def check(fixture: Path, compile: str = "off") -> Iterator[tuple[str, bool, float, float, float]]:
    """Every check of ``fixture``; the DiT compiled as ``compile`` (strict: a block that cannot compile is an
    error, never a quiet eager run)."""
    for name, actual, expected in golden_vae_t5.checks(fixture):
        yield (name, *compare(name, actual, expected))
    for module in (golden_dit, golden_e2e):
        for name, actual, expected in module.checks(fixture, compile):
            yield (name, *compare(name, actual, expected))


def expected_key(name: str) -> str:
    """The ``expected.safetensors`` key a check name compares against (``end_to_end:x0_c0`` -> ``x0_c0``)."""
    return name.rsplit(":", 1)[-1]


def uncompared(fixture: Path, names: set[str]) -> list[str]:
    """Keys of the fixture's ``expected.safetensors`` that no check compared."""
    with safe_open(str(Path(fixture) / "expected.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    return sorted(keys - {expected_key(n) for n in names})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixture", type=Path, action="append", default=[], help="a fixture directory")
    parser.add_argument("--all", action="store_true", help=f"every fixture directory under {GOLDEN_DIR}")
    parser.add_argument("--compile", nargs="?", const="blocks", default="off", choices=("off", "blocks", "graphs"),
                        help="run the DiT compiled ([model] compile; bare --compile: blocks)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    fixtures = list(args.fixture) + (fixture_dirs() if args.all else [])
    if not fixtures:
        print(f"no fixture directories (looked in {GOLDEN_DIR}); give --fixture DIR", file=sys.stderr)
        return 2
    failures = 0
    for fixture in fixtures:
        print(f"# {fixture}")
        seen: set[str] = set()
        for name, ok, error, scale, bound in check(fixture, args.compile):
            failures += not ok
            seen.add(name)
            print(f"{'ok  ' if ok else 'FAIL'} {name:32s} max_abs_err={error:.3e} max_abs_expected={scale:.3e} "
                  f"bound={bound:.1e}")
        for key in uncompared(fixture, seen):
            failures += 1
            print(f"FAIL {key:32s} never compared")
    if args.compile != "off":
        stats, breaks = counters["stats"], sum(counters["graph_break"].values())
        failures += breaks
        print(f"{'ok  ' if not breaks else 'FAIL'} compile={args.compile}: {stats['unique_graphs']} compiled graphs, "
              f"{breaks} graph breaks")
    print(f"{'all tensors within tolerance' if not failures else f'{failures} tensors out of tolerance'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
