"""What every benchmark writes, and how it is asked to run small: one writer, one folder, one ``--smoke``.

The convention (``tests/test_bench_smoke.py`` holds every ``scripts/bench_*.py`` to it):

- A benchmark writes one JSON object to ``$OUT/<script name>.json`` (``out/`` at the repository root when ``$OUT``
  is not set; its ``--json``/``--out`` flag names another file). ``write_json`` writes it: typed values (the
  metrics' structs, a chunk's facts, numpy numbers, paths) become plain JSON, and ``"when"`` says when it ran.
- Its headline numbers and pass/miss answers sit under top-level keys (its verdict keys, listed in the smoke test).
- ``--smoke``: tiny sizes and counts, a few seconds of work: proves the benchmark runs end to end and writes its
  JSON. Its numbers mean nothing, and it says so (``"smoke": true``); flags given with it still win.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def out_dir() -> Path:
    """Where benchmarks write: ``$OUT`` (a device run's folder that comes back), else ``out/``."""
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "out"


def out_path(name: str) -> Path:
    """The default JSON file of a benchmark (``name``: its file name, e.g. ``bench_router.json``)."""
    return out_dir() / name


def plain(value: Any) -> Any:
    """``json.dumps``'s fallback: a value it cannot write as plain JSON (a ``TypeError`` for anything unknown, as
    ``json`` itself: a benchmark that writes an object it cannot read back is a bug to hear about)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    try:
        return msgspec.to_builtins(value, order="deterministic")  # structs, dataclasses, enums, sets
    except TypeError:
        raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable") from None


def write_json(path: Path, payload: Mapping[str, Any], smoke: bool = False) -> Path:
    """Write ``payload`` (with ``"when"``, and ``"smoke"`` when it is a smoke run) to ``path``, whole or not at
    all (a reader never sees half a file)."""
    text = json.dumps({"when": time.strftime("%Y-%m-%dT%H:%M:%S"), **({"smoke": True} if smoke else {}), **payload},
                      indent=1, default=plain)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)
    return path


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None, smoke: Mapping[str, Any]) -> Any:
    """``parser``'s arguments, with ``--smoke`` added: it makes ``smoke`` (dest -> value) the defaults, so a
    smoke run is small whatever the full defaults are, and a flag given with it still wins."""
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, a few seconds: checks that the benchmark runs (its numbers mean nothing)")
    args = list(sys.argv[1:] if argv is None else argv)
    if "--smoke" in args:
        parser.set_defaults(**smoke)
    return parser.parse_args(args)
