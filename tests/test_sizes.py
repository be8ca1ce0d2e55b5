"""Per-session frame sizes on the 7-rank CPU layout (real ranks, real sockets): with ``stream.size = "image"`` two
sessions whose start images have different aspect ratios stream at once, each at its own size, in order."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
from PIL import Image

from ipc.client import Client, SessionInfo
from scripts.local_server import LocalServer

pytestmark = pytest.mark.multiprocess

FAST = ["--synthetic.encode_s=0.01", "--synthetic.denoise_s=0.02", "--synthetic.decode_s=0.01"]
AREA = 160 * 256


def png(width: int, height: int) -> bytes:
    """A gradient, so a resize that went wrong would show."""
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None, None]
    rgb = np.concatenate([np.broadcast_to(x, (height, width, 1)), np.broadcast_to(y, (height, width, 1)),
                          np.full((height, width, 1), 80.0)], axis=2).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format="PNG")
    return out.getvalue()


def test_two_sessions_with_different_aspect_ratios_stream_at_once_each_at_its_own_size() -> None:
    images = {"landscape": png(300, 200), "portrait": png(200, 300)}  # frame sizes 160x240 and 240x160
    results: dict[str, tuple[SessionInfo, list]] = {}
    with LocalServer("cpu-tiny", [*FAST, "--stream.size=image", f"--stream.max_area={AREA}"]) as server:

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
        assert server.stop() == 0
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
