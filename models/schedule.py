"""Flow-matching schedule of the causal-fast loop, with the two-sigma rule.

``num_train_timesteps = 1000``: base sigmas ``float32(1 - a)`` with ``a = linspace(1, 1/1000, 1000)``
reversed, so ``sigma_max = float32(0.999)`` and ``sigma_min = 0``; ``s = linspace(sigma_max, sigma_min,
1001)[:-1]`` in float64, shifted ``s = shift*s / (1 + (shift-1)*s)``; ``timesteps = int64(trunc(1000*s))``,
``sigmas = float32(concat(s, [0]))``. A step at schedule index ``i`` uses the integer timestep
``timesteps[i]``. Because truncated timesteps repeat, two sigmas belong to a step:

- ``sigma_x0``: the sigma at the *first* index whose timestep equals the step's (for ``x0 = x - sigma*v``);
- ``sigma_renoise``: the sigma at the *second* such index if there is one, else the first (re-noising
  *to* this step: ``x = (1 - sr) * x0 + sr * noise``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ipc.protocol import QUALITY_STEPS  # the presets, best first (the wire's vocabulary)


@dataclass(frozen=True)
class Step:
    """One denoising step."""

    index: int  # schedule index from the config
    timestep: int  # integer timestep fed to the DiT
    sigma_x0: float  # float32 value, for x0 = x - sigma_x0 * v
    sigma_x0_index: int
    sigma_renoise: float  # float32 value, for re-noising the previous x0 to this step
    sigma_renoise_index: int


@dataclass(frozen=True)
class FlowMatchSchedule:
    timesteps: np.ndarray  # int64 [num_train_timesteps]
    sigmas: np.ndarray  # float32 [num_train_timesteps + 1]

    @classmethod
    def build(cls, shift: float, num_train_timesteps: int = 1000) -> FlowMatchSchedule:
        n = num_train_timesteps
        alphas = np.linspace(1.0, 1.0 / n, n)[::-1].copy()
        base = (1.0 - alphas).astype(np.float32)
        sigma_max, sigma_min = float(base[0]), float(base[-1])
        s = np.linspace(sigma_max, sigma_min, n + 1)[:-1]  # float64
        s = shift * s / (1.0 + (shift - 1.0) * s)
        timesteps = np.trunc(s * n).astype(np.int64)
        sigmas = np.concatenate([s, [0.0]]).astype(np.float32)
        return cls(timesteps=timesteps, sigmas=sigmas)

    def step(self, index: int) -> Step:
        t = int(self.timesteps[index])
        same = np.nonzero(self.timesteps == t)[0]
        first, second = int(same[0]), int(same[1]) if len(same) > 1 else int(same[0])
        return Step(index, t, float(self.sigmas[first]), first, float(self.sigmas[second]), second)

    def steps(self, indices: tuple[int, ...] | list[int]) -> list[Step]:
        return [self.step(i) for i in indices]


def x0_from_velocity(x: torch.Tensor, v: torch.Tensor, sigma_x0: float) -> torch.Tensor:
    """``x0 = x - sigma * v`` computed in float64, returned as float32."""
    return (x.double() - float(sigma_x0) * v.double()).float()


def renoise(x0: torch.Tensor, noise: torch.Tensor, sigma: float) -> torch.Tensor:
    """``(1 - sigma) * x0 + sigma * noise`` in float32 (``1 - sigma`` computed in float32)."""
    s = torch.tensor(sigma, dtype=torch.float32)
    return ((1 - s) * x0.float() + s * noise.float()).float()


# Quality presets: how many of the preset's own denoising steps a chunk runs. Fewer steps are a subset of the
# distilled schedule's timesteps (never a new schedule): 1 step runs the first timestep, 2 steps the first and the
# third, 4 steps all four. The t = 0 pass that refreshes the KV cache runs after any of them.
_SUBSETS = {4: (0, 1, 2, 3), 2: (0, 2), 1: (0,)}  # positions in the preset's 4 steps


def step_subset(steps: list[Step] | tuple[Step, ...], count: int) -> list[Step]:
    """The ``count`` steps (4, 2 or 1) a chunk runs out of a preset's ``steps`` (``ValueError`` otherwise). A
    preset with another number of steps (a golden fixture's) runs all of them for 4 (the full quality rank 0 asks by
    default) or its own count, and no other."""
    if count in (len(steps), QUALITY_STEPS[0]):
        return list(steps)
    if len(steps) != 4 or count not in _SUBSETS:
        raise ValueError(f"{count} denoising steps is not a quality preset of a {len(steps)}-step schedule "
                         f"(presets: {', '.join(map(str, QUALITY_STEPS))} of the 4-step schedule)")
    return [steps[i] for i in _SUBSETS[count]]
