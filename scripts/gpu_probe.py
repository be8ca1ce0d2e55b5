"""The GPU run's first step: the machine's cold ``import torch`` timed under its own budget, the CUDA context, and
the C compiler triton needs, each written into the run's JSON as soon as it is known.

    python scripts/gpu_probe.py --out out/gpu_run/bench_gpu.json

It runs before anything else imports torch: on a freshly started machine the first import reads several GB of
CUDA libraries from a cold page cache, and a later step's short timeout must not be what pays for that. Inductor on
CUDA compiles triton's launcher stubs with a C compiler (``CC``, else ``cc``/``gcc``/``clang`` on PATH); without one
``compile = blocks`` fails at its first chunk and the server runs eager, so the compiler and its version are
recorded here, where a reader of the results sees them first. The entry is merged under ``probe`` (other keys kept).
"""

from __future__ import annotations

import time

BEGAN = time.perf_counter()  # before any other import: the cold import is what this script measures

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402


def c_compiler() -> dict[str, Any]:
    """The C compiler triton would pick (its own order: ``$CC``, then cc, gcc, clang) and its first version line."""
    candidates = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    for name in candidates:
        path = shutil.which(name)
        if path is None:
            continue
        try:
            done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
            version = (done.stdout or done.stderr).splitlines()[0] if (done.stdout or done.stderr) else ""
        except (OSError, subprocess.TimeoutExpired) as error:
            version = f"--version failed: {error}"
        return {"found": True, "path": path, "version": version}
    return {"found": False, "looked_for": candidates,
            "consequence": "triton cannot build its launchers: compile = blocks/graphs fall back to eager"}


def merge(out: Path, entry: dict[str, Any]) -> None:
    """Merge ``entry`` as ``probe`` into ``out`` (temporary name first: a kill mid-write keeps the last whole file)."""
    results = json.loads(out.read_text()) if out.exists() else {}
    results["probe"] = entry
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str))
    tmp.replace(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the run's JSON (merged into)")
    args = parser.parse_args(argv)
    entry: dict[str, Any] = {"c_compiler": c_compiler()}
    print(f"C compiler: {json.dumps(entry['c_compiler'])}", flush=True)
    merge(args.out, entry)  # the compiler is known even if the import below never returns
    began = time.perf_counter()
    import torch

    entry["import_torch_s"] = time.perf_counter() - began
    entry["torch"], entry["cuda"] = torch.__version__, torch.version.cuda
    print(f"cold import torch {entry['import_torch_s']:.1f} s (torch {torch.__version__}, cuda {torch.version.cuda})",
          flush=True)  # fmt: skip
    merge(args.out, entry)
    began = time.perf_counter()
    entry["gpus"] = torch.cuda.device_count()
    if entry["gpus"]:
        torch.zeros(1, device="cuda")  # the context, created once here so later steps time their own work
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        entry.update(device=torch.cuda.get_device_name(0), context_gib=(total - free) / 2**30)
    entry["cuda_init_s"] = time.perf_counter() - began
    try:
        import triton

        entry["triton"] = triton.__version__
    except ImportError:
        entry["triton"] = None
    entry["total_s"] = time.perf_counter() - BEGAN
    print(f"probe: {json.dumps(entry)}", flush=True)
    merge(args.out, entry)
    return 0


if __name__ == "__main__":
    sys.exit(main())
