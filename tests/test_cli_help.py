"""``launch.py``'s command line as a user meets it: ``--help`` lists the configs, the override syntax and every key;
``--print-config`` prints what would run; ``--check`` validates a config and a checkpoint folder without starting
ranks; a wrong enum value names the valid ones. Each runs ``launch.py`` as its own process, as a user would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from runtime import config as config_mod
from runtime.cli_help import config_toml, field_notes

ROOT = Path(__file__).resolve().parent.parent


def launch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "launch.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_help_names_every_shipped_config_the_override_syntax_and_every_key_of_every_section() -> None:
    done = launch("--help")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    for path in config_mod.CONFIG_DIR.glob("*.toml"):
        assert f"  {path.stem} " in text, path.stem
    assert "--section.key=value" in text and "--print-config" in text and "--check" in text
    assert "--log-level" in text and "DEBUG, INFO" in text
    for section, cls in config_mod._SECTIONS.items():
        assert f"[{section}]" in text, section
        block = text.split(f"  [{section}]", 1)[1].split("\n  [", 1)[0]
        for key in cls.__struct_fields__:
            assert f"\n    {key} = " in block, f"{section}.{key}"


def test_every_config_key_has_a_one_line_note_from_its_struct() -> None:
    for section, cls in config_mod._SECTIONS.items():
        notes = field_notes(cls)
        missing = [key for key in cls.__struct_fields__ if not notes.get(key)]
        assert not missing, f"[{section}] keys without a comment in runtime/config.py: {missing}"


def test_print_config_prints_the_effective_config_with_overrides_and_it_loads_back_the_same(tmp_path: Path) -> None:
    done = launch("--config", "cpu-tiny", "--server.port=6123", "--model.attention=sdpa", "--print-config")
    assert done.returncode == 0, done.stderr
    assert "port = 6123" in done.stdout and 'attention = "sdpa"' in done.stdout
    printed = tmp_path / "printed.toml"
    printed.write_text(done.stdout)
    expected = config_mod.load("cpu-tiny", ["--server.port=6123", "--model.attention=sdpa"])
    assert config_mod.load(printed) == expected


@pytest.mark.parametrize("name", sorted(p.stem for p in config_mod.CONFIG_DIR.glob("*.toml")))
def test_every_shipped_config_prints_as_toml_that_loads_back_unchanged(name: str, tmp_path: Path) -> None:
    config = config_mod.load(name)
    path = tmp_path / f"{name}.toml"
    path.write_text(config_toml(config))
    assert config_mod.load(path) == config


def test_check_passes_a_valid_cpu_config_and_names_each_ranks_roles() -> None:
    done = launch("--config", "cpu-tiny", "--check")
    assert done.returncode == 0, done.stderr
    assert "valid" in done.stdout and "rank 1: decode" in done.stdout and "rank 2: denoise" in done.stdout


def release_folder(root: Path) -> Path:
    """A folder laid out as the v1 release (empty files: ``--check`` looks for files, it loads no weights)."""
    (root / "lingbot_world_fast").mkdir(parents=True)
    (root / "lingbot_world_fast" / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    (root / "lingbot_world_fast" / "config.json").write_text("{}")
    (root / "Wan2.1_VAE.pth").write_bytes(b"")
    (root / "models_t5_umt5-xxl-enc-bf16.pth").write_bytes(b"")
    (root / "google" / "umt5-xxl").mkdir(parents=True)
    (root / "google" / "umt5-xxl" / "tokenizer.json").write_text("{}")
    return root


def test_check_finds_every_file_of_a_release_laid_out_checkpoint_folder(tmp_path: Path) -> None:
    root = release_folder(tmp_path / "lingbot-world-base-cam")
    done = launch("--config", "split7-h100", f"--model.checkpoint_dir={str(root)!r}", "--check")
    assert done.returncode == 0, done.stderr
    assert str(root / "lingbot_world_fast") in done.stdout and "Wan2.1_VAE.pth" in done.stdout
    assert "tokenizer.json" in done.stdout


def test_check_fails_naming_the_missing_file_of_a_checkpoint_folder(tmp_path: Path) -> None:
    root = release_folder(tmp_path / "download")
    (root / "Wan2.1_VAE.pth").unlink()
    done = launch("--config", "split7-h100", f"--model.checkpoint_dir={str(root)!r}", "--check")
    assert done.returncode == 2
    assert "VAE weights not found" in done.stderr and "Wan2.1_VAE.pth" in done.stderr


def test_check_refuses_a_bad_enum_value_listing_the_valid_ones() -> None:
    done = launch("--config", "cpu-tiny", "--model.attention=fast", "--check")
    assert done.returncode == 2
    assert "model.attention" in done.stderr and '"flash"' in done.stderr and '"cudnn"' in done.stderr


@pytest.mark.parametrize(("override", "valid"), [
    ("--layout.backend=foo", '"auto", "gloo", "nccl"'),
    ("--capacity.min_steps=3", "1, 2, 4"),
    ('--model.kv_window="half"', 'a whole number, "preset", "full"'),
])
def test_an_invalid_enum_value_names_the_valid_values(override: str, valid: str) -> None:
    with pytest.raises(config_mod.ConfigError, match="valid values of") as raised:
        config_mod.load("cpu-tiny", [override])
    assert valid in str(raised.value)


def test_the_help_lines_show_the_structs_defaults() -> None:
    text = launch("--help").stdout
    defaults = msgspec.to_builtins(config_mod.Config())
    assert f"    port = {defaults['server']['port']}" in text
    assert f"    dir = \"{defaults['snapshots']['dir']}\"" in text


def options_without_help(help_text: str) -> list[str]:
    """The options of an argparse ``--help`` that have no help text (an entry line with nothing after the option
    and no indented description below it)."""
    lines = help_text.split("options:", 1)[1].split("\n\n", 1)[0].splitlines()
    bare = []
    for number, line in enumerate(lines):
        if not line.startswith("  -"):
            continue
        described = "  " in line.strip()
        below = lines[number + 1] if number + 1 < len(lines) else ""
        if not described and not (below.startswith(" " * 8) and not below.strip().startswith("-")):
            bare.append(line.strip())
    return bare


@pytest.mark.parametrize("command", [["scripts/client.py"], ["-m", "ranks.router"], ["launch.py"]])
def test_every_option_of_the_client_the_router_and_launch_has_help_text(command: list[str]) -> None:
    done = subprocess.run([sys.executable, *command, "--help"], capture_output=True, text=True, cwd=ROOT,
                          timeout=60, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert options_without_help(done.stdout) == []


def test_a_server_start_on_a_checkpoint_folder_it_cannot_load_exits_2_before_any_rank_starts(tmp_path: Path) -> None:
    root = release_folder(tmp_path / "download")
    (root / "Wan2.1_VAE.pth").unlink()
    done = launch("--config", "cpu-tiny-model", f"--model.checkpoint_dir={str(root)!r}")
    assert done.returncode == 2  # a Slurm recipe requeues a 1, never a 2: a folder that cannot load is final
    assert "Wan2.1_VAE.pth" in done.stderr and "torch.distributed.run" not in done.stderr


def test_print_config_never_prints_a_token(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cr3t-token\n")
    done = launch("--config", "cpu-tiny", f"--replica.token_file={str(token_file)!r}", "--print-config")
    assert done.returncode == 0, done.stderr
    assert "s3cr3t-token" not in done.stdout and "not printed" in done.stdout
