"""The README and docs/ held to the code: the configuration reference lists exactly the structs' keys with their
defaults, every link points at a file (and heading) inside the repository, nothing names a path a user does not
have, the README stays short, and every README command is run by a test or by ``.ci/run`` or says what it needs.

The README's CPU quick starts are run as written by ``tests/test_readme_quick_start.py``."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import msgspec
import pytest

from runtime import config as config_mod
from runtime import router_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
REFERENCE = ROOT / "docs" / "configuration.md"
ROW = re.compile(r"^\| `([a-z_0-9]+)\.([a-z_0-9]+)` \| (.+?) \| (.+) \|$", re.MULTILINE)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def struct_defaults() -> dict[str, object]:
    """Every ``section.key`` of the server's and the router's config structs, with its default."""
    keys: dict[str, object] = {}
    for section, value in msgspec.to_builtins(config_mod.Config()).items():
        keys.update({f"{section}.{key}": default for key, default in value.items()})
    router = msgspec.to_builtins(router_config.RouterSection())
    keys.update({f"router.{key}": default for key, default in router.items()})
    for field in router_config.ReplicaEntry.__struct_fields__:
        keys[f"replicas.{field}"] = None  # a [[replicas]] table: no default for name and endpoint
    return keys


def reference_rows() -> dict[str, str]:
    return {f"{section}.{key}": default for section, key, default, _ in ROW.findall(REFERENCE.read_text())}


def test_the_configuration_reference_lists_exactly_the_keys_of_the_config_structs() -> None:
    documented, actual = set(reference_rows()), set(struct_defaults())
    assert not actual - documented, f"in the structs, not in docs/configuration.md: {sorted(actual - documented)}"
    assert not documented - actual, f"in docs/configuration.md, not in the structs: {sorted(documented - actual)}"


def test_the_configuration_reference_gives_each_key_the_structs_default() -> None:
    rows = reference_rows()
    for key, default in struct_defaults().items():
        if key.startswith("replicas.") and default is None:
            continue
        cell = rows[key].strip()
        assert cell.startswith("`") and cell.endswith("`"), f"{key}: the default is written as TOML in backticks"
        written = tomllib.loads(f"v = {cell.strip('`')}")["v"]
        expected = json.loads(json.dumps(default))  # tuples as lists, as TOML reads them
        assert written == expected, f"{key}: docs/configuration.md says {written!r}, the struct {default!r}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in page.read_text().splitlines() if line.startswith("#")}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_points_at_a_file_inside_the_repository_and_an_existing_heading(page: Path) -> None:
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        assert resolved.is_relative_to(ROOT), f"{page.name}: link {target} leaves the repository"
        assert resolved.exists(), f"{page.name}: link {target} points at a missing file"
        if anchor:
            assert anchor in anchors(resolved), f"{page.name}: link {target}: no such heading in {resolved.name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_names_a_path_outside_the_repository(page: Path) -> None:
    text = LINK.sub("", page.read_text())  # links are held inside the repository by the test above
    for outside in (r"(?<![.\w])\.\./", r"DESIGN\.md", r"shared/fixtures", r"device tool", r"\blent\b"):
        found = re.search(outside, text)
        assert found is None, f"{page.name} mentions {found.group(0)!r}, which a user does not have"


REPO_PATH = re.compile(r"`((?:scripts|configs|tests|runtime|ranks|ipc|models|web|assets|docs)/[\w./-]+?)`")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_a_page_names_exists(page: Path) -> None:
    missing = [p for p in REPO_PATH.findall(page.read_text())
               if "*" not in p and not (ROOT / p).exists() and not (ROOT / p).with_suffix(".py").exists()]
    assert not missing, f"{page.name} names paths that do not exist: {missing}"


def test_the_readme_is_a_front_door_under_250_lines_with_a_map_of_every_docs_page() -> None:
    text = README.read_text()
    assert len(text.splitlines()) < 250
    for page in DOCS:
        assert f"](docs/{page.name})" in text, f"the README's map leaves out docs/{page.name}"


def readme_commands() -> list[str]:
    """Every command line of the README's shell blocks (continuations joined), with its trailing comment."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.DOTALL):
        joined = re.sub(r"\\\n\s*", "", block)
        commands += [line.strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")]
    return commands


RUN_BY_CI = {"make demo", "make test"}  # .ci/run runs both


def test_every_readme_command_is_run_by_a_test_or_by_ci_or_says_what_it_needs() -> None:
    from tests.test_readme_quick_start import RUN_AS_WRITTEN

    ci = (ROOT / ".ci" / "run").read_text()
    assert all(f"\n{command}\n" in ci for command in RUN_BY_CI)
    for line in readme_commands():
        command, _, comment = line.partition("  #")
        command = command.strip()
        if command in RUN_BY_CI or command in RUN_AS_WRITTEN:
            continue
        assert "needs" in comment, f"README command not run by a test or .ci/run, nor marked: {command}"
        assert re.search(r"GPU|Slurm|network|download", comment), f"say what it needs: {line}"
