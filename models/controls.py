"""User controls of one chunk and their integration into per-video-frame camera poses.

A control travels as compact data (held keys, taps, mouse motion, or explicit poses); every DiT rank turns it
into poses locally, one video frame at a time, with the mapping of the official LingBot-World interactive code
(OpenCV axes: x right, y down, z forward; world up is -y):

- J/L yaw left/right about the **world** up axis (``R' = R_y(yaw) R``), I/K pitch up/down about the **camera's**
  right axis (``R' = R R_x(pitch)``), so the camera never rolls; a step that would take the pitch beyond
  ``pitch_limit_deg`` (85) is not taken;
- W/S move along the camera's forward direction projected on the ground, A/D along its right direction projected
  on the ground, so looking up or down never moves the camera vertically;
- per frame: 0.05 scene units and 2 degrees (``MotionSpeeds``, configurable).

Mouse motion is given in degrees of yaw (dx, positive right) and pitch (dy, positive up) for the whole chunk and
is spread evenly over the frames that move; it goes through the same rotations and clamp as the keys. A tap acts as
if the key were held for the whole chunk that consumes it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ipc.protocol import KEYS, MAX_MOUSE_DEGREES, ChunkControl  # noqa: F401  # the wire form is the model's input

# The camera (fx, fy, cx, cy) in pixels of a 480x832 frame when neither the config nor the session gives one: the
# official fast examples' (robbyant/lingbot-world-v2 examples/03 and 04, the camera of run_fast.sh; about 90 degrees
# horizontal field of view), as float32 values of their intrinsics.npy.
OFFICIAL_INTRINSICS = (415.5298, 415.6922, 415.77786, 239.77779)

MOVE_KEYS = frozenset("wasd")
TURN_KEYS = frozenset("ijkl")


@dataclass(frozen=True)
class MotionSpeeds:
    """How far one video frame of a held key moves the camera (defaults: the official interactive mapping)."""

    move: float = 0.05  # W/S: scene units per frame along the horizontal forward direction
    strafe: float = 0.05  # A/D: scene units per frame along the horizontal right direction
    turn_deg: float = 2.0  # I/K/J/L: degrees per frame
    pitch_limit_deg: float = 85.0  # pitch never leaves [-limit, +limit]

    def __post_init__(self) -> None:
        if not all(math.isfinite(v) and v >= 0 for v in (self.move, self.strafe, self.turn_deg)):
            raise ValueError(f"motion speeds must be finite and non-negative: {self}")
        if not 0 < self.pitch_limit_deg < 90:
            raise ValueError(f"pitch_limit_deg must be in (0, 90), got {self.pitch_limit_deg}")


def motion_speeds(controls: object) -> MotionSpeeds:
    """``MotionSpeeds`` of a ``[controls]`` config section."""
    return MotionSpeeds(move=controls.move, strafe=controls.strafe, turn_deg=controls.turn_deg,  # type: ignore[attr-defined]
                        pitch_limit_deg=controls.pitch_limit_deg)  # type: ignore[attr-defined]


def _rot_x(rad: float) -> np.ndarray:
    c, s = math.cos(rad), math.sin(rad)
    return np.array([[1.0, 0.0, 0.0], [0.0, c, -s], [0.0, s, c]])


def _rot_y(rad: float) -> np.ndarray:
    c, s = math.cos(rad), math.sin(rad)
    return np.array([[c, 0.0, s], [0.0, 1.0, 0.0], [-s, 0.0, c]])


def pitch_of(rotation: np.ndarray) -> float:
    """Pitch (radians, positive up) of a roll-free rotation ``R_y(yaw) R_x(pitch)``: ``-R[1, 2] = sin(pitch)``."""
    return math.asin(min(1.0, max(-1.0, -float(rotation[1, 2]))))


def _horizontal(v: np.ndarray) -> np.ndarray:
    """``v`` projected on the ground plane and normalised as the reference does (``/ (norm + 1e-6)``)."""
    flat = np.array([v[0], 0.0, v[2]])
    norm = float(np.linalg.norm(flat))
    return flat / (norm + 1e-6) if norm > 0 else flat


def step_pose(pose: np.ndarray, keys: frozenset[str], mouse_deg: tuple[float, float],
              speeds: MotionSpeeds) -> np.ndarray:  # fmt: skip
    """One video frame of motion from camera-to-world ``pose`` (the official key mapping, see the module docstring)."""
    rotation, position = pose[:3, :3], pose[:3, 3]
    turn = speeds.turn_deg
    pitch_delta = math.radians((("i" in keys) - ("k" in keys)) * turn + mouse_deg[1])
    limit = math.radians(speeds.pitch_limit_deg)
    if not -limit <= pitch_of(rotation) + pitch_delta <= limit:
        pitch_delta = 0.0  # a step past the clamp is not taken (the reference does not clip it)
    yaw_delta = math.radians((("l" in keys) - ("j" in keys)) * turn + mouse_deg[0])
    rotation = _rot_y(yaw_delta) @ rotation @ _rot_x(pitch_delta)  # yaw about world up, pitch about camera right
    forward, right = _horizontal(rotation[:, 2]), _horizontal(rotation[:, 0])
    movement = np.zeros(3)
    if "w" in keys:
        movement += forward * speeds.move
    if "s" in keys:
        movement -= forward * speeds.move
    if "d" in keys:
        movement += right * speeds.strafe
    if "a" in keys:
        movement -= right * speeds.strafe
    out = np.eye(4)
    out[:3, :3] = rotation
    out[:3, 3] = position + movement
    return out


def integrate(
    start: np.ndarray,
    control: ChunkControl,
    num_frames: int,
    speeds: MotionSpeeds = MotionSpeeds(),
    first_is_start: bool = False,
) -> np.ndarray:
    """Camera-to-world poses ``[num_frames, 4, 4]`` (float64) of the chunk's video frames.

    ``start`` is the pose of the last frame of the previous chunk (identity at the start of a stream); with
    ``first_is_start`` (the stream's first chunk, whose first frame is the start image) frame 0 is ``start``
    itself. The mouse motion of the chunk is spread evenly over the frames that move. With explicit ``poses`` in
    the control those are returned as given.
    """
    if control.poses is not None:
        if len(control.poses) != num_frames:
            raise ValueError(f"control has {len(control.poses)} poses, the chunk has {num_frames} video frames")
        return np.array(control.poses, dtype=np.float64).reshape(num_frames, 4, 4)
    moving = max(num_frames - 1 if first_is_start else num_frames, 1)
    mouse = (control.mouse[0] / moving, control.mouse[1] / moving)
    poses = np.empty((num_frames, 4, 4), dtype=np.float64)
    pose = np.asarray(start, dtype=np.float64)
    for f in range(num_frames):
        if f > 0 or not first_is_start:
            pose = step_pose(pose, control.keys, mouse, speeds)
        poses[f] = pose
    return poses


def integrate_stream(
    controls: Sequence[ChunkControl], frames_per_chunk: Sequence[int], speeds: MotionSpeeds = MotionSpeeds()
) -> np.ndarray:
    """Poses of a whole stream, chunk after chunk: ``[sum(frames_per_chunk), 4, 4]``."""
    pose = np.eye(4, dtype=np.float64)
    out = []
    for k, (control, n) in enumerate(zip(controls, frames_per_chunk, strict=True)):
        chunk = integrate(pose, control, n, speeds, first_is_start=k == 0)
        out.append(chunk)
        pose = chunk[-1]
    return np.concatenate(out, axis=0)
