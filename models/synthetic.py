"""The synthetic backend: the stage interface with configured costs and frames that follow the camera.

It never claims to run the model. Each stage sleeps for its configured cost (so scheduler benchmarks see
fixed stage times without burning the CPU) and computes something cheap but meaningful:

- condition: the start image, resized to the session's frame size (PIL bicubic on uint8, as rank 0 did before
  the stages took the image at its own size), as a float tensor ``[3, H, W]`` (the same every chunk);
- denoise: integrates the chunk's controls into camera poses (``models.controls``) and renders every video
  frame as the start image panned and zoomed by its pose, at half resolution, plus a little seeded noise so
  the seed matters; the "latent" is ``[4*cs, 3, H/2, W/2]`` (chunk 0 uses its last ``1 + 4(cs-1)`` frames);
- decode: upsamples to ``H x W`` and converts to uint8 ``[n, H, W, 3]``.

Each stage may also pay ``cold_s`` extra on its first chunk at a frame size it has not run at, as a GPU pays for cuDNN
autotuning and module loads on a shape's first use (per thread, as cuDNN's autotune cache): what the start-up
warm-up (``ranks.warmup``) must absorb, in the thread that serves the stage.

Yaw (J/L, mouse x) and strafe (A/D) pan the picture horizontally, pitch (I/K, mouse y) vertically, forward
and back (W/S) zoom in and out; the picture wraps around so the frame stays full.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from ipc.protocol import QUALITY_STEPS
from models.controls import ChunkControl, MotionSpeeds, integrate
from models.stages import SessionSpec, StreamGeometry, agree_prepared

# Scaled to the default key speeds (2 degrees, 0.05 units per frame), so a held key moves the picture by about
# half a pixel per frame at 160x256 and a few seconds of holding stay on screen.
PIXELS_PER_DEGREE = 0.009  # pan in normalised image units ([-1, 1] spans the frame) per degree of rotation
PAN_PER_UNIT = 0.96  # pan per scene unit of sideways translation
ZOOM_PER_UNIT = 0.8  # log-zoom per scene unit of forward translation
MAX_LOG_ZOOM = 2.5  # the zoom stops at e^2.5 (12x) in or out
NOISE_LEVEL = 0.02


def synthetic_geometry(height: int, width: int, chunk_latent_frames: int) -> StreamGeometry:
    return StreamGeometry(
        height=height,
        width=width,
        chunk_latent_frames=chunk_latent_frames,
        context_shape=(1, 8),
        condition_shape=(3, height, width),
        latent_shape=(4 * chunk_latent_frames, 3, height // 2, width // 2),
    )


def pass_cost(cost_4_steps: float, steps: int | None) -> float:
    """A denoise's cost at ``steps`` denoising steps when ``cost_4_steps`` is that of the full 4: in proportion
    to the DiT's passes (each step one pass, plus the t = 0 refresh pass), so 2 steps cost 3/5 and 1 step 2/5."""
    if steps is None:
        return cost_4_steps
    if steps not in QUALITY_STEPS:
        raise ValueError(f"{steps} denoising steps is not a quality preset ({', '.join(map(str, QUALITY_STEPS))})")
    return cost_4_steps * (steps + 1) / (max(QUALITY_STEPS) + 1)


def _spend(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


class FirstUse:
    """The extra cost of a stage's first chunk at each frame size (a GPU's first use of a shape), per thread: PyTorch
    keeps cuDNN's autotune results per thread, so a size warmed by another thread is cold in this one."""

    def __init__(self, cost_s: float) -> None:
        self.cost_s = cost_s
        self.seen: set[tuple[int, int, int]] = set()  # (thread, height, width)

    def cost(self, height: int, width: int) -> float:
        key = (threading.get_ident(), height, width)
        if key in self.seen:
            return 0.0
        self.seen.add(key)
        return self.cost_s


class SyntheticCondition:
    def __init__(self, geometry: StreamGeometry, cost_s: float, cold_s: float = 0.0) -> None:
        self.geometry = geometry
        self.cost_s = cost_s
        self.first_use = FirstUse(cold_s)
        self._images: dict[str, torch.Tensor] = {}
        self._contexts: dict[str, torch.Tensor] = {}

    def open(self, spec: SessionSpec) -> torch.Tensor:
        assert spec.image is not None and spec.image.dtype == torch.uint8 and spec.image.shape[-1] == 3
        height, width = (spec.height, spec.width) if spec.height else (self.geometry.height, self.geometry.width)
        image = resize_uint8(spec.image, height, width)
        self._images[spec.session] = image.permute(2, 0, 1).float().div(255.0).contiguous()  # [3, H, W]
        self._contexts[spec.session] = self.context(spec.prompt)
        return self._contexts[spec.session]

    def context(self, prompt: str) -> torch.Tensor:
        return torch.full(self.geometry.context_shape, float(sum(prompt.encode()) % 997))

    def state_dict(self, session: str) -> dict[str, torch.Tensor]:
        """Everything the session's next conditions depend on (the resized start image) and its prompt context."""
        return {"image": self._images[session], "context": self._contexts[session]}

    def load_state(self, spec: SessionSpec, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Open ``spec.session`` from ``state_dict``'s output; returns the prompt context, as ``open`` does."""
        image, context = state["image"].float().contiguous(), state["context"].float().contiguous()
        height, width = (spec.height, spec.width) if spec.height else (self.geometry.height, self.geometry.width)
        if tuple(image.shape) != (3, height, width) or tuple(context.shape) != tuple(self.geometry.context_shape):
            raise ValueError(f"condition state of shapes {tuple(image.shape)}, {tuple(context.shape)} does not fit a "
                             f"{width}x{height} session")
        self._images[spec.session], self._contexts[spec.session] = image, context
        return context

    def encode(self, session: str, index: int) -> torch.Tensor:
        started = time.monotonic()
        image = self._images[session]
        _spend(self.cost_s + self.first_use.cost(*image.shape[1:]) - (time.monotonic() - started))
        return image

    def release(self, session: str) -> None:
        self._images.pop(session, None)
        self._contexts.pop(session, None)


def resize_uint8(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 ``[H0, W0, 3]`` -> uint8 ``[height, width, 3]``, PIL bicubic (unchanged when the size matches)."""
    if tuple(image.shape[:2]) == (height, width):
        return image
    resized = Image.fromarray(image.numpy()).resize((width, height), Image.Resampling.BICUBIC)
    return torch.from_numpy(np.asarray(resized, dtype=np.uint8).copy())


def view_parameters(pose: np.ndarray) -> tuple[float, float, float]:
    """(pan_x, pan_y, log_zoom) of a camera-to-world pose, in normalised image units, bounded however far the camera
    went: the picture tiles the plane, so a pan is taken modulo the tile (2), and the zoom stops at ``MAX_LOG_ZOOM``
    (an hour of W, or a pose a million units away, renders like any other frame)."""
    forward = pose[:3, 2]
    yaw = math.degrees(math.atan2(forward[0], forward[2]))
    pitch = math.degrees(math.asin(max(-1.0, min(1.0, -forward[1]))))
    x, _, z = pose[:3, 3]
    pan_x = math.fmod(yaw * PIXELS_PER_DEGREE + x * PAN_PER_UNIT, 2.0)
    log_zoom = max(-MAX_LOG_ZOOM, min(MAX_LOG_ZOOM, z * ZOOM_PER_UNIT))
    return pan_x, -pitch * PIXELS_PER_DEGREE, log_zoom


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
    geometry: StreamGeometry  # the backend's geometry at the session's frame size
    pose: np.ndarray
    generator: torch.Generator
    chunks: int = 0


class SyntheticDenoise:
    """Every DiT rank runs it in lockstep; a closing all-reduce over the group stands in for Ulysses traffic."""

    def __init__(self, geometry: StreamGeometry, cost_s: float, group: object | None = None,
                 speeds: MotionSpeeds | None = None, cold_s: float = 0.0) -> None:  # fmt: skip
        self.geometry = geometry
        self.cost_s = cost_s
        self.first_use = FirstUse(cold_s)
        self.group = group
        self.speeds = speeds or MotionSpeeds()
        self._sessions: dict[str, _DenoiseSession] = {}
        if group is None:
            self._leader = True
        else:
            import torch.distributed as dist

            self._leader = dist.get_rank(group) == 0

    def open(self, spec: SessionSpec, context: torch.Tensor) -> None:
        geometry = self.geometry.with_size(spec.height, spec.width) if spec.height else self.geometry
        generator = torch.Generator().manual_seed(spec.seed)
        self._sessions[spec.session] = _DenoiseSession(geometry=geometry, pose=np.eye(4), generator=generator)

    def set_context(self, session: str, context: torch.Tensor) -> None:
        """A new prompt: the synthetic frames do not depend on the text (the chunk's facts carry its revision)."""
        if session not in self._sessions:
            raise KeyError(f"unknown session {session!r}")

    def state_dict(self, session: str) -> dict[str, torch.Tensor]:
        """The camera pose, the noise generator's state and the next chunk: all its later chunks depend on."""
        state = self._sessions[session]
        return {"pose": torch.from_numpy(state.pose.copy()), "generator": state.generator.get_state(),
                "chunks": torch.tensor([state.chunks], dtype=torch.int64)}

    def load_state(self, spec: SessionSpec, context: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Open ``spec.session`` from ``state_dict``'s output (``context``: the prompt's, as for ``open``)."""
        self.open(spec, context)
        session = self._sessions[spec.session]
        pose = state["pose"].to(torch.float64).numpy().copy()
        if pose.shape != (4, 4):
            raise ValueError(f"denoise state: a pose of shape {pose.shape}, not 4x4")
        session.pose, session.chunks = pose, int(state["chunks"][0])
        session.generator.set_state(state["generator"].to(torch.uint8).contiguous())

    def _advance(
        self, session: str, index: int, control: ChunkControl
    ) -> tuple[_DenoiseSession, np.ndarray, torch.Tensor]:
        state = self._sessions[session]
        assert index == state.chunks, f"chunk {index} out of order (expected {state.chunks})"
        n = state.geometry.frames_in_chunk(index)
        poses = integrate(state.pose, control, n, self.speeds, first_is_start=index == 0)
        noise = torch.randn(state.geometry.latent_shape, generator=state.generator)
        state.pose = poses[-1]
        state.chunks += 1
        return state, poses, noise

    def denoise(self, session: str, index: int, condition: torch.Tensor, control: ChunkControl,
                steps: int | None = None) -> torch.Tensor:  # fmt: skip
        """The rendered chunk on the group's first rank (the leader, whose latent is used); the other ranks keep
        the same camera and noise state and return zeros, without spending the CPU on a render. The group agrees
        that every rank prepared its part before it ends together (as the real stage does before its passes).
        ``steps`` (4, 2, 1; None: 4) scales the cost as the DiT's passes do (``pass_cost``)."""
        started = time.monotonic()
        error: Exception | None = None
        latent: torch.Tensor | None = None
        try:
            geometry = self._sessions[session].geometry
            cost = pass_cost(self.cost_s, steps) + self.first_use.cost(geometry.height, geometry.width)
            latent = self._render(session, index, condition, control)
        except Exception as e:
            error, cost = e, 0.0
        _spend(cost - (time.monotonic() - started))
        agree_prepared(self.group, "cpu", error)  # also the step's end together, as a sequence-parallel step
        assert latent is not None  # every rank prepared its part, or agree_prepared raised
        return latent

    def _render(self, session: str, index: int, condition: torch.Tensor, control: ChunkControl) -> torch.Tensor:
        state, poses, noise = self._advance(session, index, control)
        total, _, h, w = state.geometry.latent_shape
        latent = torch.zeros(state.geometry.latent_shape)
        if self._leader:
            frames = render(condition.float().cpu(), poses, h, w)
            first = total - len(poses)
            latent[first:] = (frames + NOISE_LEVEL * noise[first:]).clamp(0, 1)
        return latent

    def release(self, session: str) -> None:
        self._sessions.pop(session, None)


class SyntheticDecode:
    def __init__(self, geometry: StreamGeometry, cost_s: float, cold_s: float = 0.0) -> None:
        self.geometry = geometry
        self.cost_s = cost_s
        self.first_use = FirstUse(cold_s)
        self._open: dict[str, StreamGeometry] = {}  # session -> its geometry

    def open(self, spec: SessionSpec) -> None:
        self._open[spec.session] = self.geometry.with_size(spec.height, spec.width) if spec.height else self.geometry

    def state_dict(self, session: str) -> dict[str, torch.Tensor]:
        """Its decoder holds no state between chunks: only the frame size, checked on load."""
        g = self._open[session]
        return {"size": torch.tensor([g.height, g.width], dtype=torch.int64)}

    def load_state(self, spec: SessionSpec, state: dict[str, torch.Tensor]) -> None:
        self.open(spec)
        g = self._open[spec.session]
        if state["size"].tolist() != [g.height, g.width]:
            self._open.pop(spec.session)
            raise ValueError(f"decode state of a {state['size'].tolist()} session, not {[g.height, g.width]}")

    def decode(self, session: str, index: int, latent: torch.Tensor) -> torch.Tensor:
        geometry = self._open.get(session)
        assert geometry is not None, f"decode cache of session {session!r} is not initialised"
        if not torch.isfinite(latent).all():
            raise ValueError(f"latent of chunk {index} is not finite")
        started = time.monotonic()
        n = geometry.frames_in_chunk(index)
        frames = latent[-n:].float()
        full = F.interpolate(frames, size=(geometry.height, geometry.width), mode="bilinear", align_corners=False)
        out = full.mul(255.0).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()
        _spend(self.cost_s + self.first_use.cost(geometry.height, geometry.width) - (time.monotonic() - started))
        return out

    def release(self, session: str) -> None:
        self._open.pop(session, None)
