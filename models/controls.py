"""User controls of one chunk and their integration into per-video-frame camera poses.

A control travels as compact data (held keys, taps, mouse motion, or explicit poses); every DiT rank turns it
into poses locally. Keys map to camera motion in the camera's own frame (OpenCV axes: x right, y down,
z forward): W/S forward/back, A/D strafe left/right, I/K pitch up/down, J/L yaw left/right. Mouse motion is
given in degrees of yaw (dx) and pitch (dy) for the whole chunk and is spread evenly over its frames. A tap
acts as if the key were held for the whole chunk that consumes it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ipc.protocol import KEYS, MAX_MOUSE_DEGREES, ChunkControl  # noqa: F401  # the wire form is the model's input

MOVE_KEYS = frozenset("wasd")
TURN_KEYS = frozenset("ijkl")


@dataclass(frozen=True)
class MotionSpeeds:
    """How far one video frame of a held key moves the camera."""

    step: float = 0.08  # translation per frame, scene units
    turn_deg: float = 1.5  # rotation per frame, degrees


def _rotation(axis: str, degrees: float) -> np.ndarray:
    a = math.radians(degrees)
    c, s = math.cos(a), math.sin(a)
    if axis == "x":
        return np.array([[1, 0, 0], [0, c, -s], [0, s, c]], dtype=np.float64)
    return np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]], dtype=np.float64)  # about y


def frame_motion(control: ChunkControl, num_frames: int, speeds: MotionSpeeds = MotionSpeeds()) -> np.ndarray:
    """Per-frame relative camera motion ``[4, 4]`` (camera frame) for one frame of this chunk."""
    keys = control.keys
    forward = ("w" in keys) - ("s" in keys)
    right = ("d" in keys) - ("a" in keys)
    # yaw right (L) turns +z towards +x; pitch up (I) turns +z towards -y.
    yaw = (("l" in keys) - ("j" in keys)) * speeds.turn_deg + control.mouse[0] / max(num_frames, 1)
    pitch = (("i" in keys) - ("k" in keys)) * speeds.turn_deg + control.mouse[1] / max(num_frames, 1)
    motion = np.eye(4, dtype=np.float64)
    motion[:3, :3] = _rotation("y", yaw) @ _rotation("x", pitch)
    motion[:3, 3] = (right * speeds.step, 0.0, forward * speeds.step)
    return motion


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
    itself. With explicit ``poses`` in the control those are returned as given.
    """
    if control.poses is not None:
        if len(control.poses) != num_frames:
            raise ValueError(f"control has {len(control.poses)} poses, the chunk has {num_frames} video frames")
        return np.array(control.poses, dtype=np.float64).reshape(num_frames, 4, 4)
    motion = frame_motion(control, num_frames, speeds)
    poses = np.empty((num_frames, 4, 4), dtype=np.float64)
    pose = start
    for f in range(num_frames):
        if f > 0 or not first_is_start:
            pose = pose @ motion
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
