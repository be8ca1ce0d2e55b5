"""What is stage-shaped reads the stage table (issue 29, point 4): a rank's backend and its process groups are keyed
by ``Stage``/``Edge``, the warm-up summary is a map by stage, the init order, the trace's tracks and the memory
items a rank checks come from ``Stage`` and ``STAGES``. Pure: no ranks, no model."""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from ipc.metrics_types import WarmUpStage, WarmUpStages
from ipc.protocol import Edge, Stage
from ipc.tensor_plane import Groups
from models.synthetic import synthetic_geometry
from ranks.backend import Backend
from ranks.memory import cache_bytes
from ranks.warmup import stages_of
from runtime.config import LayoutConfig
from runtime.placement import STAGES, group_members
from runtime.scheduler_types import INIT_ORDER
from runtime.trace import ROLE_TIDS

GEOMETRY = synthetic_geometry(64, 96, 3)


class Counted:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def sessions_nbytes(self) -> int:
        return self.nbytes


def test_a_backend_is_keyed_by_stage_and_warms_the_dit_first_then_in_pipeline_order() -> None:
    backend = Backend(GEOMETRY, {Stage.DECODE: Counted(3), Stage.CONDITION: Counted(5), Stage.DENOISE: Counted(7)})
    assert stages_of(backend) == [Stage.DENOISE, Stage.CONDITION, Stage.DECODE]
    assert cache_bytes(backend) == 15  # every stage of the rank, from the mapping
    decode_only = Backend(GEOMETRY, {Stage.DECODE: Counted(3)})
    assert stages_of(decode_only) == [Stage.DECODE] and decode_only.denoise is None
    assert decode_only.decode is decode_only[Stage.DECODE]


def test_a_ranks_groups_are_found_by_the_stage_tables_names() -> None:
    made: dict[str, Any] = {name: f"group {name}" for name, _, _ in group_members(LayoutConfig())}
    groups = Groups(0, torch.device("cpu"), "control", made)
    assert groups.named(STAGES[Stage.DENOISE].group) == "group dit"
    assert groups.named(STAGES[Stage.DECODE].group) is None
    assert {edge: groups.of_edge(edge) for edge in (Edge.CONDITION, Edge.LATENT, Edge.FRAMES)} == {
        Edge.CONDITION: "group condition", Edge.LATENT: "group latent", Edge.FRAMES: "group frames"}
    assert Groups(0, torch.device("cpu"), None).of_edge(Edge.LATENT) is None  # not a member, or a local hand-off


class _StructPerStage(msgspec.Struct):  # the warm-up summary as it was: one field per stage
    condition: WarmUpStage
    denoise: WarmUpStage
    decode: WarmUpStage


def test_the_warm_up_summary_is_a_map_by_stage_with_the_bytes_of_the_struct_it_replaces() -> None:
    runs = {stage.value: WarmUpStage(seconds=i + 0.5, chunks_per_size=2, ranks={str(i): ["64x96"]})
            for i, stage in enumerate(Stage)}
    old = msgspec.json.encode(_StructPerStage(**runs))
    assert msgspec.json.encode(runs) == old
    assert msgspec.json.decode(old, type=WarmUpStages) == runs


def test_inits_run_in_pipeline_order_with_the_stage_that_takes_the_prompt_context_last() -> None:
    assert sorted(INIT_ORDER) == sorted(Stage) and len(INIT_ORDER) == len(Stage)
    takes_context = [stage for stage, spec in STAGES.items() if spec.context]
    assert list(INIT_ORDER[-len(takes_context):]) == takes_context
    assert [s for s in INIT_ORDER if s not in takes_context] == [s for s in Stage if s not in takes_context]


def test_every_stage_has_a_trace_track_of_its_own_and_memory_items_a_rank_checks() -> None:
    tracks = [ROLE_TIDS[spec.role] for spec in STAGES.values()]
    assert len(set(tracks)) == len(STAGES) and len(set(ROLE_TIDS.values())) == len(ROLE_TIDS)
    assert all(spec.memory_items for spec in STAGES.values())
