"""``launch.py``'s command line: its options, a ``--help`` that lists what can be set, ``--print-config`` and
``--check``.

The help is built from the config structs themselves (``runtime.config``): every section with its docstring's first
line, every key with its default and the comment beside it in the struct's source, so a key added there shows up
here (and ``tests/test_docs.py`` holds ``docs/configuration.md`` to the same list). Nothing here imports torch,
except ``--check`` of a checkpoint folder, which asks ``models.checkpoints`` where each file is (it loads no
weights).
"""

from __future__ import annotations

import argparse
import inspect
import io
import json
import os
import tokenize
from functools import cache
from pathlib import Path
from typing import Any

import msgspec

from runtime import config as config_mod
from runtime import logs

OVERRIDES = """\
overrides:
  Any key can be set on the command line after the config, as --section.key=value. The value is read as TOML
  (--server.port=6000, --model.attention=flash, --layout.dit=[1,2], --stream.sizes=[[480,832]],
  --model.checkpoint_dir="/data/lingbot"); a bare word is taken as a string. Unknown sections or keys are
  refused with the valid ones listed.
"""


@cache
def field_notes(section: type[msgspec.Struct]) -> dict[str, str]:
    """Each field's comment in the struct's source: the one on its line, else the comment lines just above it."""
    lines, _ = inspect.getsourcelines(section)
    comments: dict[int, str] = {}
    code_lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
        elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.add(token.start[0])
    notes: dict[str, str] = {}
    for number, line in enumerate(lines, start=1):
        name = line.strip().split(":", 1)[0]
        if name not in section.__struct_fields__ or not line.startswith("    ") or line.startswith("     "):
            continue
        if number in comments:
            notes[name] = comments[number]
            continue
        above = []
        row = number - 1
        while row in comments and row not in code_lines:
            above.insert(0, comments[row])
            row -= 1
        notes[name] = " ".join(above)
    return notes


def one_line(text: str, width: int = 96) -> str:
    """``text``'s first sentence (or clause) that fits ``width`` characters, for a help line."""
    text = " ".join(text.replace("``", "").split())
    for cut in (". ", "; ", ": ", ", "):
        if len(text) <= width:
            break
        text = text.split(cut)[0]
    return text if len(text) <= width else text[:width - 3].rstrip() + "..."


def first_line(doc: str | None) -> str:
    return one_line((doc or "").strip().split("\n\n")[0])


def default_text(value: Any) -> str:
    return json.dumps(msgspec.to_builtins(value))


def sections_text(root: type[msgspec.Struct] = config_mod.Config) -> str:
    """Every section of ``root`` with its keys: ``key = default  note``."""
    out = ["sections and keys (default, then what it is; docs/configuration.md has the full reference):"]
    instance = root()
    for name in root.__struct_fields__:
        section = getattr(instance, name)
        cls = type(section)
        out.append(f"  [{name}]  {first_line(cls.__doc__)}".rstrip())
        notes = field_notes(cls)
        for key in cls.__struct_fields__:
            note = notes.get(key, "")
            out.append(f"    {key} = {default_text(getattr(section, key))}" + (f"  # {one_line(note)}" if note else ""))
    return "\n".join(out)


def shipped_configs(directory: Path = config_mod.CONFIG_DIR) -> str:
    """The configs in ``configs/`` by name, each with its world size and the first line of its header comment."""
    out = [f"shipped configs (--config NAME, from {directory.name}/; or a path to your own TOML file):"]
    for path in sorted(directory.glob("*.toml")):
        try:
            cfg = config_mod.load(path)
        except config_mod.ConfigError as error:
            out.append(f"  {path.stem:<17} invalid: {one_line(str(error), 80)}")
            continue
        lay, model = cfg.layout, cfg.model
        ranks = f"{lay.world_size} rank{'s' if lay.world_size != 1 else ''}"
        where = "CPU" if lay.backend == "gloo" else "GPU"
        what = f"{model.kind} {model.preset}" if model.kind == "lingbot-fast" else model.kind
        out.append(f"  {path.stem:<17} {ranks:>8}  {where}  {what:<17} DiT on {lay.dit}, condition on {lay.condition},"
                   f" decode on {lay.decode}")
    return "\n".join(out)


def epilog() -> str:
    return "\n\n".join([shipped_configs(), OVERRIDES.rstrip(), sections_text(),
                        "exit status: 0 after a clean shutdown or a passing --check; 2 for a bad config or checkpoint"
                        "\nfolder; another non-zero status when a rank died, hung or did not start "
                        "(docs/operations.md)."])


DESCRIPTION = """\
Start a worldstream server: the ranks of a config's layout, with the ZeroMQ client port on rank 0.
Without torchrun or srun around it, it starts a local torchrun with the layout's world size itself; Ctrl-C or
SIGTERM stops every rank cleanly."""


class _Parser(argparse.ArgumentParser):
    """Builds the long epilog (every config loaded, the structs' source read) only when help is shown, not at each
    rank's start."""

    def format_help(self) -> str:
        self.epilog = epilog()
        return super().format_help()


def build_parser(description: str = DESCRIPTION) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="launch.py", description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="python launch.py --config NAME_OR_FILE [--section.key=value ...] [--print-config | --check]\n"
              "       torchrun --nproc-per-node N launch.py --config NAME_OR_FILE [--section.key=value ...]")
    parser.add_argument("--config", required=True,
                        help="a config name from configs/ (cpu-tiny, split7-h100, ...) or a path to a TOML file")
    parser.add_argument("--log-level", default=os.environ.get("WORLDSTREAM_LOG", "INFO"),
                        help="DEBUG, INFO, WARNING or ERROR (default: $WORLDSTREAM_LOG, else INFO)")
    parser.add_argument("--log-format", choices=logs.FORMATS, default=logs.default_format(),
                        help="text lines, or one JSON object a line (default: $WORLDSTREAM_LOG_FORMAT, else text)")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--print-config", action="store_true",
                      help="print the effective configuration (the file with its overrides applied, every key) as "
                           "TOML and exit; starts nothing")
    what.add_argument("--check", action="store_true",
                      help="validate the config and, with model.checkpoint_dir set, the checkpoint folder (every "
                           "file where the model will look for it; no weights are loaded); exit 0 if both are "
                           "usable, 2 naming the problem if not; starts nothing")
    return parser


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


SECRETS = {"replica.token", "router.register_token"}  # never printed: a printed config lands in logs and issues
SECRET = "<secret: not printed>"


def config_toml(config: config_mod.Config) -> str:
    """The whole configuration as TOML, every key of every section (a secret masked): loading it gives the same
    ``Config`` but for the secrets."""
    out = []
    for name, section in msgspec.to_builtins(config).items():
        out.append(f"[{name}]")
        out.extend(f"{key} = {toml_value(SECRET if f'{name}.{key}' in SECRETS and value else value)}"
                   for key, value in section.items())
        out.append("")
    return "\n".join(out)


def check(config: config_mod.Config, where: str) -> list[str]:
    """What ``--check`` reports once the config loaded: the layout rank by rank, then the checkpoint folder. Raises
    ``ConfigError`` for a checkpoint folder the model could not load from."""
    lay = config.layout
    lines = [f"{where}: valid ({lay.name}: {lay.world_size} ranks, backend {lay.backend}, model {config.model.kind}"
             f" preset {config.model.preset})"]
    lines += [f"  rank {rank}: {', '.join(lay.roles_of(rank))}" for rank in range(lay.world_size)]
    lines.append(f"  clients connect to tcp://{config.server.host}:{config.server.port}")
    model = config.model
    if model.kind != "lingbot-fast":
        lines.append(f"  model.kind = {model.kind!r}: no checkpoint is read")
        return lines
    if not model.checkpoint_dir:
        lines.append("  model.checkpoint_dir is empty: seeded random weights (noise frames, real timings)")
        return lines
    from models.checkpoints import CheckpointError, resolve_checkpoint_dir
    from models.lingbot_config import checkpoint_names

    try:
        paths = resolve_checkpoint_dir(model.checkpoint_dir, checkpoint_names(model))
    except CheckpointError as error:
        raise config_mod.ConfigError(f"{where}: model.checkpoint_dir: {error}") from None
    tokenizer = [name for name in ("tokenizer.json", "spiece.model") if (paths.tokenizer_dir / name).is_file()]
    if not tokenizer:
        raise config_mod.ConfigError(f"{where}: the tokenizer folder {paths.tokenizer_dir} holds neither "
                                     "tokenizer.json nor spiece.model (model.tokenizer_dir)")
    shards = sorted(p.name for p in paths.dit_dir.glob("*.safetensors"))
    config_json = paths.dit_dir / "config.json"
    lines += [f"  checkpoint {paths.root}:",
              f"    DiT        {paths.dit_dir} ({len(shards)} safetensors file{'s' if len(shards) != 1 else ''}"
              f"{', config.json' if config_json.is_file() else ', no config.json: the preset decides'})",
              f"    VAE        {paths.vae_file}",
              f"    umT5       {paths.t5_file}",
              f"    tokenizer  {paths.tokenizer_dir / tokenizer[0]}",
              "  (files found where the model looks for them; their tensors are checked when the ranks load them)"]
    return lines


def run_offline(args: argparse.Namespace, overrides: list[str]) -> int:
    """``--print-config`` or ``--check``: load the config, say what was asked, start nothing. Exit 0, or 2 with the
    problem on stderr."""
    import sys

    try:
        config = config_mod.load(args.config, overrides)
        where = str(config_mod.resolve_path(args.config))
        text = config_toml(config) if args.print_config else "\n".join(check(config, where)) + "\n"
    except config_mod.ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0
