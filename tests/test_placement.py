"""The stage table (runtime/placement.py): what each layout's ranks run, and that every plan is finished by the very
completions its workers send (``ranks.worker.completion``), mapped back to its join by ``join_of``."""

from __future__ import annotations

import pytest

from ipc import protocol
from ipc.protocol import Stage
from models.synthetic import synthetic_geometry
from ranks.worker import completion
from runtime.config import LayoutConfig
from runtime.placement import (
    CONTEXT_CARRIER,
    STAGES,
    NewPrompt,
    SessionFacts,
    StageAction,
    group_members,
    join_of,
    key_of,
    placement_of,
    plan,
    step_of,
)
from runtime.scheduler_types import InitCache, Release, RunChunk

SPLIT = LayoutConfig()  # condition 0 (the coordinator), decode 1, DiT 2-6
ONE_RANK = LayoutConfig(name="one", world_size=1, coordinator=0, condition=0, decode=0, dit=[0])
LEADER_DECODES = LayoutConfig(name="leader-decodes", world_size=3, coordinator=0, condition=0, decode=1, dit=[1, 2])
FACTS = SessionFacts("s", 7, "a prompt", synthetic_geometry(64, 96, 3))


def test_each_rank_runs_the_stage_workers_and_edge_threads_its_layout_places_there() -> None:
    split = placement_of(SPLIT)
    assert split.threads_on(0) == ("condition", "condition_edge", "frames")
    assert split.threads_on(1) == ("latent_receiver", "decode", "heartbeat")
    assert all(split.threads_on(r) == ("condition_edge", "denoise", "heartbeat") for r in range(2, 7))
    assert placement_of(ONE_RANK).threads_on(0) == ("condition", "condition_edge", "denoise", "decode")
    leader = placement_of(LEADER_DECODES)  # the latent stays on the leader's rank: no receiver thread
    assert leader.threads_on(1) == ("condition_edge", "denoise", "decode", "heartbeat")
    assert set(split.all) == {f"{r}:{role}".encode() for r in range(7) for role in split.threads_on(r)}


def test_tensor_plane_groups_are_each_stage_group_then_each_out_edge() -> None:
    assert group_members(SPLIT) == [("dit", [2, 3, 4, 5, 6], True), ("condition", [0, 2, 3, 4, 5, 6], False),
                                    ("latent", [1, 2], False), ("frames", [0, 1], False)]
    assert [(name, ranks) for name, ranks, _ in group_members(ONE_RANK)] == [
        ("dit", [0]), ("condition", [0]), ("latent", [0]), ("frames", [0])]


def _actions() -> list[StageAction]:
    chunks = [RunChunk("s", stage, index) for stage in Stage for index in (0, 3)]
    return [*(InitCache("s", stage) for stage in Stage), *chunks, *(Release("s", stage) for stage in Stage),
            NewPrompt("s", 2, "another prompt")]


@pytest.mark.parametrize("layout", [SPLIT, ONE_RANK, LEADER_DECODES], ids=lambda lay: lay.name)
def test_every_plan_is_finished_exactly_by_the_completions_its_workers_send(layout: LayoutConfig) -> None:
    where = placement_of(layout)
    silent = {spec.out.role for spec in STAGES.values() if not spec.out.answers}  # their sender answers instead
    for action in _actions():
        control = protocol.ChunkControl() if isinstance(action, RunChunk) else None
        tasks = plan(action, FACTS, where, control, 2)
        parts = set()
        for to, task in (*tasks.sends, *tasks.then):
            rank, role = to.decode().split(":")
            if role in silent:
                continue
            done = completion(task, Stage(role) if role in {s.value for s in Stage} else None, int(rank), role, [])
            key, part = join_of(done)
            if key == key_of(action):
                parts.add(part)
        # every completion the join waits for is sent by one of its workers; the others only carry spans
        assert tasks.waits <= parts, (action, tasks.waits, parts)
        assert all(part in tasks.waits for part in parts if part[0] is not protocol.Phase.CHUNK), action


def test_each_chunk_task_counts_its_queue_time_under_its_stage_and_each_transfer_under_its_edge() -> None:
    where = placement_of(SPLIT)
    for stage in Stage:
        tasks = plan(RunChunk("s", stage, 1), FACTS, where, protocol.ChunkControl(), 2)
        steps = {step_of(task) for _, task in (*tasks.sends, *tasks.then)}
        assert steps == {stage, STAGES[stage].out.edge}
    context = plan(InitCache("s", Stage.DENOISE), FACTS, where)
    assert {step_of(task) for _, task in context.sends} == {None}  # session-wide: off the chunk timeline


def test_each_edges_tensors_wait_in_a_mailbox_of_their_own_and_the_context_in_its_carriers() -> None:
    """A rank's mailboxes are keyed by edge (``RankContext.inbox``/``outbox``): every edge has one, and the prompt
    context arrives in the mailbox of the edge it travels over (its negative index never meets a chunk's)."""
    from ranks.worker import edge_mailboxes

    inbox = edge_mailboxes()
    assert set(inbox) == set(protocol.Edge) and CONTEXT_CARRIER is protocol.Edge.CONDITION
    assert inbox[protocol.Edge.CONTEXT] is inbox[CONTEXT_CARRIER]
    assert len({id(box) for box in inbox.values()}) == len(protocol.Edge) - 1
