"""Camera poses -> relative poses -> Plücker rays -> the folded control tensor the DiT consumes.

Reference pipeline (checked number for number by the golden fixtures), for a whole clip:

1. ``scale_intrinsics``: row 0 ``(fx, fy, cx, cy)`` given for 480x832, rescaled to H x W;
2. ``resample_poses``: the Fv video poses to F latent poses at ``linspace(0, Fv-1, F)`` (translation lerp,
   rotation slerp with sign continuity) in float64, cast to float32;
3. ``relative_poses``: ``rel_i = inv(P_0) P_i`` then framewise ``R_i = inv(rel_{i-1}) rel_i``, ``R_0 = I``;
4. ``normalize_translation``: every translation divided by the max norm over the **whole clip**;
5. ``rays``: per pixel centre a unit direction ``R_i K^-1 (u, v, 1)`` and origin ``t_i`` (6 channels),
   folded per 8x8 pixel block into ``[1, 384, F, h, w]``.

Streaming rule (``StreamingCamera``). A stream cannot see future chunks, so step 4 cannot be done. Per chunk
we take the latent poses of the chunk and the last latent pose of the previous chunk, form the framewise
relative poses ``inv(P_{i-1}) P_i`` (the first frame of the stream gets ``I``), and divide the translations by
their maximum norm **over this chunk only** (the step from the previous pose included). Differences to the
reference: (a) with a constant camera speed both give the same tensor; (b) when the speed changes, the
reference scales all chunks by the fastest step of the clip, the stream scales each chunk by its own fastest
step, so within a chunk relative speeds are kept but across chunks the magnitude is always 1 when moving;
(c) a chunk whose largest step is below ``MIN_TRANSLATION`` is treated as not translating (left unscaled):
the reference divides by any positive maximum, which would blow float32 rounding noise of a rotating-only
camera up to unit steps. Because of the normalisation the key speeds (``controls.move``/``strafe``) set only the
mix of directions the DiT sees, never the magnitude; ``translation_scale`` multiplies the normalised steps (1: the
reference's whole-clip rule at constant speed; TeleFuser's interactive service uses 3).
"""

from __future__ import annotations

import numpy as np
import torch

from ipc.protocol import INTRINSICS_HEIGHT, INTRINSICS_WIDTH
from models.geometry import intrinsics_at  # noqa: F401  # torch-free (rank 0 answers with it), re-exported

REFERENCE_HEIGHT, REFERENCE_WIDTH = INTRINSICS_HEIGHT, INTRINSICS_WIDTH  # the intrinsics are given for this frame
MIN_TRANSLATION = 1e-4  # streaming rule: below this largest step a chunk counts as not translating
BLOCK = 8  # pixels per latent pixel


def scale_intrinsics(intrinsics: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``(fx, fy, cx, cy)`` of row 0 (given for 480x832) rescaled to ``height x width``, float32 ``[4]``."""
    row = intrinsics.reshape(-1, 4)[0].float()
    sx, sy = width / REFERENCE_WIDTH, height / REFERENCE_HEIGHT
    return row * torch.tensor([sx, sy, sx, sy], dtype=torch.float32)


def _matrix_to_quat(r: np.ndarray) -> np.ndarray:
    """Unit quaternion (w, x, y, z) of a rotation matrix (Shepperd's method)."""
    tr = np.trace(r)
    if tr > 0:
        s = 2.0 * np.sqrt(tr + 1.0)
        q = [0.25 * s, (r[2, 1] - r[1, 2]) / s, (r[0, 2] - r[2, 0]) / s, (r[1, 0] - r[0, 1]) / s]
    else:
        i = int(np.argmax(np.diag(r)))
        j, k = (i + 1) % 3, (i + 2) % 3
        s = 2.0 * np.sqrt(1.0 + r[i, i] - r[j, j] - r[k, k])
        q = [0.0, 0.0, 0.0, 0.0]
        q[0] = (r[k, j] - r[j, k]) / s
        q[1 + i] = 0.25 * s
        q[1 + j] = (r[j, i] + r[i, j]) / s
        q[1 + k] = (r[k, i] + r[i, k]) / s
    q = np.asarray(q, dtype=np.float64)
    return q / np.linalg.norm(q)


def _quat_to_matrix(q: np.ndarray) -> np.ndarray:
    w, x, y, z = q / np.linalg.norm(q)
    return np.array(
        [
            [1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
            [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
            [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)],
        ]
    )


def _slerp(q0: np.ndarray, q1: np.ndarray, a: float) -> np.ndarray:
    dot = float(np.clip(np.dot(q0, q1), -1.0, 1.0))
    if dot > 0.9995:  # nearly parallel: normalised lerp
        q = q0 + a * (q1 - q0)
        return q / np.linalg.norm(q)
    theta = np.arccos(dot)
    return (np.sin((1 - a) * theta) * q0 + np.sin(a * theta) * q1) / np.sin(theta)


def resample_poses(c2w: np.ndarray | torch.Tensor, num: int) -> torch.Tensor:
    """Poses ``[Fv, 4, 4]`` sampled at ``linspace(0, Fv-1, num)`` in float64 -> float32 ``[num, 4, 4]``."""
    poses = np.asarray(c2w, dtype=np.float64)
    fv = poses.shape[0]
    quats = [_matrix_to_quat(p[:3, :3]) for p in poses]
    for i in range(1, fv):  # sign continuity
        if np.dot(quats[i - 1], quats[i]) < 0:
            quats[i] = -quats[i]
    out = np.zeros((num, 4, 4), dtype=np.float64)
    for n, pos in enumerate(np.linspace(0.0, fv - 1, num)):
        lo = min(int(np.floor(pos)), fv - 1)
        a = pos - lo
        if a == 0.0:  # exactly on a video frame: the pose itself
            out[n] = poses[lo]
            continue
        hi = lo + 1
        out[n, :3, :3] = _quat_to_matrix(_slerp(quats[lo], quats[hi], a))
        out[n, :3, 3] = (1 - a) * poses[lo, :3, 3] + a * poses[hi, :3, 3]
        out[n, 3, 3] = 1.0
    return torch.from_numpy(out).float()


def rigid_inverse(p: torch.Tensor) -> torch.Tensor:
    """``[R|t]^-1 = [R^T | -R^T t]`` for ``[..., 4, 4]``."""
    r_t = p[..., :3, :3].transpose(-1, -2)
    out = torch.zeros_like(p)
    out[..., :3, :3] = r_t
    out[..., :3, 3] = -(r_t @ p[..., :3, 3:4])[..., 0]
    out[..., 3, 3] = 1
    return out


def relative_poses(c2ws: torch.Tensor) -> torch.Tensor:
    """Framewise relative poses ``[F, 4, 4]`` (float32): via ``rel_i = inv(P_0) P_i``, then ``inv(rel_{i-1}) rel_i``."""
    p = c2ws.float()
    eye = torch.eye(4, dtype=torch.float32)
    rel = rigid_inverse(p[0]) @ p
    rel[0] = eye
    out = rigid_inverse(rel[:-1]) @ rel[1:]
    return torch.cat([eye[None], out])


def normalize_translation(rel: torch.Tensor, min_norm: float = 0.0) -> torch.Tensor:
    """Divide every translation by the largest translation norm of ``rel`` when that exceeds ``min_norm``."""
    out = rel.clone()
    m = torch.linalg.vector_norm(rel[:, :3, 3], dim=-1).max()
    if m > min_norm:
        out[:, :3, 3] = rel[:, :3, 3] / m
    return out


def pixel_directions(intrinsics: torch.Tensor, height: int, width: int,
                     device: torch.device | str = "cpu") -> torch.Tensor:  # fmt: skip
    """Unit ray directions ``[H, W, 3]`` (float32, camera frame) through the pixel centres, on ``device``."""
    assert height % BLOCK == 0 and width % BLOCK == 0, f"frame {height}x{width} is not a multiple of {BLOCK}"
    fx, fy, cx, cy = (float(v) for v in intrinsics.float())
    v, u = torch.meshgrid(torch.arange(height, dtype=torch.float32, device=device),
                          torch.arange(width, dtype=torch.float32, device=device), indexing="ij")  # fmt: skip
    d = torch.stack([(u + 0.5 - cx) / fx, (v + 0.5 - cy) / fy, torch.ones_like(u)], dim=-1)  # [H, W, 3]
    return d / torch.linalg.vector_norm(d, dim=-1, keepdim=True)


def rays_from(rel: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
    """Control tensor ``[1, 384, F, H/8, W/8]`` from framewise poses ``[F, 4, 4]`` and ``pixel_directions``."""
    height, width, _ = directions.shape
    f = rel.shape[0]
    rel = rel.to(directions.device)
    rot, trans = rel[:, :3, :3].float(), rel[:, :3, 3].float()  # [F, 3, 3], [F, 3]
    direction = torch.einsum("fij,hwj->fhwi", rot, directions)  # [F, H, W, 3]
    origin = trans[:, None, None, :].expand(f, height, width, 3)
    ray = torch.cat([origin, direction], dim=-1)  # [F, H, W, 6]
    h, w = height // BLOCK, width // BLOCK
    folded = ray.reshape(f, h, BLOCK, w, BLOCK, 6).permute(5, 2, 4, 0, 1, 3)  # [6, r, s, F, h, w]
    return folded.reshape(1, 6 * BLOCK * BLOCK, f, h, w).contiguous()


def rays(rel: torch.Tensor, intrinsics: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Control tensor ``[1, 384, F, H/8, W/8]`` from framewise poses ``[F, 4, 4]`` and ``(fx, fy, cx, cy)``."""
    return rays_from(rel, pixel_directions(intrinsics, height, width))


def clip_control(
    c2w: np.ndarray | torch.Tensor, intrinsics: torch.Tensor, height: int, width: int, frames: int
) -> dict[str, torch.Tensor]:
    """The reference whole-clip computation; returns every intermediate by its fixture name."""
    k = scale_intrinsics(intrinsics, height, width)
    c2ws = resample_poses(c2w, frames)
    rel_raw = relative_poses(c2ws)
    rel = normalize_translation(rel_raw)
    return {
        "intrinsics_scaled": k,
        "c2ws_infer": c2ws,
        "relative_poses_unnormalized": rel_raw,
        "relative_poses": rel,
        "plucker_from_poses": rays(rel, k, height, width),
    }


def latent_frame_poses(video_poses: np.ndarray, first_chunk: bool, stride: int = 4) -> np.ndarray:
    """The video poses of a chunk that coincide with its latent frames (positions 0, 4, 8, ... of the stream).

    Chunk 0 has ``1 + 4(cs-1)`` video frames with latent frames at 0, 4, ...; a later chunk has ``4cs`` frames
    starting 3 frames after a latent position, so its latent frames sit at local indices 3, 7, ....
    """
    return video_poses[0::stride] if first_chunk else video_poses[stride - 1 :: stride]


class StreamingCamera:
    """Per-session camera state for the streaming rule (see the module docstring). The control tensor is built on
    ``device`` from the session's pixel directions (computed once): per chunk only the ``[cs, 4, 4]`` poses move
    to the device, not the ~28 MB control tensor of a 480x832 chunk."""

    def __init__(self, intrinsics: torch.Tensor, height: int, width: int, device: torch.device | str = "cpu",
                 translation_scale: float = 1.0) -> None:  # fmt: skip
        self.k = scale_intrinsics(intrinsics, height, width)
        self.height, self.width = height, width
        self.translation_scale = translation_scale  # applied after the per-chunk normalisation
        self.directions = pixel_directions(self.k, height, width, device)
        self.prev_latent_pose: torch.Tensor | None = None  # float64 [4, 4]
        self.last_video_pose = np.eye(4, dtype=np.float64)  # integration start of the next chunk

    def relative(self, video_poses: np.ndarray, first_chunk: bool) -> torch.Tensor:
        """Normalised framewise poses ``[cs, 4, 4]`` (float32) of a chunk, times ``translation_scale``, and advance
        the state. The framewise steps are taken in float64 from the float64 absolute poses, so they stay exact
        however far a long session has walked (float32 absolute positions would lose the step's digits)."""
        latent = torch.from_numpy(latent_frame_poses(np.asarray(video_poses, np.float64), first_chunk).copy())
        prev = latent[:1] if self.prev_latent_pose is None else self.prev_latent_pose[None]
        chain = torch.cat([prev, latent])  # [cs + 1, 4, 4] float64
        framewise = rigid_inverse(chain[:-1]) @ chain[1:]
        if self.prev_latent_pose is None:
            framewise[0] = torch.eye(4, dtype=torch.float64)
        self.prev_latent_pose = latent[-1].clone()
        self.last_video_pose = np.asarray(video_poses[-1], np.float64).copy()
        rel = normalize_translation(framewise.float(), MIN_TRANSLATION)
        rel[:, :3, 3] *= self.translation_scale
        return rel

    def control(self, video_poses: np.ndarray, first_chunk: bool) -> torch.Tensor:
        """Control tensor ``[1, 384, cs, h, w]`` (on the camera's device) of a chunk from its per-video-frame poses."""
        return rays_from(self.relative(video_poses, first_chunk), self.directions)
