"""Which third-party modules a GPU run imports, and whether a bare GPU machine can satisfy them.

    python scripts/gpu_deps.py --wheels .whl --device-packages "numpy torch ..." scripts/bench_gpu.py launch.py
    python scripts/gpu_deps.py --importable scripts/bench_gpu.py launch.py     # on the machine, after the install

The imports are read from the source (every ``import`` statement of every project module reachable from the
entry files, function-level ones included, so a lazily imported server module counts), not by importing: the
check runs on a CPU machine that may lack torch. An import inside ``try: ... except ImportError`` is optional
and skipped. A needed module is satisfied by a distribution of the device image (``--device-packages``, names as
pip lists them) or by a wheel in ``--wheels`` (the top-level modules inside the wheel, read from the zip; what the
wheel requires in turn must be there too); with ``--importable`` it must import here (a real import, so a wheel's own
dependencies count). Exit 1 names every missing module and the ``pip download`` command that fetches it.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.metadata
import re
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEVICE_PYTHON = (3, 12, 3)
CATCH_IMPORT = ("ImportError", "ModuleNotFoundError", "Exception", "BaseException")
# import name -> distribution name where they differ and the interpreter running the check lacks the package
ALIASES = {"zmq": "pyzmq", "PIL": "pillow", "yaml": "pyyaml", "cv2": "opencv-python-headless", "sklearn":
           "scikit-learn", "skimage": "scikit-image", "google": "protobuf"}  # fmt: skip
REQUIRES = {"ftfy": ("wcwidth",)}  # what a pinned wheel needs in turn (pip download --no-deps fetches none of it)
PINS = {"msgspec": "0.23.0", "pyzmq": "27.3.0", "ftfy": "6.3.1", "wcwidth": "0.9.4"}  # verified cp312 wheels
DOWNLOAD = ("python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "
            "--platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 "
            "--platform manylinux2014_x86_64 -d .whl")  # fmt: skip


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _version_branch_not_taken(child: ast.AST, parent: ast.AST) -> bool:
    """Whether ``child`` is the branch of ``if sys.version_info <op> (3, x)`` that CPython 3.12 does not take."""
    if not isinstance(parent, ast.If):
        return False
    test = parent.test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and ast.unparse(test.left) == "sys.version_info"):
        return False
    try:
        bound = ast.literal_eval(test.comparators[0])
    except ValueError:
        return False
    ops = {ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b,
           ast.GtE: lambda a, b: a >= b}  # fmt: skip
    compare = ops.get(type(test.ops[0]))
    if compare is None:
        return False
    taken = compare(DEVICE_PYTHON, tuple(bound))
    return child in (parent.orelse if taken else parent.body)


def _optional(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether ``node`` sits in a ``try`` body whose handlers catch ImportError (or any exception: an optional
    dependency), or in the branch of a Python version test that the device's Python does not take."""
    child, parent = node, parents.get(node)
    while parent is not None:
        if isinstance(parent, ast.Try) and child in parent.body:
            for handler in parent.handlers:
                names = [handler.type] if not isinstance(handler.type, ast.Tuple) else list(handler.type.elts)
                if handler.type is None or any(isinstance(n, ast.Name) and n.id in CATCH_IMPORT for n in names):
                    return True
        if _version_branch_not_taken(child, parent):
            return True
        child, parent = parent, parents.get(parent)
    return False


def _imports(path: Path) -> list[str]:
    """Absolute dotted names of the non-optional imports in ``path`` (relative imports resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and not _optional(node, parents):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not _optional(node, parents):
            base = node.module or ""
            if node.level:
                parts = package.split(".") if package else []
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names.append(base)
            names += [f"{base}.{alias.name}" for alias in node.names]  # ``from pkg import submodule``
    return [n for n in names if n]


def _project_file(name: str) -> Path | None:
    parts = name.split(".")
    for candidate in (ROOT.joinpath(*parts).with_suffix(".py"), ROOT.joinpath(*parts, "__init__.py")):
        if candidate.is_file():
            return candidate
    return None


def external_imports(entries: list[Path]) -> dict[str, str]:
    """Top-level third-party module -> the first project file that imports it, over every project module
    reachable from ``entries``. The standard library does not count."""
    todo, seen, found = [p.resolve() for p in entries], set(), {}
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imports(path):
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top == "__future__":
                continue
            parts = name.split(".")
            local = [f for f in (_project_file(".".join(parts[:i])) for i in range(1, len(parts) + 1)) if f]
            if local or _project_file(top) or (ROOT / top).is_dir():
                todo += local
            else:
                found.setdefault(top, str(path.relative_to(ROOT)))
    return dict(sorted(found.items()))


def _wheel_tags_fit(filename: str) -> str | None:
    """Why a wheel cannot install on the device (CPython 3.12, Linux x86-64), or None."""
    parts = filename[: -len(".whl")].split("-")
    if len(parts) < 5:
        return "not a wheel file name"
    python, abi, platform = parts[-3:]
    tags = python.split(".")
    stable = abi == "abi3" and any(re.fullmatch(r"cp3\d+", t) and int(t[3:]) <= 12 for t in tags)
    if not ({"py3", "py312", "cp312"} & set(tags) or stable):
        return f"built for {python}-{abi}, the device runs CPython 3.12"
    if not any(p == "any" or (p.startswith("manylinux") and p.endswith("x86_64")) for p in platform.split(".")):
        return f"built for {platform}, the device is manylinux x86_64"
    return None


def wheel_modules(wheel_dir: Path) -> tuple[dict[str, str], list[str]]:
    """Top-level module -> wheel file for every wheel in ``wheel_dir``, and the problems found with the wheels."""
    modules: dict[str, str] = {}
    problems: list[str] = []
    dists: dict[str, str] = {}
    for wheel in sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []:
        dist = normalize(wheel.name.split("-")[0])
        if dist in dists:
            problems.append(f"two wheels of {dist}: {dists[dist]} and {wheel.name} (pip refuses to install both)")
        dists[dist] = wheel.name
        if why := _wheel_tags_fit(wheel.name):
            problems.append(f"{wheel.name}: {why}")
        try:
            names = zipfile.ZipFile(wheel).namelist()
        except zipfile.BadZipFile:
            problems.append(f"{wheel.name}: not a zip archive")
            continue
        for entry in names:
            top = entry.split("/")[0]
            if top.endswith((".dist-info", ".data", ".libs")) or not top:
                continue
            modules.setdefault(top.removesuffix(".py").split(".")[0], wheel.name)
    return modules, problems


def _requirements(wheel: Path) -> list[str]:
    """Distributions a wheel needs (its METADATA's Requires-Dist, extras and markers false on the device dropped)."""
    with zipfile.ZipFile(wheel) as archive:
        meta = next((n for n in archive.namelist() if n.endswith(".dist-info/METADATA")), None)
        text = archive.read(meta).decode() if meta else ""
    needs = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement, _, marker = line.removeprefix("Requires-Dist:").partition(";")
        if "extra" in marker or (marker and not _marker_holds(marker)):
            continue
        needs.append(normalize(re.split(r"[\s<>=!~\[(]", requirement.strip())[0]))
    return needs


def _marker_holds(marker: str) -> bool:
    """An environment marker on the device (CPython 3.12, Linux x86-64); true when it cannot be evaluated here."""
    try:
        from packaging.markers import Marker
    except ImportError:
        return True
    env = {"python_version": "3.12", "python_full_version": ".".join(map(str, DEVICE_PYTHON)), "sys_platform":
           "linux", "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix"}  # fmt: skip
    return Marker(marker.strip()).evaluate(env)


def distribution(module: str) -> str:
    """The distribution that provides ``module`` (pip's name, normalized)."""
    known = importlib.metadata.packages_distributions().get(module)
    return normalize(known[0] if known else ALIASES.get(module, module))


def _imports_here(module: str) -> bool:
    try:
        importlib.import_module(module)  # a real import: a wheel's own dependencies load too
    except Exception as error:
        print(f"  {module}: {type(error).__name__}: {error}", file=sys.stderr)
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("entries", nargs="+", type=Path, help="the files the run executes")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl")
    parser.add_argument("--device-packages", default="", help="distributions of the device image, space-separated")
    parser.add_argument("--importable", action="store_true", help="check that each module imports here instead")
    parser.add_argument("--not-needed", action="append", default=[], help="a module the run never reaches")
    args = parser.parse_args(argv)
    needed = {m: w for m, w in external_imports(args.entries).items() if m not in args.not_needed}
    wheels, problems = wheel_modules(args.wheels)
    device = {normalize(name) for name in args.device_packages.split()}
    wheel_dists = {normalize(w.split("-")[0]) for w in wheels.values()}
    if not args.importable:  # what the wheels need in turn (pip installs them with --no-deps)
        for wheel in sorted(set(wheels.values())):
            for dist in _requirements(args.wheels / wheel):
                if dist not in device and dist not in wheel_dists:
                    problems.append(f"{wheel} needs {dist}, which neither the device image nor a wheel provides; "
                                    f"fetch it with: {DOWNLOAD} {dist}{'==' + PINS[dist] if dist in PINS else ''}")
    missing: dict[str, str] = {}
    for module, where in needed.items():
        if args.importable:
            ok, source = _imports_here(module), "imports"
        elif module in wheels:
            ok, source = True, f"wheel {wheels[module]}"
        else:
            ok, source = distribution(module) in device, f"device image ({distribution(module)})"
        print(f"  {module:14s} {source if ok else 'MISSING'}  (first imported by {where})")
        if not ok:
            missing[module] = where
    for problem in problems:
        print(f"wheel problem: {problem}", file=sys.stderr)
    if missing:
        dists = {distribution(m) for m in missing}
        dists |= {need for d in dists for need in REQUIRES.get(d, ()) if need not in device and need not in wheel_dists}
        names = " ".join(f"{d}=={PINS[d]}" if d in PINS else d for d in sorted(dists))
        print(f"missing modules: {', '.join(sorted(missing))} (imported by {', '.join(sorted(set(missing.values())))})"
              f"; neither the device image nor {args.wheels} provides them. Fetch the wheels here with:\n"
              f"  {DOWNLOAD} {names}", file=sys.stderr)  # fmt: skip
    return 1 if missing or problems else 0


if __name__ == "__main__":
    sys.exit(main())
