"""The start of a job on the 7-rank CPU layout (real ranks over gloo, real sockets): a rank slow to build its stages
does not make the others fail their first collective (a start-up barrier with ``timeouts.startup_s`` waits for it),
and a rank that runs out of memory warming one frame size up leaves the server serving the others, refusing that
size with a message naming the rank. (A rank that never finishes building: ``tests/test_faults.py``.)"""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ipc.client import Busy, Client
from scripts.local_server import LocalServer

pytestmark = pytest.mark.multiprocess

FAST = ["--synthetic.encode_s=0.01", "--synthetic.denoise_s=0.02", "--synthetic.decode_s=0.01"]
COLLECTIVE_S = 4.0
SLOW_BUILD_S = 2.5 * COLLECTIVE_S  # the late DiT rank: the others would have timed out in its first collective


def png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((height, width, 3), 90, dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def stream(client: Client, image: bytes, chunks: int) -> list[tuple[int, int]]:
    info = client.open(image, num_chunks=chunks)
    for index in range(chunks):
        client.control(info.id, index, keys="w")
    return [tuple(c.frames.shape[1:3]) for c in client.chunks(info.id, timeout_s=60)]


def test_a_rank_slow_to_build_does_not_fail_the_others_first_collective(tmp_path: Path) -> None:
    flags = [*FAST, "--model.kind=tests.faulty_backend:build_slow", f"--timeouts.collective_s={COLLECTIVE_S}"]
    with LocalServer("cpu-tiny", flags, log_path=tmp_path / "server.log",
                     env={"FAULTY_SLOW_BUILD_S": str(SLOW_BUILD_S)}) as server, Client(server.endpoint) as client:
        assert len(stream(client, png(320, 192), 2)) == 2
        assert client.stats().warm is True
    log = (tmp_path / "server.log").read_text(errors="replace")
    waited = [float(x) for x in re.findall(r"every rank was built ([\d.]+) s later", log)]
    assert len(waited) == 7 and max(waited) >= SLOW_BUILD_S - 1.0, waited  # the others did wait, at the barrier


@pytest.mark.parametrize(("stage", "rank", "failed_ranks"), [("decode", 1, ["1"]),
                                                          ("denoise", 3, ["2", "3", "4", "5", "6"])])
def test_a_size_a_rank_cannot_warm_up_is_refused_naming_the_rank_and_the_others_are_served(
        tmp_path: Path, stage: str, rank: int, failed_ranks: list[str]) -> None:
    """Decode rank 1 out of memory at 240x160; or DiT rank 3 alone, which its group agrees on (every DiT rank fails
    that size alike instead of waiting for rank 3 in a collective)."""
    flags = [*FAST, "--model.kind=tests.faulty_backend:build_small_card", "--stream.size=image",
             "--stream.sizes=[[160, 240], [240, 160]]"]
    env = {"FAULTY_OOM_SIZE": "240x160", "FAULTY_OOM_STAGE": stage}
    with LocalServer("cpu-tiny", flags, log_path=tmp_path / "server.log", env=env) as server, \
            Client(server.endpoint) as client:  # fmt: skip
        stats = client.stats()
        assert stats.warm is False
        failed = stats.warm_up[stage].failed
        assert sorted(failed) == failed_ranks and all(list(f) == ["240x160"] for f in failed.values()), failed
        assert "OutOfMemoryError: injected" in failed[str(rank)]["240x160"]
        assert set(map(tuple, stats.warm_up[stage].ranks.values())) == {("160x240",)}
        with pytest.raises(Busy) as refused:
            client.open(png(200, 300))  # portrait: 240x160
        why = refused.value.message
        assert f"could not run its {stage} stage at 240x160" in why and f"rank {rank}" in why, why
        assert "another aspect ratio" in why and not refused.value.retry_after_s  # no close frees this size
        assert stream(client, png(300, 200), 2) == [(160, 240)] * 2  # the size that fits streams
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert f"no 240x160 session can open on this server: rank {failed_ranks[0]} could not run its {stage}" in log
