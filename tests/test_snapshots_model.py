"""The real model's stages (umT5 + VAE encode, the DiT with its KV ring, VAE decode; cpu-tiny-model's tiny random
weights) in one process: a session forked from each stage's saved state, through a safetensors file, produces the
same next chunks as the original, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models import snapshot_io
from models.controls import ChunkControl
from models.stages import SessionSpec
from scripts.local_server import ROOT
from tests.shared import tiny_model_stages

IMAGE = (ROOT / "assets" / "start.png").read_bytes()


def through_a_file(state: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    save_file(snapshot_io.capture(state), str(path))
    return load_file(str(path))


def test_real_model_stages_forked_from_their_saved_state_continue_bit_for_bit(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    cfg, condition, denoise, decode, image = tiny_model_stages(IMAGE)
    spec = SessionSpec("a", 11, "a red house", image, cfg.stream.height, cfg.stream.width)
    context = condition.open(spec)
    denoise.open(SessionSpec("a", 11, "a red house", None, cfg.stream.height, cfg.stream.width), context)
    decode.open(SessionSpec("a", 0, "", None, cfg.stream.height, cfg.stream.width))
    controls = [ChunkControl(keys=frozenset(k)) for k in ("w", "wl", "d", "a", "j")]

    def chunk(session: str, i: int) -> torch.Tensor:
        return decode.decode(session, i, denoise.denoise(session, i, condition.encode(session, i), controls[i]))

    for i in range(2):
        chunk("a", i)
    states = [through_a_file(stage.state_dict("a"), tmp_path / f"{n}.safetensors")
              for n, stage in enumerate((condition, denoise, decode))]
    assert any(name.startswith("encoder.cache") for name in states[0])
    assert states[1]["kv.ring"].tolist()[0] == 2 * cfg.stream.chunk_latent_frames * 24  # tokens written: 2 chunks
    expected = [chunk("a", i) for i in range(2, 5)]

    fork = SessionSpec("f", 0, "ignored: the state has the context", None, cfg.stream.height, cfg.stream.width)
    restored_context = condition.load_state(fork, states[0])
    assert torch.equal(restored_context, context)
    denoise.load_state(fork, restored_context, states[1])
    decode.load_state(fork, states[2])
    got = [chunk("f", i) for i in range(2, 5)]
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert torch.equal(a, b), f"chunk {i + 2} of the fork differs"


@pytest.mark.multiprocess
def test_seven_rank_real_model_restore_and_fork_match_the_uninterrupted_stream_bit_for_bit(tmp_path: Path) -> None:
    """The encoder ran ahead of the boundary (conditions prefetched): a restored session takes those conditions
    from the snapshot and its encoder continues from where the original's stood."""
    import numpy as np

    from ipc.client import Client
    from scripts.local_server import LocalServer

    keys = ["w", "wl", "d", "a", "j"]
    with LocalServer("cpu-tiny-model", [f"--snapshots.dir={tmp_path}"]) as server, \
            Client(server.endpoint) as client:  # fmt: skip
        info = client.open(IMAGE, prompt="a red house", seed=5, num_chunks=len(keys))
        frames = {}
        for i in range(2):
            client.control(info.id, i, keys=keys[i])
            frames[i] = client.next_chunk(info.id, timeout_s=120).frames.copy()
        snapshot = client.save(info.id)
        for i in range(2, len(keys)):
            client.control(info.id, i, keys=keys[i])
            frames[i] = client.next_chunk(info.id, timeout_s=120).frames.copy()
        client.wait_closed(info.id, timeout_s=120)
        assert snapshot.chunk == 2
        for _ in range(2):
            restored = client.open(restore=snapshot.id)
            assert restored.first_chunk == 2
            for i in range(2, len(keys)):
                client.control(restored.id, i, keys=keys[i])
                chunk = client.next_chunk(restored.id, timeout_s=120)
                assert chunk.index == i and np.array_equal(chunk.frames, frames[i]), f"chunk {i} differs"
            client.wait_closed(restored.id, timeout_s=120)


@pytest.mark.multiprocess
def test_seven_rank_real_model_saved_after_a_prompt_change_restores_with_that_prompt_bit_for_bit(
        tmp_path: Path) -> None:  # fmt: skip
    """The prompt changed at chunk 1 and the steps at chunk 2, then a save at chunk 3: the restored session runs the
    new text (its revision continuing the snapshot's) and the asked steps, frame for frame as the original."""
    import numpy as np

    from ipc.client import Client
    from scripts.local_server import LocalServer

    keys = ["w", "wl", "d", "a", "j"]
    with LocalServer("cpu-tiny-model", [f"--snapshots.dir={tmp_path}"]) as server, \
            Client(server.endpoint) as client:  # fmt: skip
        info = client.open(IMAGE, prompt="a red house", seed=5, num_chunks=len(keys))
        chunks = {}
        for i in range(3):
            if i == 1:  # chunk 0 arrived and control 1 is not sent: chunk 1 is the first with the new text
                assert client.set_prompt(info.id, "a snowy forest at night").chunk == 1
            client.control(info.id, i, keys=keys[i], steps=2 if i == 2 else None)
            chunks[i] = client.next_chunk(info.id, timeout_s=120)
        snapshot = client.save(info.id)
        for i in range(3, len(keys)):
            client.control(info.id, i, keys=keys[i])
            chunks[i] = client.next_chunk(info.id, timeout_s=120)
        client.wait_closed(info.id, timeout_s=120)
        assert snapshot.chunk == 3
        restored = client.open(restore=snapshot.id)
        got = {}
        for i in range(3, len(keys)):
            client.control(restored.id, i, keys=keys[i])
            got[i] = client.next_chunk(restored.id, timeout_s=120)
        client.wait_closed(restored.id, timeout_s=120)
        fork = client.open(restore=snapshot.id)  # a fork changes the prompt at once: revision 2 from chunk 3
        reply = client.set_prompt(fork.id, "rain")
        client.control(fork.id, 3, keys=keys[3])
        forked = client.next_chunk(fork.id, timeout_s=120)
        client.close(fork.id)
    assert [chunks[i].prompt_revision for i in range(len(keys))] == [0, 1, 1, 1, 1]
    assert [chunks[i].facts.steps for i in range(len(keys))] == [4, 4, 2, 2, 2]
    for i in range(3, len(keys)):
        assert np.array_equal(got[i].frames, chunks[i].frames), f"chunk {i} differs"
        assert (got[i].prompt_revision, got[i].facts.steps) == (1, 2)
    assert (reply.revision, reply.chunk, forked.prompt_revision) == (2, 3, 2)  # revisions continue the snapshot's
    assert not np.array_equal(forked.frames, chunks[3].frames)
