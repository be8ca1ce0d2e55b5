"""Frame sizes and the warm start on the 7-rank CPU layout (real ranks, real sockets), with ``stream.size = "image"``
and two allowed sizes: each session streams at the allowed size nearest its start image, sessions of different sizes
stream at once, and every stage of every rank ran at both sizes before the port opened, so a stage's first use of a
size (``synthetic.cold_s``, what cuDNN autotuning costs on a GPU) never lands on a session's chunk."""

from __future__ import annotations

import io
import re
import statistics
import threading
from collections.abc import Iterator

import numpy as np
import psutil
import pytest
from PIL import Image

from ipc.client import Client, SessionInfo
from runtime.metrics import stage_seconds
from scripts.local_server import LocalServer

pytestmark = pytest.mark.multiprocess

FAST = ["--synthetic.encode_s=0.01", "--synthetic.denoise_s=0.02", "--synthetic.decode_s=0.01"]
COLD_S = 2.0  # a stage's first chunk at a size it has not run at: far above the stages' costs and the load's noise
SIZES = ["160x240", "240x160"]


def png(width: int, height: int) -> bytes:
    """A gradient, so a resize that went wrong would show."""
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None, None]
    rgb = np.concatenate([np.broadcast_to(x, (height, width, 1)), np.broadcast_to(y, (height, width, 1)),
                          np.full((height, width, 1), 80.0)], axis=2).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    flags = [*FAST, "--stream.size=image", "--stream.sizes=[[160, 240], [240, 160]]", f"--synthetic.cold_s={COLD_S}"]
    with LocalServer("cpu-tiny", flags) as server:
        yield server


def test_an_odd_image_lands_on_an_allowed_size_and_its_first_chunk_is_as_fast_as_the_steady_ones(
        server: LocalServer) -> None:
    with Client(server.endpoint) as client:
        assert client.stats().sessions.total == 0  # the server's first session: no size was used by another
        info = client.open(png(517, 211), num_chunks=4)  # 2.45:1 -> the wide allowed size
        for index in range(4):
            client.control(info.id, index, keys="w")
        chunks = list(client.chunks(info.id, timeout_s=60))
    assert (info.height, info.width) == (160, 240)
    assert [c.frames.shape[1:3] for c in chunks] == [(160, 240)] * 4
    for stage in ("condition", "denoise", "decode"):
        first, *steady = [stage_seconds(c.facts, stage) for c in chunks]
        # chunk 0 of decode does less work than the steady chunks, never more; a cold size would add COLD_S
        assert first - statistics.median(steady) < COLD_S / 2, (stage, first, steady)


def test_two_sessions_with_different_aspect_ratios_stream_at_once_each_at_its_own_size(server: LocalServer) -> None:
    images = {"landscape": png(300, 200), "portrait": png(200, 300)}  # frame sizes 160x240 and 240x160
    results: dict[str, tuple[SessionInfo, list]] = {}
    both_open = threading.Barrier(2, timeout=60)

    def run(name: str) -> None:
        with Client(server.endpoint) as client:
            info = client.open(images[name], seed=1, num_chunks=5)
            both_open.wait()  # the two streams run at once
            for index in range(5):
                client.control(info.id, index, keys="d")
            results[name] = (info, list(client.chunks(info.id, timeout_s=60)))

    threads = [threading.Thread(target=run, args=(name,)) for name in images]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    sizes = {"landscape": (160, 240), "portrait": (240, 160)}
    assert set(results) == set(sizes)
    for name, (info, chunks) in results.items():
        height, width = sizes[name]
        assert (info.height, info.width) == (height, width)
        assert [c.index for c in chunks] == list(range(5))
        assert [c.frames.shape for c in chunks] == [(9, height, width, 3)] + [(12, height, width, 3)] * 4
    # both streams shared the ranks (the scheduler is fair at chunk boundaries): neither waited for the other
    (a, b) = (results["landscape"][1], results["portrait"][1])
    assert a[0].received < b[-1].received and b[0].received < a[-1].received


def test_every_stage_of_every_rank_is_warm_at_every_allowed_size_before_serving(server: LocalServer) -> None:
    with Client(server.endpoint) as client:
        stats = client.stats()
    assert stats.warm is True and stats.sizes == [(160, 240), (240, 160)]
    warm = stats.warm_up
    assert {name: stage.ranks for name, stage in warm.items()} == {
        "condition": {"0": SIZES}, "decode": {"1": SIZES}, "denoise": {str(r): SIZES for r in range(2, 7)}}
    for name, stage in warm.items():
        assert stage.chunks_per_size == 2
        assert stage.seconds >= 2 * COLD_S  # the first use of each size was paid at start-up
        # by the thread that serves the stage (run_thread names it after its role): cuDNN's cache is per thread
        assert set(map(tuple, stage.threads.values())) == {(name,)}, stage.threads
        assert stage.failed == {}
    log = server.log()  # warm before serving
    assert -1 < log.find("warm-up: warm at 160x240, 240x160") < log.find("coordinator: serving on tcp:")


def test_every_rank_makes_the_communicator_of_each_of_its_groups_once_in_creation_order_at_start(
        server: LocalServer) -> None:
    log = server.log_path.read_text(errors="replace")
    made = re.findall(r"rank(\d) INFO worldstream: rank \d: communicators made, in order: (.*)$", log, re.M)
    # cpu-tiny: condition 0, decode 1, DiT 2-6 (leader 2); latent 2 -> 1, frames 1 -> 0
    assert sorted(made) == [("0", "control, condition, frames"), ("1", "control, latent, frames"),
                            ("2", "control, dit, condition, latent"),
                            *[(str(r), "control, dit, condition") for r in range(3, 7)]]
    # before any warm-up: no role thread could make one lazily while another waits in a collective
    assert max(log.find(f"rank{r} INFO worldstream: rank {r}: communicators") for r in range(7)) < log.find("warm-up:")


def test_the_ranks_load_cuda_modules_eagerly_and_expand_allocator_segments(server: LocalServer) -> None:
    assert server.process is not None
    ranks = [p for p in psutil.Process(server.process.pid).children(recursive=True) if "RANK" in p.environ()]
    assert len(ranks) == 7
    assert {p.environ().get("CUDA_MODULE_LOADING") for p in ranks} == {"EAGER"}
    assert {p.environ().get("PYTORCH_CUDA_ALLOC_CONF") for p in ranks} == {"expandable_segments:True"}
