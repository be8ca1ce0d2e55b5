"""Controls -> poses -> relative poses -> Plücker: the reference clip rule and the streaming rule."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch

from models.camera import (
    StreamingCamera,
    clip_control,
    intrinsics_at,
    latent_frame_poses,
    relative_poses,
    resample_poses,
    scale_intrinsics,
)
from models.controls import OFFICIAL_INTRINSICS, ChunkControl, MotionSpeeds, integrate, integrate_stream, pitch_of
from models.lingbot_denoise import LingbotDenoiseStage
from runtime.config import ControlsConfig

H, W, CS = 32, 48, 3
INTRINSICS = torch.tensor([[520.0, 480.0, 410.0, 245.0]])


def _frames(chunks: int) -> list[int]:
    return [1 + 4 * (CS - 1)] + [4 * CS] * (chunks - 1)


def _stream(controls: list[ChunkControl]) -> tuple[np.ndarray, torch.Tensor]:
    """Whole-clip video poses and the streaming control tensor of every chunk concatenated in time."""
    frames = _frames(len(controls))
    poses = integrate_stream(controls, frames)
    cam = StreamingCamera(INTRINSICS, H, W)
    out, start = [], 0
    for k, n in enumerate(frames):
        out.append(cam.control(poses[start : start + n], first_chunk=k == 0))
        start += n
    return poses, torch.cat(out, dim=2)


def test_streaming_rule_equals_the_whole_clip_reference_at_constant_camera_speed() -> None:
    poses, streamed = _stream([ChunkControl(keys=frozenset("wdl"))] * 4)  # same motion every frame
    reference = clip_control(poses, INTRINSICS, H, W, 4 * CS)["plucker_from_poses"]
    torch.testing.assert_close(streamed, reference, rtol=0, atol=2e-5)


def test_streaming_rule_scales_each_chunk_by_its_own_fastest_step_where_the_reference_uses_the_clip() -> None:
    slow, fast = ChunkControl(keys=frozenset("w")), ChunkControl(keys=frozenset("wd"))  # sqrt(2) faster
    poses, streamed = _stream([fast, slow, slow])
    reference = clip_control(poses, INTRINSICS, H, W, 3 * CS)["plucker_from_poses"]

    def origin_norm(control: torch.Tensor, frame: int) -> float:
        return float(torch.linalg.vector_norm(control[0, [0, 64, 128], frame, 0, 0]))

    assert math.isclose(origin_norm(streamed, 4), 1.0, rel_tol=1e-5)  # slow chunk, streaming: unit step
    assert math.isclose(origin_norm(reference, 4), 1 / math.sqrt(2), rel_tol=1e-4)  # reference: relative to clip
    torch.testing.assert_close(streamed[:, :, :CS], reference[:, :, :CS], rtol=0, atol=2e-5)


def test_rotation_only_stream_has_zero_ray_origins_instead_of_amplified_rounding_noise() -> None:
    _, streamed = _stream([ChunkControl(keys=frozenset("l"), mouse=(5.0, 1.0))] * 3)
    origins = streamed[0, :192]  # channels 0..2 of every pixel
    assert origins.abs().max() < 1e-5
    directions = streamed[0, 192:].reshape(3, 64, -1)
    torch.testing.assert_close(directions.norm(dim=0), torch.ones(64, directions.shape[-1]), rtol=0, atol=1e-5)


def test_latent_frames_of_each_chunk_are_every_fourth_video_frame_of_the_stream() -> None:
    frames = _frames(4)
    poses = integrate_stream([ChunkControl(keys=frozenset("wj"))] * 4, frames)
    starts = np.cumsum([0, *frames[:-1]])
    picked = [latent_frame_poses(poses[s : s + n], k == 0) for k, (s, n) in enumerate(zip(starts, frames))]
    np.testing.assert_array_equal(np.concatenate(picked), poses[::4])


def _yaw(degrees: float, t: tuple[float, float, float]) -> np.ndarray:
    a = math.radians(degrees)
    p = np.eye(4)
    p[:3, :3] = [[math.cos(a), 0, math.sin(a)], [0, 1, 0], [-math.sin(a), 0, math.cos(a)]]
    p[:3, 3] = t
    return p


def test_resampling_between_video_frames_slerps_rotation_and_lerps_translation() -> None:
    poses = np.stack([_yaw(0, (0, 0, 0)), _yaw(40, (2, 0, 4)), _yaw(80, (4, 0, 0))])
    out = resample_poses(poses, 5)  # positions 0, 0.5, 1, 1.5, 2
    torch.testing.assert_close(out[1], torch.from_numpy(_yaw(20, (1, 0, 2))).float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(out[3], torch.from_numpy(_yaw(60, (3, 0, 2))).float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(out[::2], torch.from_numpy(poses).float(), rtol=0, atol=0)


def test_relative_poses_start_at_identity_and_chain_back_to_the_absolute_poses() -> None:
    poses = torch.from_numpy(integrate_stream([ChunkControl(keys=frozenset("wi"))], [9])[::4].copy()).float()
    rel = relative_poses(poses)
    torch.testing.assert_close(rel[0], torch.eye(4))
    chained = poses[0]
    for i in range(1, len(poses)):
        chained = chained @ rel[i]
        torch.testing.assert_close(chained, poses[i], rtol=0, atol=1e-5)


def test_intrinsics_are_rescaled_from_the_480x832_reference_frame() -> None:
    k = scale_intrinsics(torch.tensor([[832.0, 480.0, 416.0, 240.0], [1.0, 1.0, 1.0, 1.0]]), 240, 416)
    torch.testing.assert_close(k, torch.tensor([416.0, 240.0, 208.0, 120.0]))


def test_the_default_camera_is_the_official_fast_examples_and_scales_with_the_frame_size() -> None:
    """The official fast run scripts' camera (robbyant/lingbot-world-v2 examples/03/intrinsics.npy, row 0): about
    90 degrees across at 480x832, by default in the config, the stage and a session; scaled with the frame."""
    official = (415.5298, 415.6922, 415.77786, 239.77779)
    assert OFFICIAL_INTRINSICS == official == ControlsConfig().intrinsics
    assert inspect.signature(LingbotDenoiseStage).parameters["intrinsics"].default == official
    assert intrinsics_at(official, 480, 832) == tuple(float(np.float32(v)) for v in official)
    fov = math.degrees(2 * math.atan(832 / 2 / official[0]))
    assert 89.9 < fov < 90.2
    half = intrinsics_at(official, 240, 416)
    assert half == pytest.approx(tuple(v / 2 for v in official), rel=1e-6)
    portrait = intrinsics_at(official, 832, 480)  # x scales with the width, y with the height
    assert portrait == pytest.approx((official[0] * 480 / 832, official[1] * 832 / 480, official[2] * 480 / 832,
                                      official[3] * 832 / 480), rel=1e-6)


@pytest.mark.parametrize(("height", "width"), [(480, 832), (464, 832), (240, 416), (832, 480), (160, 256), (720, 1280)])
def test_the_intrinsics_rank_0_answers_with_are_the_float32_numbers_the_rays_use(height: int, width: int) -> None:
    for camera in ((415.5298, 415.6922, 415.77786, 239.77779), (520.0, 520.1, 416.3, 240.7)):
        rays_k = scale_intrinsics(torch.tensor(camera, dtype=torch.float32), height, width).tolist()
        assert intrinsics_at(camera, height, width) == tuple(rays_k)  # bit for bit, without torch on rank 0


DEFAULT_SPEEDS = MotionSpeeds()


def _hold(keys: str, frames: int, start: np.ndarray | None = None, mouse: tuple[float, float] = (0.0, 0.0),
          speeds: MotionSpeeds = DEFAULT_SPEEDS) -> np.ndarray:  # fmt: skip
    """The pose after holding ``keys`` for ``frames`` video frames (a later chunk: every frame moves)."""
    start = np.eye(4) if start is None else start
    return integrate(start, ChunkControl(keys=frozenset(keys), mouse=mouse), frames, speeds)[-1]


def _official_rotation(yaw_deg: float, pitch_deg: float) -> np.ndarray:
    """``R_y(yaw) R_x(pitch)``: the official mapping's orientation after pitching, then yawing about world up."""
    y, p = math.radians(yaw_deg), math.radians(pitch_deg)
    r_y = np.array([[math.cos(y), 0, math.sin(y)], [0, 1, 0], [-math.sin(y), 0, math.cos(y)]])
    r_x = np.array([[1, 0, 0], [0, math.cos(p), -math.sin(p)], [0, math.sin(p), math.cos(p)]])
    return r_y @ r_x


def test_pitch_up_then_yaw_90_then_forward_keeps_the_camera_level_and_moves_it_horizontally() -> None:
    """Official mapping: yaw about the world up axis, pitch about the camera's right axis, W along the horizontal
    forward direction, 2 degrees and 0.05 units per frame. Numbers derived from those formulas."""
    pitched = _hold("i", 8)  # +16 degrees
    turned = _hold("l", 45, pitched)  # +90 degrees of yaw
    moved = _hold("w", 10, turned)
    np.testing.assert_allclose(moved[:3, :3], _official_rotation(90.0, 16.0), rtol=0, atol=1e-12)
    assert abs(moved[1, 0]) < 1e-12, "the camera's right axis stays horizontal: no roll"
    assert math.degrees(pitch_of(moved[:3, :3])) == pytest.approx(16.0, abs=1e-9)
    cos_p = math.cos(math.radians(16.0))
    step = 0.05 * cos_p / (cos_p + 1e-6)  # the reference normalises the ground direction by (norm + 1e-6)
    np.testing.assert_allclose(moved[:3, 3], [10 * step, 0.0, 0.0], rtol=0, atol=1e-12)  # +x: facing right, level


def test_strafe_moves_along_the_horizontal_right_direction_and_s_undoes_w() -> None:
    pose = _hold("d", 4, _hold("k", 10))  # pitched down 20 degrees, then strafe right
    np.testing.assert_allclose(pose[:3, 3], [4 * 0.05 * 1 / (1 + 1e-6), 0.0, 0.0], rtol=0, atol=1e-12)
    back = _hold("s", 6, _hold("w", 6))
    np.testing.assert_allclose(back[:3, 3], 0.0, atol=1e-15)


def test_pitch_stops_at_the_clamp_and_a_step_past_it_is_not_taken() -> None:
    up = _hold("i", 50)  # 42 steps reach 84 degrees; the 43rd would be 86 > 85
    assert math.degrees(pitch_of(up[:3, :3])) == pytest.approx(84.0, abs=1e-9)
    down = _hold("k", 3, up)
    assert math.degrees(pitch_of(down[:3, :3])) == pytest.approx(78.0, abs=1e-9)
    np.testing.assert_allclose(_hold("i", 5, speeds=MotionSpeeds(pitch_limit_deg=5))[:3, :3],
                               _official_rotation(0, 4), atol=1e-12)  # fmt: skip


def test_mouse_motion_of_a_chunk_is_spread_over_its_moving_frames_and_sums_to_what_was_sent() -> None:
    later = integrate(np.eye(4), ChunkControl(mouse=(30.0, -6.0)), 12)
    np.testing.assert_allclose(later[-1][:3, :3], _official_rotation(30.0, -6.0), atol=1e-12)
    first = integrate(np.eye(4), ChunkControl(mouse=(30.0, 0.0)), 9, first_is_start=True)  # frame 0 = the image
    np.testing.assert_allclose(first[0], np.eye(4))
    np.testing.assert_allclose(first[-1][:3, :3], _official_rotation(30.0, 0.0), atol=1e-12)
