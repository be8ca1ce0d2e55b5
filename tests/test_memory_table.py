"""``scripts/memory_table.py``: its counts are what memory-aware admission would admit on such a card."""

from __future__ import annotations

import json
from pathlib import Path

from models import memory
from runtime.memory_admission import MemoryAdmission
from scripts import memory_table


def admitted(rooms: dict[int, int], config: object, height: int, width: int) -> int:
    """Open sessions through rank 0's admission rule until it refuses one."""
    admission = MemoryAdmission(lambda h, w: memory.session_costs(config, h, w, "cuda"), rooms)
    n = 0
    while admission.refusal(height, width) is None:
        admission.admit(f"s{n}", height, width)
        n += 1
    return n


def test_single_gpu_v1_on_a_141_gb_card_admits_exactly_the_sessions_the_table_says(tmp_path: Path,
                                                                                    capsys: object) -> None:
    out = tmp_path / "table.json"
    assert memory_table.main(["--layouts", "single-gpu", "--presets", "v1", "--cards", "141GB", "--json",
                              str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    config = memory_table.layout_config("single-gpu", "v1", 480, 832)
    (rank,) = memory.ranks_memory(config, 480, 832, "cuda")
    (described,) = row["ranks"]
    assert described["session_bytes"] == rank.session_bytes == sum(memory.session_costs(config, 480, 832,
                                                                                         "cuda").values())
    assert described["fixed_bytes"] == rank.fixed_bytes
    assert row["sessions"] == admitted({0: described["room_bytes"]}, config, 480, 832) >= 1
    assert f"| single-gpu | v1 | 141GB | **{row['sessions']}** |" in capsys.readouterr().out  # type: ignore[attr-defined]


def test_the_limiting_rank_is_the_one_admission_refuses_first() -> None:
    (row,) = memory_table.rows(["aggregated8-h100"], ["v1"], ["80GB"], 480, 832)
    config = memory_table.layout_config("aggregated8-h100", "v1", 480, 832)
    rooms = {r["rank"]: r["room_bytes"] for r in row.ranks}
    assert row.sessions == admitted(rooms, config, 480, 832)
    admission = MemoryAdmission(lambda h, w: memory.session_costs(config, h, w, "cuda"), rooms)
    for n in range(row.sessions):
        admission.admit(f"s{n}", 480, 832)
    assert f"rank {row.limiting_rank} " in (admission.refusal(480, 832) or "")
