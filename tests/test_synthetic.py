"""The synthetic backend: frames follow the camera, the seed matters, and chunk geometry is right."""

from __future__ import annotations

import numpy as np
import torch

from models.controls import ChunkControl, integrate_stream
from models.stages import SessionSpec, run_in_process
from models.synthetic import SyntheticCondition, SyntheticDecode, SyntheticDenoise, synthetic_geometry


def horizontal_shift(a: np.ndarray, b: np.ndarray) -> float:
    """Columns the content moved from frame a to frame b (positive: to the right), by phase correlation."""
    pa, pb = a.astype(np.float64).mean(axis=(0, 2)), b.astype(np.float64).mean(axis=(0, 2))
    pa, pb = pa - pa.mean(), pb - pb.mean()
    spectrum = np.fft.fft(pb) * np.conj(np.fft.fft(pa))
    corr = np.fft.ifft(spectrum / (np.abs(spectrum) + 1e-9)).real
    shift = int(np.argmax(corr))
    return float(shift - len(pa) if shift > len(pa) // 2 else shift)


def run(keys: list[str], seed: int = 0) -> list[np.ndarray]:
    geometry = synthetic_geometry(64, 96, 3)
    stages = SyntheticCondition(geometry, 0), SyntheticDenoise(geometry, 0), SyntheticDecode(geometry, 0)
    rng = np.random.default_rng(1)
    image = torch.from_numpy((rng.random((64, 96, 3)) * 255).astype(np.uint8))
    controls = [ChunkControl(keys=frozenset(k)) for k in keys]
    return [f.numpy() for f in run_in_process(*stages, SessionSpec("s", seed, "p", image), controls)]


def test_strafe_right_and_yaw_right_move_the_picture_left_and_strafe_left_moves_it_right() -> None:
    for keys, sign in (("d", -1), ("l", -1), ("a", 1), ("j", 1)):
        chunks = run([keys, keys])
        shift = horizontal_shift(chunks[0][0], chunks[1][-1])
        assert np.sign(shift) == sign and abs(shift) >= 3, (keys, shift)


def test_still_camera_keeps_the_picture_in_place() -> None:
    chunks = run(["", ""])
    assert abs(horizontal_shift(chunks[0][0], chunks[1][-1])) <= 1


def test_chunk_frame_counts_follow_the_causal_vae_rule() -> None:
    chunks = run(["w", "w", "w"])
    assert [c.shape for c in chunks] == [(9, 64, 96, 3), (12, 64, 96, 3), (12, 64, 96, 3)]


def test_same_seed_same_frames_other_seed_other_frames() -> None:
    a, b, c = run(["w", "l"], seed=1), run(["w", "l"], seed=1), run(["w", "l"], seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[1], c[1])


def test_poses_of_a_stream_start_at_the_identity_and_accumulate() -> None:
    poses = integrate_stream([ChunkControl(keys=frozenset("w"))] * 2, [9, 12])
    assert np.allclose(poses[0], np.eye(4))
    assert poses[-1][2, 3] > poses[8][2, 3] > 0


def test_controls_with_non_finite_or_absurd_values_are_refused() -> None:
    import math

    import pytest

    for bad in (dict(mouse=(math.nan, 0.0)), dict(mouse=(0.0, math.inf)), dict(mouse=(1e6, 0.0)),
                dict(keys=frozenset("q")), dict(poses=((0.0,) * 15,)), dict(poses=((math.nan,) * 16,))):
        with pytest.raises(ValueError):
            ChunkControl(**bad)
