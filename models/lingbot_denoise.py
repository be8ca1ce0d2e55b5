"""The real-model ``DenoiseStage``: the causal-fast denoise loop of LingBot-World-Fast for one chunk.

Per chunk ``k`` (``cs`` latent frames starting at latent frame ``k*cs``):

```
x = noise_init_k
for s, step in enumerate(steps):
    v  = DiT(x, step.timestep, y_k, control_k)                # velocity
    x0 = float32(float64(x) - float64(step.sigma_x0) * float64(v))
    if s < n-1: x = (1 - steps[s+1].sigma_renoise) * x0 + steps[s+1].sigma_renoise * noise_{k,s+1}
DiT(x0, 0.0, y_k, control_k)                                  # refresh: rewrites chunk k's K/V at t = 0
```

Noise source of a session: one ``torch.Generator`` (CPU) seeded with ``spec.seed``. Per chunk, in order, it
draws ``randn(16, cs, h, w)`` for the chunk's initial noise, then one ``randn(16, cs, h, w)`` per re-noise
step ``s = 1..n-1``. (The reference draws the initial noise of the *whole clip* first, ``randn(16, F, h, w)``,
which a stream of unknown length cannot do, so the streams differ in which numbers land where but not in
distribution; the fixtures store every noise tensor, and tests inject them through ``NoiseSource``.)
A world-cache hit (``skip``) draws exactly the same numbers and advances the camera state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from models.camera import StreamingCamera
from models.controls import ChunkControl, MotionSpeeds, integrate
from models.dit import ChunkCamera, DiTConfig, WanModelFast, apply_sequence_parallel
from models.dit_checkpoint import load_dit, load_state_dict_strict
from models.kv_cache import KVCache, TextCache, new_kv_caches
from models.schedule import FlowMatchSchedule, Step, renoise, x0_from_velocity
from models.stages import SessionSpec, StreamGeometry

# (fx, fy, cx, cy) for a 480x832 frame, used when the session gives none (about 77 degrees horizontal FOV).
DEFAULT_INTRINSICS = (520.0, 520.0, 416.0, 240.0)
Trace = Callable[[str, torch.Tensor], None]


class NoiseSource:
    """Seeded per-session Gaussian noise in the documented draw order (see the module docstring)."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator(device="cpu").manual_seed(seed)

    def draw(self, shape: tuple[int, ...], kind: str, chunk: int, step: int) -> torch.Tensor:
        """Noise for ``kind`` ``"init"`` (step 0) or ``"renoise"`` (step >= 1) of ``chunk``."""
        return torch.randn(shape, generator=self.generator, dtype=torch.float32)


def denoise_chunk(
    model: WanModelFast,
    steps: list[Step],
    noise: NoiseSource,
    chunk: int,
    y: torch.Tensor,
    cam: ChunkCamera,
    text: TextCache,
    caches: list[KVCache],
    trace: Trace | None = None,
) -> torch.Tensor:
    """Clean latent ``[16, cs, h, w]`` of chunk ``chunk``; updates ``caches`` (refresh pass included)."""
    _, cs, h, w = y.shape
    shape = (model.cfg.out_dim, cs, h, w)
    start = chunk * cs
    x = noise.draw(shape, "init", chunk, 0).to(y.device)  # the sampler state stays float32
    x0 = x
    for s, step in enumerate(steps):
        if s > 0:
            x = renoise(x0, noise.draw(shape, "renoise", chunk, s).to(y.device), step.sigma_renoise)
        v = model(x, y, float(step.timestep), start, text, cam, caches).float()
        x0 = x0_from_velocity(x, v, step.sigma_x0)
        if trace is not None:
            trace(f"dit_xt_c{chunk}_s{s}", x.cpu())
            trace(f"dit_v_c{chunk}_s{s}", v.cpu())
            trace(f"x0pred_c{chunk}_s{s}", x0.cpu())
    v_refresh = model(x0, y, 0.0, start, text, cam, caches)
    if trace is not None:
        trace(f"x0_c{chunk}", x0.cpu())
        trace(f"dit_v_refresh_c{chunk}", v_refresh.float().cpu())
    return x0


@dataclass
class _Session:
    noise: NoiseSource
    text: TextCache
    caches: list[KVCache]
    camera: StreamingCamera
    next_index: int = 0


class LingbotDenoiseStage:
    """``DenoiseStage`` of LingBot-World-Fast; every rank of the DiT group runs it in lockstep."""

    def __init__(
        self,
        args: DiTConfig,
        geometry: StreamGeometry,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        group: dist.ProcessGroup | None = None,
        weights: dict[str, torch.Tensor] | str | Path | None = None,
        intrinsics: tuple[float, float, float, float] = DEFAULT_INTRINSICS,
        speeds: MotionSpeeds | None = None,
        init_seed: int = 0,
    ) -> None:
        """``weights``: a state dict, a checkpoint directory (its config.json wins over ``args`` for sizes) or
        ``None`` for a seeded random init (``init_seed``, identical on every rank)."""
        assert geometry.chunk_latent_frames == args.chunk_size, "geometry and DiT disagree on the chunk size"
        self.geometry, self.device, self.dtype = geometry, torch.device(device), dtype
        self.intrinsics = torch.tensor(intrinsics, dtype=torch.float32)
        self.speeds = speeds or MotionSpeeds()
        if isinstance(weights, (str, Path)):
            self.model = load_dit(weights, device, dtype, chunk_size=args.chunk_size, attention=args.attention)
        else:
            if weights is None:
                with torch.random.fork_rng(devices=[]):  # same weights on every rank, global RNG untouched
                    torch.manual_seed(init_seed)
                    self.model = WanModelFast(args)
            else:
                with torch.device("meta"):
                    self.model = WanModelFast(args)
                load_state_dict_strict(self.model, weights, None, device, dtype)
            self.model = self.model.to(device=device, dtype=dtype).eval()
        self.cfg = self.model.cfg
        apply_sequence_parallel(self.model, group)
        self.steps = FlowMatchSchedule.build(self.cfg.shift, self.cfg.num_train_timesteps).steps(
            self.cfg.timestep_indices
        )
        self.sessions: dict[str, _Session] = {}

    @torch.no_grad()
    def open(self, spec: SessionSpec, context: torch.Tensor) -> None:
        """Text cache from ``context [text_len, text_dim]``, empty KV caches, seeded noise, identity camera."""
        if spec.session in self.sessions:
            raise ValueError(f"session {spec.session!r} is already open")
        _, _, h, w = self.geometry.latent_shape
        heads = self.model.sp.local_heads(self.cfg.num_heads)
        caches = new_kv_caches(
            self.cfg.num_layers, self.cfg.local_attn_size, self.cfg.sink_size, (h // 2) * (w // 2), heads,
            self.cfg.head_dim, self.device, self.dtype,
        )  # fmt: skip
        self.sessions[spec.session] = _Session(
            noise=NoiseSource(spec.seed),
            text=self.model.text_cache(context.to(self.device)),
            caches=caches,
            camera=StreamingCamera(self.intrinsics, self.geometry.height, self.geometry.width),
        )

    def _advance(self, session: str, index: int, control: ChunkControl) -> tuple[_Session, torch.Tensor]:
        if session not in self.sessions:
            raise KeyError(f"unknown session {session!r}")
        st = self.sessions[session]
        if index != st.next_index:
            raise ValueError(f"session {session!r} expects chunk {st.next_index}, got {index}")
        first = index == 0
        poses = integrate(
            st.camera.last_video_pose, control, self.geometry.frames_in_chunk(index), self.speeds, first_is_start=first
        )
        ctrl = st.camera.control(np.asarray(poses), first)  # [1, 384, cs, h, w]
        st.next_index += 1
        return st, ctrl

    @torch.no_grad()
    def denoise(self, session: str, index: int, condition: torch.Tensor, control: ChunkControl) -> torch.Tensor:
        """Clean latent ``[16, cs, h, w]`` (float32, on the stage's device) of chunk ``index``; same on every rank."""
        assert tuple(condition.shape) == tuple(self.geometry.condition_shape), f"condition {tuple(condition.shape)}"
        st, ctrl = self._advance(session, index, control)
        cam = self.model.camera_modulation(ctrl.to(self.device))
        y = condition.to(device=self.device, dtype=self.dtype)
        return denoise_chunk(self.model, self.steps, st.noise, index, y, cam, st.text, st.caches)

    @torch.no_grad()
    def skip(
        self,
        session: str,
        index: int,
        control: ChunkControl,
        latent: torch.Tensor | None = None,
        condition: torch.Tensor | None = None,
    ) -> None:
        """World-cache hit: draw the chunk's noise and advance the camera exactly as ``denoise`` does.

        With the cached ``latent`` and its ``condition`` the t = 0 refresh pass is run, so the KV cache ends
        exactly as after ``denoise``. Without them (the bare protocol) the chunk leaves no keys in the cache:
        later chunks keep their absolute positions but do not see this chunk.
        """
        st, ctrl = self._advance(session, index, control)
        _, cs, h, w = self.geometry.latent_shape
        shape = (self.cfg.out_dim, cs, h, w)
        for s in range(len(self.steps)):
            st.noise.draw(shape, "init" if s == 0 else "renoise", index, s)
        if latent is not None and condition is not None:
            cam = self.model.camera_modulation(ctrl.to(self.device))
            y = condition.to(device=self.device, dtype=self.dtype)
            x0 = latent.to(device=self.device, dtype=self.dtype)
            self.model(x0, y, 0.0, index * cs, st.text, cam, st.caches)

    def release(self, session: str) -> None:
        self.sessions.pop(session, None)
