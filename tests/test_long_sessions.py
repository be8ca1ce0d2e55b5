"""A session may run ``server.max_chunks`` (100 000) chunks: every per-session quantity that grows with it stays
finite and cheap. Each piece is put at chunk 100 000 directly (the state a 100 000-chunk walk leaves), not run
there chunk by chunk; ``scripts/soak.py --hold`` walks 5 000 chunks for real on a zero-cost server."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from models.camera import StreamingCamera
from models.controls import ChunkControl, MotionSpeeds, integrate
from models.dit_config import DiTConfig
from models.kv_cache import KVCache
from models.lingbot_denoise import LingbotDenoiseStage
from models.rope import apply_rope, rope_angles, rope_freqs
from models.stages import SessionSpec, StreamGeometry
from models.synthetic import render, view_parameters
from runtime.metrics import StreamStat

CHUNK = 100_000
FRAMES_PER_CHUNK = 12  # video frames of a v1 chunk
LATENT_FRAMES = CHUNK * 3


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """The tiny models run fastest on one thread here; other modules keep their own setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def far_pose(yaw_deg: float = 0.0) -> np.ndarray:
    """Where holding W (and turning) for 100 000 chunks leaves the camera: 0.05 units a frame."""
    steps = CHUNK * FRAMES_PER_CHUNK
    pose = np.eye(4)
    a = math.radians(yaw_deg)
    pose[:3, :3] = [[math.cos(a), 0, math.sin(a)], [0, 1, 0], [-math.sin(a), 0, math.cos(a)]]
    pose[:3, 3] = (0.05 * steps * 0.3, 0.0, 0.05 * steps)
    return pose


def test_the_synthetic_camera_renders_finite_frames_at_chunk_100000() -> None:
    pan_x, pan_y, log_zoom = view_parameters(far_pose(yaw_deg=3 * CHUNK))
    assert abs(pan_x) <= 2 and abs(pan_y) <= 2 and abs(log_zoom) <= 2.5  # a pan wraps, the zoom stops
    poses = integrate(far_pose(), ChunkControl(keys=frozenset("wl")), FRAMES_PER_CHUNK)
    frames = render(torch.rand(3, 32, 48), poses, 8, 12)
    assert torch.isfinite(frames).all()
    explicit = np.eye(4)
    explicit[2, 3] = -1500.0  # the control that overflowed the renderer's exp() before
    assert torch.isfinite(render(torch.rand(3, 32, 48), explicit[None], 8, 12)).all()


def test_the_dit_sees_the_same_camera_step_far_away_as_at_the_start() -> None:
    """Framewise steps are taken in float64 from float64 poses: 60 000 units out, a step of 0.05 keeps its digits
    (in float32 it would be off by tens of percent)."""
    k = torch.tensor([520.0, 520.0, 416.0, 240.0])
    control = ChunkControl(keys=frozenset("w"))
    near, far = StreamingCamera(k, 32, 48), StreamingCamera(k, 32, 48)
    far.last_video_pose = far_pose()
    far.prev_latent_pose = torch.from_numpy(far_pose())
    near.prev_latent_pose = torch.eye(4, dtype=torch.float64)
    at_start = near.control(integrate(near.last_video_pose, control, FRAMES_PER_CHUNK), first_chunk=False)
    at_end = far.control(integrate(far.last_video_pose, control, FRAMES_PER_CHUNK), first_chunk=False)
    torch.testing.assert_close(at_end, at_start, rtol=0, atol=1e-5)


def test_rope_at_latent_frame_300000_is_finite_and_depends_only_on_distance() -> None:
    hd = 12
    q = torch.randn(6, 2, hd, dtype=torch.float64)
    far = apply_rope(q, rope_freqs(rope_angles(hd, 1, 2, 3, LATENT_FRAMES)))
    assert torch.isfinite(far).all()
    near_q = apply_rope(q, rope_freqs(rope_angles(hd, 1, 2, 3, 7)))
    far_k = apply_rope(q, rope_freqs(rope_angles(hd, 1, 2, 3, LATENT_FRAMES - 5)))
    near_k = apply_rope(q, rope_freqs(rope_angles(hd, 1, 2, 3, 2)))
    torch.testing.assert_close((far * far_k).sum(-1), (near_q * near_k).sum(-1), rtol=0, atol=1e-6)


def test_the_kv_cache_rolls_on_at_token_300_million_with_constant_memory() -> None:
    fs, cs = 6, 3
    cache = KVCache(1, 8 * fs, 2 * fs, heads=1, head_dim=2, device="cpu", dtype=torch.float32)
    start = LATENT_FRAMES * fs
    cache.global_end, cache.filled = start, cache.slots  # the window full, as after 100 000 chunks
    before = cache.nbytes()
    for k in range(4):
        cache.begin(start + k * cs * fs, cs * fs)
        keys, _ = cache.write(0, torch.ones(1, cs * fs, 2), torch.ones(1, cs * fs, 2))
        assert keys.shape[1] == cache.slots and cache.evicted == cs * fs
    assert cache.nbytes() == before and cache.global_end == start + 4 * cs * fs


def test_the_real_denoise_stage_runs_chunk_100000() -> None:
    geometry = StreamGeometry(height=32, width=48, chunk_latent_frames=3, context_shape=(16, 32),
                              condition_shape=(20, 3, 4, 6), latent_shape=(16, 3, 4, 6))  # fmt: skip
    stage = LingbotDenoiseStage(DiTConfig.from_name("tiny", attention="sdpa"), geometry, init_seed=1,
                                speeds=MotionSpeeds())  # fmt: skip
    stage.open(SessionSpec("s", 0, ""), torch.zeros(16, 32))
    session = stage.sessions["s"]
    session.next_index = CHUNK  # as after 100 000 chunks: camera far out, KV positions and RoPE far along
    session.camera.last_video_pose = far_pose()
    session.camera.prev_latent_pose = torch.from_numpy(far_pose())
    fs = 6
    session.cache.global_end, session.cache.filled = CHUNK * 3 * fs, session.cache.slots
    latent = stage.denoise("s", CHUNK, torch.randn(20, 3, 4, 6), ChunkControl(keys=frozenset("w")))
    assert torch.isfinite(latent).all() and session.cache.global_end == (CHUNK + 1) * 3 * fs


def test_metrics_of_a_100000_chunk_session_stay_in_constant_memory() -> None:
    stat = StreamStat()
    for i in range(CHUNK):
        stat.add(0.25 + (i % 97) * 1e-3)
    assert stat.count == CHUNK and len(stat._buckets) <= StreamStat.MAX_BUCKETS
    assert abs(stat.percentile(50) - 0.298) < 0.01
