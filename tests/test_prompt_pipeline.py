"""A new prompt mid-stream with real ranks: the 7-rank real tiny model switches its text at the announced chunk
(chunks before it bit-identical to a session that never switched, chunks from it equal to a one-process reference
that switched there), and the synthetic backend takes ``set_prompt`` with its facts naming the revision."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ipc.client import Client
from models.controls import ChunkControl
from models.stages import SessionSpec
from scripts import client as tool
from scripts.local_server import ROOT, LocalServer
from tests.shared import FAST, tiny_model_stages

pytestmark = pytest.mark.multiprocess

IMAGE = (ROOT / "assets" / "start.png").read_bytes()
KEYS = ["w", "wl", "d", "a"]
SWITCH = 2  # the chunk the new prompt takes effect at
PROMPTS = ("a red house", "a snowy forest at night")


def play(client: Client, switch: str | None, seed: int = 5) -> tuple[list[np.ndarray], list[int], int | None]:
    """One session of ``KEYS``; with ``switch``, the prompt changes once chunk ``SWITCH - 1`` arrived and before
    control ``SWITCH`` is sent, so the first chunk not dispatched is exactly ``SWITCH``. (frames, each chunk's
    prompt revision, the chunk the reply named)"""
    info = client.open(IMAGE, prompt=PROMPTS[0], seed=seed, num_chunks=len(KEYS))
    frames, revisions, announced = [], [], None
    for index, keys in enumerate(KEYS):
        if index == SWITCH and switch is not None:
            reply = client.set_prompt(info.id, switch)
            assert reply.revision == 1
            announced = reply.chunk
        client.control(info.id, index, keys=keys)
        chunk = client.next_chunk(info.id, timeout_s=120)
        assert chunk.index == index
        frames.append(chunk.frames)
        revisions.append(chunk.prompt_revision)
    assert client.wait_closed(info.id).reason == "complete"
    return frames, revisions, announced


def supersede(client: Client) -> tuple[list[int], list[int]]:
    """Two prompt changes between chunks 0 and 1: (the chunks their answers named, each chunk's revision)."""
    info = client.open(IMAGE, prompt="p", seed=2, num_chunks=3)
    client.control(info.id, 0, keys="w")
    client.next_chunk(info.id, timeout_s=60)
    named = [client.set_prompt(info.id, text).chunk for text in ("rain", "snow")]
    for index in (1, 2):
        client.control(info.id, index, keys="w")
    revisions = [c.prompt_revision for c in client.chunks(info.id, timeout_s=60)]
    return named, [0, *revisions]


def switched_reference(seed: int) -> list[np.ndarray]:
    """The same session in one process, its DiT context replaced by the new prompt's at chunk ``SWITCH``."""
    cfg, condition, denoise, decode, image = tiny_model_stages(IMAGE)
    spec = SessionSpec("ref", seed, PROMPTS[0], image, cfg.stream.height, cfg.stream.width)
    denoise.open(SessionSpec("ref", seed, PROMPTS[0], None, cfg.stream.height, cfg.stream.width),
                 condition.open(spec))
    decode.open(SessionSpec("ref", seed, "", None, cfg.stream.height, cfg.stream.width))
    out = []
    for index, keys in enumerate(KEYS):
        if index == SWITCH:
            denoise.set_context("ref", condition.context(PROMPTS[1]))
        latent = denoise.denoise("ref", index, condition.encode("ref", index), ChunkControl(keys=frozenset(keys)))
        out.append(decode.decode("ref", index, latent).numpy())
    return out


LIVE = {"prompt": PROMPTS[0], "seed": 5, "num_chunks": 6,
        "events": [{"t": 0.0, "keys": "w"}, {"t": 0.05, "prompt": PROMPTS[1]}, {"t": 0.1, "keys": "d"}]}


def test_a_real_model_session_switches_its_prompt_at_the_announced_chunk() -> None:
    torch.set_num_threads(1)
    with LocalServer("cpu-tiny-model") as server, Client(server.endpoint) as client:
        plain, plain_revisions, _ = play(client, None)
        switched, revisions, announced = play(client, PROMPTS[1])
        # a live recording with a prompt change replays frame for frame (the change lands where it did)
        recorded = tool.recording(LIVE, tool.play_live(client, IMAGE, LIVE))
        replayed, matched = tool.replay_exact(client, IMAGE, recorded)
    assert announced == SWITCH
    assert plain_revisions == [0] * len(KEYS) and revisions == [0] * SWITCH + [1] * (len(KEYS) - SWITCH)
    for index in range(SWITCH):  # the chunks before the switch: the very same computation
        assert np.array_equal(switched[index], plain[index]), f"chunk {index} changed before the switch"
    for index in range(SWITCH, len(KEYS)):
        assert not np.array_equal(switched[index], plain[index]), f"chunk {index} did not take the new prompt"
    used = [a["prompt_revision"] for a in recorded["applied"]]
    assert used[0] == 0 and used[-1] == 1 and sorted(used) == used  # the change took effect mid-session
    assert matched and [c.prompt_revision for c in replayed.chunks] == used
    assert replayed.prompts == [{"chunk": used.index(1), "prompt_revision": 1, "prompt": PROMPTS[1]}]
    reference = switched_reference(5)
    for got, want in zip(switched, reference, strict=True):
        # Ulysses over 5 ranks vs one process: float32 sums in another order, at most one uint8 level apart
        assert np.abs(got.astype(int) - want.astype(int)).max() <= 1


def test_the_synthetic_backend_takes_a_new_prompt_and_its_facts_name_the_revision() -> None:
    trace = {"prompt": "p", "seed": 1, "chunks": [{"keys": "w"}] * 5,
             "prompts": [{"chunk": 1, "prompt": "rain"}, {"chunk": 3, "prompt": "snow"}]}
    with LocalServer("cpu-tiny", FAST) as server, Client(server.endpoint) as client:
        plain, plain_revisions, _ = play(client, None)
        switched, revisions, announced = play(client, "a desert")
        traced = tool.play(client, IMAGE, trace)  # a trace's prompt changes land at their chunks
        superseded = supersede(client)
    assert [c.prompt_revision for c in traced.chunks] == [0, 1, 1, 2, 2]
    assert superseded == ([1, 1], [0, 2, 2])  # both named chunk 1; the DiT ranks took 2 and dropped 1's context
    assert [(p["chunk"], p["prompt_revision"]) for p in traced.prompts] == [(1, 1), (3, 2)]
    assert announced == SWITCH and plain_revisions == [0] * len(KEYS)
    assert revisions == [0] * SWITCH + [1] * (len(KEYS) - SWITCH)
    assert all(np.array_equal(a, b) for a, b in zip(plain, switched, strict=True))  # its frames ignore the text
