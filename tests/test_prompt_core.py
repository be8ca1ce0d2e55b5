"""A new prompt mid-stream (``set_prompt``) in the coordinator core, without processes: which chunk first uses the
new text, supersession, bad requests. The harness is ``tests.core_job``'s 7-rank job."""

from __future__ import annotations

import pytest

from ipc import protocol as p
from runtime.core_types import ToWorker
from runtime.prompts import MAX_PENDING
from runtime.router_types import ClientSent, ReplicaRefused, SessionOrigin, ToReplica
from tests.core_job import A, B, Job, control, errors
from tests.router_fleet import Fleet


def set_prompt(job: Job, sid: str, prompt: str, who: bytes = A) -> int:
    req = next(job.req)
    job.send(who, p.SetPrompt(req=req, session=sid, prompt=prompt))
    return req


def scheduled(job: Job, req: int) -> p.PromptScheduled | None:
    replies = [m for m in job.to(A, p.PromptScheduled) if m.req == req]
    assert len(replies) <= 1
    return replies[0] if replies else None


def denoised_revisions(job: Job, sid: str) -> dict[int, set[int]]:
    """chunk -> the prompt revisions its DenoiseChunk tasks named (one per DiT rank: a set of one)."""
    out: dict[int, set[int]] = {}
    for _, task in job.sent(p.DenoiseChunk):
        if task.session == sid:
            out.setdefault(task.index, set()).add(task.prompt_revision)
    return out


def emitted_revisions(job: Job, sid: str) -> list[int]:
    return [e.facts.prompt_revision for e in job.emitted(sid)]


def run_chunk(job: Job, sid: str, index: int) -> None:
    """Condition, control, denoise, decode of chunk ``index`` (its condition may already be encoded)."""
    job.answer(p.ConditionChunk, sid, index)
    control(job, sid, index)
    job.chunk(sid, index)


def test_a_new_prompt_applies_from_the_first_chunk_not_dispatched_when_its_context_was_announced() -> None:
    job = Job()
    sid = job.open(num_chunks=5)
    job.answer(p.ConditionChunk, sid, 0)
    control(job, sid, 0)  # denoise 0 dispatched with the open's prompt
    req = set_prompt(job, sid, "a desert at dusk")
    ((who, encode),) = job.sent(p.EncodePrompt)
    assert who == b"0:condition" and (encode.index, encode.prompt) == (p.context_index(1), "a desert at dusk")
    assert scheduled(job, req) is None and not [t for _, t in job.sent(p.BroadcastContext) if t.index != -1]
    job.chunk(sid, 0)
    run_chunk(job, sid, 1)  # chunk 1 is dispatched while the new text is still being encoded: it keeps the old
    control(job, sid, 2)
    job.answer(p.ConditionChunk, sid, 2)
    assert denoised_revisions(job, sid) == {0: {0}, 1: {0}, 2: {0}}  # chunk 2 too: dispatched before the context

    out = job.answer(p.EncodePrompt, sid)
    moved = [(w, t) for w, t in job.sent(p.BroadcastContext, out)]
    assert [w for w, _ in moved] == [f"{r}:condition_edge".encode() for r in (0, 2, 3, 4, 5, 6)]
    assert {t.index for _, t in moved} == {p.context_index(1)}
    reply = scheduled(job, req)
    assert reply is not None and (reply.session, reply.revision, reply.chunk) == (sid, 1, 3)

    job.chunk(sid, 2)
    run_chunk(job, sid, 3)
    run_chunk(job, sid, 4)
    assert denoised_revisions(job, sid) == {0: {0}, 1: {0}, 2: {0}, 3: {1}, 4: {1}}
    assert emitted_revisions(job, sid) == [0, 0, 0, 1, 1]
    # the context's broadcast was announced to every edge before the first denoise that names it
    order = [o.message for o in job.log if isinstance(o, ToWorker)]
    first_use = next(i for i, m in enumerate(order) if isinstance(m, p.DenoiseChunk) and m.prompt_revision == 1)
    last_move = max(i for i, m in enumerate(order) if isinstance(m, p.BroadcastContext) and m.index == -2)
    assert last_move < first_use


def test_a_second_prompt_before_the_first_took_effect_supersedes_it_at_the_same_chunk() -> None:
    job = Job()
    sid = job.open(num_chunks=4)
    run_chunk(job, sid, 0)
    first, second = set_prompt(job, sid, "rain"), set_prompt(job, sid, "snow")
    job.answer(p.EncodePrompt, sid, p.context_index(1))
    job.answer(p.EncodePrompt, sid, p.context_index(2))
    one, two = scheduled(job, first), scheduled(job, second)
    assert one is not None and two is not None
    assert (one.revision, one.chunk) == (1, 1) and (two.revision, two.chunk) == (2, 1)  # revisions increase
    run_chunk(job, sid, 1)
    third = set_prompt(job, sid, "fog")
    job.answer(p.EncodePrompt, sid)
    three = scheduled(job, third)
    assert three is not None and (three.revision, three.chunk) == (3, 2)
    run_chunk(job, sid, 2)
    run_chunk(job, sid, 3)
    assert emitted_revisions(job, sid) == [0, 2, 3, 3]  # revision 1 was never used; no chunk mixes two texts
    assert all(len(revisions) == 1 for revisions in denoised_revisions(job, sid).values())


def test_bad_prompt_changes_are_refused_with_a_clear_error_and_change_nothing() -> None:
    job = Job(server={"max_prompt_chars": 8})
    sid = job.open(num_chunks=3)
    other = job.open(B, num_chunks=3)
    cases: list[tuple[bytes, str, str, str]] = [
        (A, "nope", "rain", "unknown_session"),  # no such session
        (B, sid, "rain", "unknown_session"),  # another client's session
        (A, sid, "a prompt far too long", "bad_request"),  # beyond server.max_prompt_chars
    ]
    for who, session, prompt, code in cases:
        req = next(job.req)
        out = job.send(who, p.SetPrompt(req=req, session=session, prompt=prompt))
        (error,) = job.to(who, p.Error, out)
        assert (error.code, error.req) == (code, req)
        assert not job.sent(p.EncodePrompt, out)
    assert "8" in job.to(A, p.Error)[-1].message  # the limit is named
    job.send(B, p.Close(req=next(job.req), session=other))
    out = job.send(B, p.SetPrompt(req=next(job.req), session=other, prompt="rain"))
    assert errors(job, B, out) == ["closing"] and not job.sent(p.EncodePrompt, out)
    job.settle(p.ConditionChunk, p.Release)
    assert errors(job, B, job.send(B, p.SetPrompt(req=next(job.req), session=other, prompt="rain"))) == [
        "unknown_session"]
    assert job.core.sessions[sid].prompts.latest == 0  # nothing was accepted
    run_chunk(job, sid, 0)
    assert emitted_revisions(job, sid) == [0]


def test_a_prompt_that_fails_to_encode_is_answered_and_the_session_keeps_its_text() -> None:
    job = Job()
    sid = job.open(num_chunks=3)
    req = set_prompt(job, sid, "rain")
    out = job.answer(p.EncodePrompt, sid, fail="tokenizer exploded")
    (error,) = job.to(A, p.Error, out)
    assert (error.code, error.req, error.session) == ("prompt_failed", req, sid) and "tokenizer" in error.message
    assert not [t for _, t in job.sent(p.BroadcastContext, out)]  # nothing moves to the DiT ranks
    for index in range(3):
        run_chunk(job, sid, index)
    assert emitted_revisions(job, sid) == [0, 0, 0]
    assert not [e for e in job.to(A, p.Error) if e.req != req]  # the session did not fail


def test_prompt_changes_waiting_for_their_first_chunk_are_bounded() -> None:
    job = Job()
    sid = job.open(num_chunks=4)
    for i in range(MAX_PENDING):
        set_prompt(job, sid, f"prompt {i}")
    req = next(job.req)
    out = job.send(A, p.SetPrompt(req=req, session=sid, prompt="one too many"))
    (error,) = job.to(A, p.Error, out)
    assert (error.code, error.req) == ("prompt_backpressure", req) and error.retry_after_s
    job.settle(p.EncodePrompt)  # encoded and announced: they still wait for a chunk
    assert errors(job, A, job.send(A, p.SetPrompt(req=next(job.req), session=sid, prompt="x"))) == [
        "prompt_backpressure"]
    run_chunk(job, sid, 0)  # chunk 0 takes the newest; the others are dropped
    accepted = set_prompt(job, sid, "now there is room")
    job.answer(p.EncodePrompt, sid)
    reply = scheduled(job, accepted)
    assert reply is not None and (reply.revision, reply.chunk) == (MAX_PENDING + 1, 1)
    assert emitted_revisions(job, sid) == [MAX_PENDING]


def test_a_session_that_closes_while_its_new_prompt_encodes_answers_the_request() -> None:
    job = Job()
    sid = job.open(num_chunks=None)
    req = set_prompt(job, sid, "rain")
    job.send(A, p.Close(req=next(job.req), session=sid))
    job.settle(p.ConditionChunk, p.Release)  # the encode of the new prompt has not answered yet
    assert [c.reason for c in job.to(A, p.Closed)] == ["client"]
    assert [(e.code, e.session) for e in job.to(A, p.Error) if e.req == req] == [("closing", sid)]
    out = job.answer(p.EncodePrompt, sid)  # a late answer for a session gone: nothing moves
    assert not job.sent(p.BroadcastContext, out) and not job.to(A, p.PromptScheduled)


# ---- through the router core: forwarded to the session's replica as it came, the answer relayed to its client


def test_the_router_forwards_set_prompt_to_the_sessions_replica_and_relays_its_answer() -> None:
    fleet = Fleet()
    fleet.up("a", "b")
    sid, name = fleet.open(A)
    message = p.SetPrompt(req=7, session=sid, prompt="snow")
    raw = p.encode(message)
    out = fleet.step(ClientSent(A, message, raw))
    assert len(out) == 1 and isinstance(out[0], ToReplica) and out[0].replica == name
    assert out[0].message == message and out[0].raw is raw  # typed for the shell, its bytes passed on as they came
    fleet.replica(name, p.PromptScheduled(req=7, session=sid, revision=1, chunk=3))
    (reply,) = fleet.to(A, p.PromptScheduled)
    assert (reply.req, reply.revision, reply.chunk) == (7, 1, 3)
    fleet.client(B, p.SetPrompt(req=8, session=sid, prompt="rain"))  # not B's session: never reaches the replica
    assert [(e.req, e.code) for e in fleet.errors(B)] == [(8, "unknown_session")]


def test_a_set_prompt_that_meets_a_full_replica_link_is_prompt_backpressure() -> None:
    fleet = Fleet()
    fleet.up("a", "b")
    sid, name = fleet.open(A)
    fleet.step(ReplicaRefused(name, fleet.generation[name], SessionOrigin(A, 9, sid, "set_prompt")))
    (error,) = [e for e in fleet.errors(A) if e.req == 9]
    assert error.code == "prompt_backpressure" and error.retry_after_s


# ---- the client tool's recordings: a prompt change replays at the chunk that first used it


def test_a_recordings_prompt_changes_become_trace_changes_at_the_chunk_that_first_used_each() -> None:
    from scripts.client import applied_trace

    still = {"keys": [], "mouse": [0.0, 0.0], "revision": -1}
    recorded = {"prompt": "p", "seed": 1, "events": [
        {"t": 0.1, "chunk": 1, "prompt_revision": 1, "prompt": "rain"},  # superseded at chunk 1: never used
        {"t": 0.2, "chunk": 1, "prompt_revision": 2, "prompt": "snow"},
        {"t": 0.3, "revision": 1, "keys": "w", "taps": "", "mouse": [0, 0]}],
        "applied": [{"index": i, "control": still, "prompt_revision": r} for i, r in enumerate([0, 2, 2, 2])]}
    assert applied_trace(recorded)["prompts"] == [{"chunk": 1, "prompt": "snow"}]
    assert "prompts" not in applied_trace({**recorded, "applied": recorded["applied"][:1]})  # none: as before
    recorded["events"] = recorded["events"][:1]
    with pytest.raises(ValueError, match="prompt revision 2"):
        applied_trace(recorded)
