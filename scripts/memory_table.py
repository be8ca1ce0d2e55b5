"""Sessions per GPU layout from the memory model (``models.memory``), on the meta device: no GPU, no weights.

    python scripts/memory_table.py [--json memory_table.json] [--layouts single-gpu ...] [--presets v1 v2]
                                   [-- --model.vae_dtype=bfloat16 ...]

For each layout, preset and card it prints how many sessions of ``--height x --width`` frames fit and which rank
limits them, and per rank its fixed bytes (weights and a chunk's working peaks), the bytes of one session and the
sessions it could hold. A rank's room on a card is what admission computes on the device (``ranks.memory``): the
card's memory less ``--overhead-gib`` (CUDA context, NCCL buffers: what ``mem_get_info`` does not show as free
after start-up), the rank's fixed bytes and the layout's ``memory.margin_gb``. ``server.max_sessions`` stays a
cap on top; the table shows both.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the project root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models import memory
from runtime import config as config_mod
from runtime.memory_admission import GIB

LAYOUTS = ("split7-h100", "fast4-h100", "aggregated8-h100", "single-gpu")
PRESET_CHUNK = {"v1": 3, "v2": 4}
# Memory a card reports (torch.cuda.mem_get_info's total): an 80 GB H100 shows 81559 MiB; the lent 141 GB H200
# showed 139.8 GiB.
CARDS = {"80GB": 81559 * (1 << 20), "141GB": int(139.8 * GIB)}
OVERHEAD_GIB = 1.0


@dataclass(frozen=True)
class Row:
    layout: str
    preset: str
    card: str
    sessions: int  # what the memory model admits
    cap: int  # server.max_sessions
    limiting_rank: int
    ranks: list[dict[str, Any]]


def layout_config(layout: str, preset: str, height: int, width: int, extra: tuple[str, ...] = ()) -> config_mod.Config:
    return config_mod.load(layout, [f"--model.preset={preset}", f"--stream.chunk_latent_frames={PRESET_CHUNK[preset]}",
                                    f"--stream.height={height}", f"--stream.width={width}", "--model.checkpoint_dir=''",
                                    *extra])


def room(config: config_mod.Config, card_bytes: int, fixed: int, overhead_gib: float) -> int:
    """The room ``ranks.memory.room_bytes`` would measure on a fresh card of ``card_bytes`` once loaded."""
    unused = card_bytes - int(overhead_gib * GIB) - fixed
    budget = int(config.memory.budget_gb * GIB)
    left = max(0, unused - int(config.memory.margin_gb * GIB))
    return min(left, budget) if budget > 0 else left


def rows(layouts: list[str], presets: list[str], cards: list[str], height: int, width: int,
         overhead_gib: float = OVERHEAD_GIB, extra: tuple[str, ...] = ()) -> list[Row]:  # fmt: skip
    out = []
    for layout in layouts:
        for preset in presets:
            config = layout_config(layout, preset, height, width, extra)
            ranks = memory.ranks_memory(config, height, width, "cuda")
            working = {r.rank: memory.working_bytes(config, r.rank, height, width, "cuda") for r in ranks}
            for card in cards:
                fits = {}
                described = []
                for r in ranks:
                    space = room(config, CARDS[card], r.fixed_bytes, overhead_gib)
                    n = None if r.session_bytes == 0 else space // r.session_bytes
                    if n is not None:
                        fits[r.rank] = n
                    described.append({"rank": r.rank, "roles": list(r.roles), "fixed_bytes": r.fixed_bytes,
                                      "working_bytes": working[r.rank], "session_bytes": r.session_bytes,
                                      "room_bytes": space, "sessions": n, "fixed": r.fixed, "session": r.session})
                limiting = min(fits, key=lambda rank: (fits[rank], rank))
                out.append(Row(layout, preset, card, fits[limiting], config.server.max_sessions, limiting, described))
    return out


def gib(n: int) -> str:
    return f"{n / GIB:.1f}"


def markdown(table: list[Row], height: int, width: int) -> str:
    lines = [f"| layout | preset | card | sessions at {height}x{width} | limiting rank (roles): fixed + per session, "
             "GiB | cap (`max_sessions`) |", "|---|---|---|---|---|---|"]
    for row in table:
        r = next(x for x in row.ranks if x["rank"] == row.limiting_rank)
        lines.append(f"| {row.layout} | {row.preset} | {row.card} | **{row.sessions}** | {r['rank']} "
                     f"({'+'.join(x for x in r['roles'] if x != 'coordinator')}): {gib(r['fixed_bytes'])} + "
                     f"{gib(r['session_bytes'])} | {row.cap} |")
    return "\n".join(lines)


def per_rank(table: list[Row]) -> str:
    lines = ["| layout | preset | rank | roles | weights | working | per session | sessions 80GB / 141GB |",
             "|---|---|---|---|---|---|---|---|"]
    seen = set()
    for row in table:
        if (row.layout, row.preset) in seen:
            continue
        seen.add((row.layout, row.preset))
        counts = {(x.card, r["rank"]): r["sessions"] for x in table if (x.layout, x.preset) == (row.layout, row.preset)
                  for r in x.ranks}
        for r in row.ranks:
            weights = r["fixed_bytes"] - r["working_bytes"]
            cards = " / ".join(str(counts.get((card, r["rank"]), "-")) for card in CARDS)
            lines.append(f"| {row.layout} | {row.preset} | {r['rank']} | {'+'.join(r['roles'])} | {gib(weights)} | "
                         f"{gib(r['working_bytes'])} | {gib(r['session_bytes'])} | {cards} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    parser.add_argument("--presets", nargs="+", default=["v1", "v2"], choices=sorted(PRESET_CHUNK))
    parser.add_argument("--cards", nargs="+", default=list(CARDS), choices=list(CARDS))
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--overhead-gib", type=float, default=OVERHEAD_GIB)
    parser.add_argument("--per-rank", action="store_true", help="also print every rank's fixed and session bytes")
    parser.add_argument("--json", type=Path, help="write the table (every rank's items in bytes) here")
    parser.add_argument("overrides", nargs="*", help="config overrides for every layout, e.g. "
                        "--model.vae_dtype=bfloat16 (after --)")
    args = parser.parse_args(argv)
    table = rows(args.layouts, args.presets, args.cards, args.height, args.width, args.overhead_gib,
                 tuple(args.overrides))
    print(markdown(table, args.height, args.width))
    if args.per_rank:
        print()
        print(per_rank(table))
    if args.json:
        args.json.write_text(json.dumps({"height": args.height, "width": args.width, "cards": CARDS,
                                         "overhead_gib": args.overhead_gib, "rows": [vars(r) for r in table]},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
