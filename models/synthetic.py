"""The synthetic backend: the stage interface with configured costs and frames that follow the camera.

It never claims to run the model. Each stage sleeps for its configured cost (so scheduler benchmarks see
fixed stage times without burning the CPU) and computes something cheap but meaningful:

- condition: the start image as a float tensor ``[3, H, W]`` (the same every chunk);
- denoise: integrates the chunk's controls into camera poses (``models.controls``) and renders every video
  frame as the start image panned and zoomed by its pose, at half resolution, plus a little seeded noise so
  the seed matters; the "latent" is ``[4*cs, 3, H/2, W/2]`` (chunk 0 uses its last ``1 + 4(cs-1)`` frames);
- decode: upsamples to ``H x W`` and converts to uint8 ``[n, H, W, 3]``.

Yaw (J/L, mouse x) and strafe (A/D) pan the picture horizontally, pitch (I/K, mouse y) vertically, forward
and back (W/S) zoom in and out; the picture wraps around so the frame stays full.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from models.controls import ChunkControl, integrate
from models.stages import SessionSpec, StreamGeometry

# Scaled to the default key speeds (2 degrees, 0.05 units per frame), so a held key moves the picture by about
# half a pixel per frame at 160x256 and a few seconds of holding stay on screen.
PIXELS_PER_DEGREE = 0.009  # pan in normalised image units ([-1, 1] spans the frame) per degree of rotation
PAN_PER_UNIT = 0.96  # pan per scene unit of sideways translation
ZOOM_PER_UNIT = 0.8  # log-zoom per scene unit of forward translation
NOISE_LEVEL = 0.02


class InjectedFailure(RuntimeError):
    """A failure asked for by the session's prompt (``synthetic.fail_marker``), for tests of failure handling."""


def failure_chunk(prompt: str, marker: str, stage: str) -> int | None:
    """The chunk at which ``stage`` must fail for this prompt, or None."""
    if not marker:
        return None
    tag = f"{marker}:{stage}:"
    at = prompt.find(tag)
    if at < 0:
        return None
    digits = prompt[at + len(tag):].split()[0] if prompt[at + len(tag):].strip() else ""
    return int(digits) if digits.isdigit() else None


def synthetic_geometry(height: int, width: int, chunk_latent_frames: int) -> StreamGeometry:
    return StreamGeometry(
        height=height,
        width=width,
        chunk_latent_frames=chunk_latent_frames,
        context_shape=(1, 8),
        condition_shape=(3, height, width),
        latent_shape=(4 * chunk_latent_frames, 3, height // 2, width // 2),
    )


def _spend(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


class SyntheticCondition:
    def __init__(self, geometry: StreamGeometry, cost_s: float, fail_marker: str = "") -> None:
        self.geometry = geometry
        self.cost_s = cost_s
        self.fail_marker = fail_marker
        self._images: dict[str, torch.Tensor] = {}
        self._fail_at: dict[str, int | None] = {}

    def open(self, spec: SessionSpec) -> torch.Tensor:
        assert spec.image is not None and tuple(spec.image.shape) == (self.geometry.height, self.geometry.width, 3)
        self._images[spec.session] = spec.image.permute(2, 0, 1).float().div(255.0).contiguous()  # [3, H, W]
        self._fail_at[spec.session] = failure_chunk(spec.prompt, self.fail_marker, "encode")
        prompt_code = float(sum(spec.prompt.encode()) % 997)
        return torch.full(self.geometry.context_shape, prompt_code)

    def encode(self, session: str, index: int) -> torch.Tensor:
        started = time.monotonic()
        if self._fail_at.get(session) == index:
            raise InjectedFailure(f"injected encode failure at chunk {index}")
        image = self._images[session]
        _spend(self.cost_s - (time.monotonic() - started))
        return image

    def release(self, session: str) -> None:
        self._images.pop(session, None)
        self._fail_at.pop(session, None)


def view_parameters(pose: np.ndarray) -> tuple[float, float, float]:
    """(pan_x, pan_y, log_zoom) of a camera-to-world pose, in normalised image units."""
    forward = pose[:3, 2]
    yaw = math.degrees(math.atan2(forward[0], forward[2]))
    pitch = math.degrees(math.asin(max(-1.0, min(1.0, -forward[1]))))
    x, _, z = pose[:3, 3]
    return yaw * PIXELS_PER_DEGREE + x * PAN_PER_UNIT, -pitch * PIXELS_PER_DEGREE, z * ZOOM_PER_UNIT


def render(image: torch.Tensor, poses: np.ndarray, height: int, width: int) -> torch.Tensor:
    """Frames ``[n, 3, height, width]`` of ``image [3, H, W]`` seen from each pose."""
    thetas = []
    for pose in poses:
        pan_x, pan_y, log_zoom = view_parameters(pose)
        scale = math.exp(-log_zoom)
        thetas.append([[scale, 0.0, pan_x], [0.0, scale, pan_y]])
    theta = torch.tensor(thetas, dtype=torch.float32)
    grid = F.affine_grid(theta, [len(poses), 3, height, width], align_corners=False)
    grid = torch.remainder(grid + 1.0, 2.0) - 1.0  # wrap around: the picture tiles the plane
    source = image.unsqueeze(0).expand(len(poses), -1, -1, -1)
    return F.grid_sample(source, grid, mode="bilinear", padding_mode="border", align_corners=False)


@dataclass
class _DenoiseSession:
    pose: np.ndarray
    generator: torch.Generator
    chunks: int = 0
    fail_denoise_at: int | None = None
    fail_decode_at: int | None = None


class SyntheticDenoise:
    """Every DiT rank runs it in lockstep; a closing all-reduce over the group stands in for Ulysses traffic."""

    def __init__(self, geometry: StreamGeometry, cost_s: float, group: object | None = None,
                 fail_marker: str = "") -> None:
        self.geometry = geometry
        self.cost_s = cost_s
        self.fail_marker = fail_marker
        self.group = group
        self._sessions: dict[str, _DenoiseSession] = {}
        if group is None:
            self._leader = True
        else:
            import torch.distributed as dist

            self._leader = dist.get_rank(group) == 0

    def open(self, spec: SessionSpec, context: torch.Tensor) -> None:
        generator = torch.Generator().manual_seed(spec.seed)
        self._sessions[spec.session] = _DenoiseSession(
            pose=np.eye(4), generator=generator,
            fail_denoise_at=failure_chunk(spec.prompt, self.fail_marker, "denoise"),
            fail_decode_at=failure_chunk(spec.prompt, self.fail_marker, "decode"))

    def _advance(
        self, session: str, index: int, control: ChunkControl
    ) -> tuple[_DenoiseSession, np.ndarray, torch.Tensor]:
        state = self._sessions[session]
        assert index == state.chunks, f"chunk {index} out of order (expected {state.chunks})"
        n = self.geometry.frames_in_chunk(index)
        poses = integrate(state.pose, control, n, first_is_start=index == 0)
        noise = torch.randn(self.geometry.latent_shape, generator=state.generator)
        state.pose = poses[-1]
        state.chunks += 1
        return state, poses, noise

    def denoise(self, session: str, index: int, condition: torch.Tensor, control: ChunkControl) -> torch.Tensor:
        """The rendered chunk on the group's first rank (the leader, whose latent is used); the other ranks keep
        the same camera and noise state and return zeros, without spending the CPU on a render."""
        started = time.monotonic()
        state, poses, noise = self._advance(session, index, control)
        if state.fail_denoise_at == index:
            raise InjectedFailure(f"injected denoise failure at chunk {index}")
        total, _, h, w = self.geometry.latent_shape
        latent = torch.zeros(self.geometry.latent_shape)
        if self._leader:
            frames = render(condition.float().cpu(), poses, h, w)
            first = total - len(poses)
            latent[first:] = (frames + NOISE_LEVEL * noise[first:]).clamp(0, 1)
        if state.fail_decode_at == index:
            latent.fill_(float("nan"))  # the decoder refuses it: a failure that travels down the pipeline
        _spend(self.cost_s - (time.monotonic() - started))
        if self.group is not None:  # end together, as a real sequence-parallel step does
            import torch.distributed as dist

            dist.all_reduce(torch.zeros(1), group=self.group)
        return latent

    def skip(self, session: str, index: int, control: ChunkControl, latent: torch.Tensor | None = None,
             condition: torch.Tensor | None = None) -> None:
        self._advance(session, index, control)

    def release(self, session: str) -> None:
        self._sessions.pop(session, None)


class SyntheticDecode:
    def __init__(self, geometry: StreamGeometry, cost_s: float) -> None:
        self.geometry = geometry
        self.cost_s = cost_s
        self._open: set[str] = set()

    def open(self, session: str) -> None:
        self._open.add(session)

    def decode(self, session: str, index: int, latent: torch.Tensor) -> torch.Tensor:
        assert session in self._open, f"decode cache of session {session!r} is not initialised"
        if not torch.isfinite(latent).all():
            raise ValueError(f"latent of chunk {index} is not finite")
        started = time.monotonic()
        n = self.geometry.frames_in_chunk(index)
        frames = latent[-n:].float()
        full = F.interpolate(
            frames, size=(self.geometry.height, self.geometry.width), mode="bilinear", align_corners=False
        )
        out = full.mul(255.0).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()
        _spend(self.cost_s - (time.monotonic() - started))
        return out

    def release(self, session: str) -> None:
        self._open.discard(session)
