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

MOVE_KEYS = frozenset("wasd")
TURN_KEYS = frozenset("ijkl")
KEYS = MOVE_KEYS | TURN_KEYS
MAX_MOUSE_DEGREES = 360.0  # per chunk; more is a client bug, not a turn


@dataclass(frozen=True)
class MotionSpeeds:
    """How far one video frame of a held key moves the camera."""

    step: float = 0.08  # translation per frame, scene units
    turn_deg: float = 1.5  # rotation per frame, degrees


@dataclass(frozen=True)
class ChunkControl:
    """The immutable control applied to one chunk: what the model saw."""

    keys: frozenset[str] = frozenset()  # keys held for the whole chunk (taps included)
    mouse: tuple[float, float] = (0.0, 0.0)  # yaw, pitch in degrees over the whole chunk
    poses: tuple[tuple[float, ...], ...] | None = None  # explicit c2w per video frame, 16 floats row-major
    revision: int = -1  # client revision of the input state this snapshot came from (-1: indexed control)

    def __post_init__(self) -> None:
        unknown = set(self.keys) - KEYS
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}; valid keys are {sorted(KEYS)}")
        if not all(math.isfinite(v) and abs(v) <= MAX_MOUSE_DEGREES for v in self.mouse):
            raise ValueError(f"mouse must be two finite angles within ±{MAX_MOUSE_DEGREES} degrees, got {self.mouse}")
        if self.poses is not None:
            if any(len(p) != 16 for p in self.poses):
                raise ValueError("each pose must be a 4x4 camera-to-world matrix given as 16 floats")
            if not all(math.isfinite(v) for p in self.poses for v in p):
                raise ValueError("poses must hold finite numbers")

    def to_wire(self) -> dict[str, object]:
        out: dict[str, object] = {"keys": sorted(self.keys), "mouse": list(self.mouse), "revision": self.revision}
        if self.poses is not None:
            out["poses"] = [list(p) for p in self.poses]
        return out

    @classmethod
    def from_wire(cls, data: dict[str, object]) -> ChunkControl:
        poses = data.get("poses")
        mouse = data.get("mouse", (0.0, 0.0))
        return cls(
            keys=frozenset(str(k).lower() for k in data.get("keys", ())),  # type: ignore[union-attr]
            mouse=(float(mouse[0]), float(mouse[1])),  # type: ignore[index]
            poses=None if poses is None else tuple(tuple(float(v) for v in p) for p in poses),  # type: ignore[union-attr]
            revision=int(data.get("revision", -1)),  # type: ignore[arg-type]
        )


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
