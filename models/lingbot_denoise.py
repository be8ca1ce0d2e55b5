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

Noise source of a session: one ``torch.Generator`` on the stage's device seeded with ``spec.seed`` (noise is drawn
where it is used: no host copy per step; the same seed gives the same numbers on the same kind of device). Per
chunk, in order, it draws ``randn(16, cs, h, w)`` for the chunk's initial noise, then one ``randn(16, cs, h, w)``
per re-noise step ``s = 1..n-1`` (``n``: the steps the chunk runs, 4, 2 or 1, ``models.schedule.step_subset``).
(The reference draws the initial noise of the *whole clip* first,
``randn(16, F, h, w)``, which a stream of unknown length cannot do, so the streams differ in which numbers land
where but not in distribution; the fixtures store every noise tensor, and tests inject them through
``NoiseSource``.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from models.attention import AttentionShapes, Timing, pin_sdpa_backend, resolve_attention, select_attention
from models.camera import StreamingCamera
from models.compiled import compile_dit
from models.controls import OFFICIAL_INTRINSICS, ChunkControl, MotionSpeeds, integrate
from models.dit import ChunkCamera, WanModelFast, apply_sequence_parallel
from models.dit_checkpoint import load_dit, load_state_dict_strict, random_dit
from models.dit_config import ARCH_FIELDS, DiTConfig
from models.kv_cache import KVCache, TextCache, kv_cache_bytes, new_kv_cache
from models.memory import dit_working_bytes, ensure_headroom
from models.schedule import FlowMatchSchedule, Step, renoise, step_subset, x0_from_velocity
from models.stages import SessionSpec, StreamGeometry, agree_prepared
from models.ulysses import Ulysses

log = logging.getLogger(__name__)

Trace = Callable[[str, torch.Tensor], None]


class NoiseSource:
    """Seeded per-session Gaussian noise in the documented draw order (see the module docstring)."""

    def __init__(self, seed: int, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def draw(self, shape: tuple[int, ...], kind: str, chunk: int, step: int) -> torch.Tensor:
        """Noise for ``kind`` ``"init"`` (step 0) or ``"renoise"`` (step >= 1) of ``chunk``, on the source's device."""
        return torch.randn(shape, generator=self.generator, dtype=torch.float32, device=self.device)


def denoise_chunk(
    model: WanModelFast,
    steps: list[Step],
    noise: NoiseSource,
    chunk: int,
    y: torch.Tensor,
    cam: ChunkCamera,
    text: TextCache,
    cache: KVCache,
    trace: Trace | None = None,
) -> torch.Tensor:
    """Clean latent ``[16, cs, h, w]`` of chunk ``chunk``; updates ``cache`` (refresh pass included). Everything it
    touches is already on the device (noise, RoPE and the KV slots are made there): no host copy or sync inside
    unless ``trace`` asks for the intermediate tensors."""
    _, cs, h, w = y.shape
    shape = (model.cfg.out_dim, cs, h, w)
    start = chunk * cs
    x = noise.draw(shape, "init", chunk, 0).to(y.device)  # the sampler state stays float32
    x0 = x
    for s, step in enumerate(steps):
        if s > 0:
            x = renoise(x0, noise.draw(shape, "renoise", chunk, s).to(y.device), step.sigma_renoise)
        v = model(x, y, float(step.timestep), start, text, cam, cache)
        x0 = x0_from_velocity(x, v, step.sigma_x0)
        if trace is not None:
            trace(f"dit_xt_c{chunk}_s{s}", x.cpu())
            trace(f"dit_v_c{chunk}_s{s}", v.cpu())
            trace(f"x0pred_c{chunk}_s{s}", x0.cpu())
    v_refresh = model(x0, y, 0.0, start, text, cam, cache)
    if trace is not None:
        trace(f"x0_c{chunk}", x0.cpu())
        trace(f"dit_v_refresh_c{chunk}", v_refresh.float().cpu())
    return x0


@dataclass
class _Session:
    geometry: StreamGeometry  # the session's own frame size
    noise: NoiseSource
    text: TextCache
    cache: KVCache
    camera: StreamingCamera
    next_index: int = 0
    working: int = 0  # bytes a chunk's passes need free on a CUDA device (models.memory), checked before each


class LingbotDenoiseStage:
    """``DenoiseStage`` of LingBot-World-Fast; every rank of the DiT group runs it in lockstep."""

    def __init__(
        self,
        args: DiTConfig,
        geometry: StreamGeometry,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        group: dist.ProcessGroup | Ulysses | None = None,
        weights: WanModelFast | dict[str, torch.Tensor] | str | Path | None = None,
        intrinsics: tuple[float, float, float, float] = OFFICIAL_INTRINSICS,
        speeds: MotionSpeeds | None = None,
        init_seed: int = 0,
        translation_scale: float = 1.0,
        compile_backend: str | Callable[..., Any] = "inductor",
    ) -> None:
        """``args``: the DiT's sizes and streaming settings. ``weights``: a state dict, a checkpoint directory (its
        config.json gives the architecture, ``args`` the streaming settings), a built model of the same architecture
        (shared, e.g. by benchmarks running v1 and v2 recipes on one set of weights) or ``None`` for seeded random
        weights (``init_seed``, identical on every rank of a device kind). ``intrinsics``: the camera of sessions that
        bring none, ``(fx, fy, cx, cy)`` in pixels of a 480x832 frame, scaled to each session's frame size.
        ``args.compile`` compiles the DiT (``models.compiled``; what cannot run here is said once and runs eagerly);
        ``compile_backend`` is a seam."""
        assert geometry.chunk_latent_frames == args.chunk_size, "geometry and DiT disagree on the chunk size"
        self.geometry, self.device, self.dtype = geometry, torch.device(device), dtype
        self.intrinsics = torch.tensor(intrinsics, dtype=torch.float32)
        self.speeds = speeds or MotionSpeeds()
        self.translation_scale = translation_scale
        if isinstance(weights, WanModelFast):
            self.model = weights
        elif isinstance(weights, (str, Path)):
            self.model = load_dit(weights, args, device, dtype)
        elif weights is None:
            self.model = random_dit(args, device, dtype, init_seed)
        else:
            with torch.device("meta"):
                self.model = WanModelFast(args)
            load_state_dict_strict(self.model, weights, None, device, dtype)
        self.model.eval()
        self.cfg = replace(args, **{f: getattr(self.model.cfg, f) for f in ARCH_FIELDS})  # streaming: from args
        apply_sequence_parallel(self.model, group)
        self.model.set_qkv_exchange(args.fused_qkv, args.overlap_all_to_all)
        self.steps = FlowMatchSchedule.build(self.cfg.shift, self.cfg.num_train_timesteps).steps(
            self.cfg.timestep_indices
        )
        self.sessions: dict[str, _Session] = {}
        self.attention, self.sdpa_backend, self.attention_table = self._choose_attention()
        self.compile = compile_dit(self.model, self.cfg.compile, self.device, compile_backend)  # the mode it runs
        cfg = self.cfg
        log.info("DiT %d layers x %d heads (dim %d), %s on %s: chunks of %d latent frames, timesteps %s, KV window %d "
                 "latent frames %s, attention %s (SDPA kernel %s), compile %s", cfg.num_layers, cfg.num_heads, cfg.dim,
                 dtype, self.device, cfg.chunk_size, [s.timestep for s in self.steps], cfg.kv_window,
                 f"({cfg.kv_policy}, {cfg.kv_sink} sink)", self.attention,
                 self.sdpa_backend if self.sdpa_backend != "sdpa" else "in PyTorch's order", self.compile)  # fmt: skip

    def attention_shapes(self) -> AttentionShapes:
        """The attention calls of one steady chunk on this rank at the configured frame size."""
        _, cs, h, w = self.geometry.latent_shape
        tokens = cs * (h // 2) * (w // 2)
        sp = self.model.sp
        return AttentionShapes(heads=sp.local_heads(self.cfg.num_heads), tokens=tokens,
                               window=self.cfg.kv_window * (h // 2) * (w // 2), head_dim=self.cfg.head_dim,
                               cross_heads=self.cfg.num_heads, local_tokens=sp.padded(tokens) // sp.size,
                               text_len=self.cfg.text_len)  # fmt: skip

    def _choose_attention(self) -> tuple[str, str, dict[str, Timing]]:
        """Resolve ``model.attention`` at this stage's steady shapes (``auto`` on CUDA: timed) and pin the SDPA kernel
        for the process, once, here. In a DiT group the first rank's choice is everyone's (timing noise must not
        split a group between kernels)."""
        attend, backend, table = resolve_attention(self.cfg.attention, self.attention_shapes(), self.device,
                                                   self.dtype)  # fmt: skip
        group = self.model.sp.group
        if table and group is not None and self.model.sp.size > 1:
            choice = [attend, backend]
            dist.broadcast_object_list(choice, src=dist.get_global_rank(group, 0), group=group)
            attend, backend = choice
        pin_sdpa_backend(backend)
        self.model.set_attention(select_attention(attend))
        return attend, backend, table

    def kv_cache_bytes(self, height: int, width: int) -> int:
        """Bytes of one session's KV cache on this rank at a ``height x width`` frame size."""
        return kv_cache_bytes(self.cfg.num_layers, self.cfg.kv_window, (height // 16) * (width // 16),
                              self.model.sp.local_heads(self.cfg.num_heads), self.cfg.head_dim, self.dtype)

    @torch.no_grad()
    def open(self, spec: SessionSpec, context: torch.Tensor) -> None:
        """Text cache from ``context [text_len, text_dim]``, an empty KV cache, seeded noise, identity camera with
        the session's intrinsics (``spec.intrinsics``; None: the stage's), all at the session's frame size
        (``spec.height x spec.width``; 0: the configured geometry)."""
        if spec.session in self.sessions:
            raise ValueError(f"session {spec.session!r} is already open")
        intrinsics = self.intrinsics if spec.intrinsics is None else torch.tensor(spec.intrinsics, dtype=torch.float32)
        geometry = self.geometry.with_size(spec.height, spec.width) if spec.height else self.geometry
        _, _, h, w = geometry.latent_shape
        heads = self.model.sp.local_heads(self.cfg.num_heads)
        cache = new_kv_cache(self.cfg, (h // 2) * (w // 2), heads, self.device, self.dtype)
        self.sessions[spec.session] = _Session(
            geometry=geometry,
            noise=NoiseSource(spec.seed, self.device),
            text=self.model.text_cache(context.to(self.device)),
            cache=cache,
            camera=StreamingCamera(intrinsics, geometry.height, geometry.width, self.device,
                                   self.translation_scale),
            # measured on the meta device once per frame size (a second for v1), here rather than mid-stream
            working=dit_working_bytes(self.cfg, self.dtype, self.model.sp.size, geometry.height, geometry.width)
            if self.device.type == "cuda" else 0,
        )

    @torch.no_grad()
    def set_context(self, session: str, context: torch.Tensor) -> None:
        """A new prompt from the next chunk on: the text keys/values are rewritten in place (a captured CUDA graph
        reads them at their addresses); on the DiT's own stream, after the chunks already run."""
        if session not in self.sessions:
            raise KeyError(f"unknown session {session!r}")
        text, new = self.sessions[session].text, self.model.text_cache(context.to(self.device))
        for old, fresh in zip((*text.k, *text.v), (*new.k, *new.v), strict=True):
            old.copy_(fresh)

    @torch.no_grad()
    def denoise(self, session: str, index: int, condition: torch.Tensor, control: ChunkControl,
                steps: int | None = None) -> torch.Tensor:  # fmt: skip
        """Clean latent ``[16, cs, h, w]`` (float32, on the stage's device) of chunk ``index``; same on every rank.
        ``steps``: the denoising steps the chunk runs (4, 2 or 1: a subset of the preset's timesteps; None: all).

        The chunk's per-session inputs (poses, camera modulation, condition) are prepared first and the DiT group
        agrees that every rank succeeded before the passes, whose all-to-alls a failing rank would leave hanging:
        a bad input fails its session on every rank alike (``SessionInputError``); only a failure inside the
        passes ends the job."""
        error: Exception | None = None
        try:
            chosen = self.steps if steps is None else step_subset(self.steps, steps)
            st, cam, y = self._prepare(session, index, condition, control)
        except Exception as e:
            error = e
        agree_prepared(self.model.sp.group, self.device, error)
        return denoise_chunk(self.model, chosen, st.noise, index, y, cam, st.text, st.cache)

    def _prepare(self, session: str, index: int, condition: torch.Tensor,
                 control: ChunkControl) -> tuple[_Session, ChunkCamera, torch.Tensor]:  # fmt: skip
        if session not in self.sessions:
            raise KeyError(f"unknown session {session!r}")
        st = self.sessions[session]
        if tuple(condition.shape) != tuple(st.geometry.condition_shape):
            raise ValueError(f"condition {tuple(condition.shape)} is not {st.geometry.condition_shape}")
        if index != st.next_index:
            raise ValueError(f"session {session!r} expects chunk {st.next_index}, got {index}")
        cap = self.cfg.max_chunks
        if cap is not None and index >= cap:
            raise ValueError(f"chunk {index} is past what the {self.cfg.kv_policy} KV cache holds ({cap} chunks: "
                             f"{self.cfg.kv_window} latent frames); use a rolling model.kv_window for longer")
        # A chunk's passes cannot fail on one rank alone (the others would wait in its all-to-all): an OOM is raised
        # here instead, where the group agrees on it and only the session fails.
        ensure_headroom(self.device, st.working, f"chunk {index} of {session}")
        first = index == 0
        poses = integrate(st.camera.last_video_pose, control, st.geometry.frames_in_chunk(index), self.speeds,
                          first_is_start=first)  # fmt: skip
        ctrl = st.camera.control(np.asarray(poses), first)  # [1, 384, cs, h, w] on the device
        if not bool(torch.isfinite(ctrl).all()):
            raise ValueError(f"the camera of chunk {index} is not finite")
        st.next_index += 1
        cam = self.model.camera_modulation(ctrl)
        return st, cam, condition.to(device=self.device, dtype=self.dtype)

    def state_dict(self, session: str) -> dict[str, torch.Tensor]:
        """This rank's part of the session after its last chunk: the valid slots of its KV ring (its heads), the
        ring's bookkeeping and slot positions, the noise generator and the camera integration state. The text
        cache is not kept: ``load_state`` recomputes it from the prompt context (the same keys, bit for bit)."""
        st = self.sessions[session]
        cache, camera = st.cache, st.camera
        state = {
            "next_index": torch.tensor([st.next_index], dtype=torch.int64),
            "noise": st.noise.generator.get_state(),
            "kv.ring": torch.tensor([cache.global_end, cache.filled, cache.oldest, cache.evicted], dtype=torch.int64),
            "kv.positions": cache.positions,
            "camera.last_video_pose": torch.from_numpy(camera.last_video_pose.copy()),
        }
        if camera.prev_latent_pose is not None:
            state["camera.prev_latent_pose"] = camera.prev_latent_pose
        for layer, (k, v) in enumerate(zip(cache.k, cache.v, strict=True)):
            state[f"kv.k.{layer}"], state[f"kv.v.{layer}"] = k[:, : cache.filled], v[:, : cache.filled]
        return state

    @torch.no_grad()
    def load_state(self, spec: SessionSpec, context: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Open ``spec.session`` as ``open`` does, then put this rank's saved state in place; a state of another
        shape (other heads per rank, window or frame size) is refused before anything is kept."""
        self.open(spec, context)
        try:
            st = self.sessions[spec.session]
            cache, camera = st.cache, st.camera
            global_end, filled, oldest, evicted = (int(v) for v in state["kv.ring"].tolist())
            for layer, (k, v) in enumerate(zip(cache.k, cache.v, strict=True)):
                for mine, saved in ((k, state[f"kv.k.{layer}"]), (v, state[f"kv.v.{layer}"])):
                    if tuple(saved.shape) != (mine.shape[0], filled, mine.shape[2]):
                        raise ValueError(f"KV layer {layer} of shape {tuple(saved.shape)} does not fit this rank's "
                                         f"ring {tuple(mine.shape)} with {filled} valid slots")
                    mine[:, :filled].copy_(saved)
            if state["kv.positions"].shape != cache.positions.shape:
                raise ValueError(f"a KV ring of {state['kv.positions'].shape[0]} slots, not {cache.slots}")
            cache.positions.copy_(state["kv.positions"])
            cache.global_end, cache.filled, cache.oldest, cache.evicted = global_end, filled, oldest, evicted
            st.noise.generator.set_state(state["noise"].cpu())
            st.next_index = int(state["next_index"][0])
            camera.last_video_pose = state["camera.last_video_pose"].to(torch.float64).numpy().copy()
            prev = state.get("camera.prev_latent_pose")
            camera.prev_latent_pose = None if prev is None else prev.to(torch.float64).cpu().clone()
        except Exception:
            self.release(spec.session)
            raise

    def session_nbytes(self, session: str) -> int:
        """Bytes the session's caches hold on this rank (its KV ring and text keys/values)."""
        st = self.sessions[session]
        return st.cache.nbytes() + sum(t.numel() * t.element_size() for t in (*st.text.k, *st.text.v))

    def sessions_nbytes(self) -> int:
        return sum(self.session_nbytes(session) for session in list(self.sessions))

    def release(self, session: str) -> None:
        self.sessions.pop(session, None)
