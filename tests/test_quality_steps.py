"""Quality presets through the real denoise stage (tiny preset): 1 and 2 steps run the first / the first and third
of the preset's timesteps, with the sampler's updates written here from ../shared/fixtures/golden/README.md
(sections 7 and 10), not taken from the code under test; the t = 0 refresh pass stays."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.controls import ChunkControl
from models.dit_config import DiTConfig
from models.lingbot_denoise import LingbotDenoiseStage
from models.stages import SessionSpec, StreamGeometry
from models.synthetic import pass_cost

torch.set_num_threads(1)
GEOMETRY = StreamGeometry(
    height=32, width=48, chunk_latent_frames=3, context_shape=(16, 32), condition_shape=(20, 3, 4, 6),
    latent_shape=(16, 3, 4, 6),
)  # fmt: skip


def readme_schedule(shift: float, indices: tuple[int, ...]) -> list[tuple[int, float, float]]:
    """(timestep, sigma_x0, sigma_renoise) of each step, from the README's section 7."""
    a = np.linspace(1, 1 / 1000, 1000)[::-1]
    base = (1 - a).astype(np.float32)
    s = np.linspace(float(base[0]), float(base[-1]), 1001)[:-1]
    s = shift * s / (1 + (shift - 1) * s)
    timesteps = np.trunc(1000 * s).astype(np.int64)
    sigmas = np.concatenate([s, [0.0]]).astype(np.float32)
    out = []
    for i in indices:
        same = np.nonzero(timesteps == timesteps[i])[0]
        out.append((int(timesteps[i]), float(sigmas[same[0]]), float(sigmas[same[1] if len(same) > 1 else same[0]])))
    return out


class RecordedNoise:
    """Known noise in draw order, so the expected inputs can be computed here."""

    def __init__(self) -> None:
        self.gen = torch.Generator().manual_seed(7)
        self.drawn: list[torch.Tensor] = []

    def draw(self, shape: tuple[int, ...], kind: str, chunk: int, step: int) -> torch.Tensor:
        self.drawn.append(torch.randn(shape, generator=self.gen))
        return self.drawn[-1]


@pytest.mark.parametrize(("steps", "positions"), [(1, (0,)), (2, (0, 2)), (4, (0, 1, 2, 3))])
def test_fewer_steps_run_the_presets_own_timesteps_and_the_sampler_updates_of_the_readme(
        steps: int, positions: tuple[int, ...]) -> None:  # fmt: skip
    cfg = DiTConfig.from_name("tiny", attention="sdpa")
    stage = LingbotDenoiseStage(cfg, GEOMETRY, init_seed=5)
    context = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    stage.open(SessionSpec(session="s", seed=0, prompt=""), context)
    noise = RecordedNoise()
    stage.sessions["s"].noise = noise  # type: ignore[assignment]
    calls: list[tuple[torch.Tensor, float, torch.Tensor]] = []  # the real DiT's (input x, t, output v) per pass
    stage.model.register_forward_hook(lambda m, args, out: calls.append((args[0].clone(), args[2], out.clone())))
    condition = torch.randn(20, 3, 4, 6, generator=torch.Generator().manual_seed(2))
    latent = stage.denoise("s", 0, condition, ChunkControl(keys=frozenset("w")), steps=steps)

    chosen = [readme_schedule(cfg.shift, cfg.timestep_indices)[p] for p in positions]
    assert [t for _, t, _ in calls] == [float(t) for t, _, _ in chosen] + [0.0]  # the refresh pass stays, at t = 0
    assert len(noise.drawn) == steps  # the initial noise and one re-noise per later step
    x = noise.drawn[0]
    for s, (_, sigma_x0, _) in enumerate(chosen):
        seen_x, _, v = calls[s]
        torch.testing.assert_close(seen_x, x, rtol=0, atol=1e-6)
        x0 = (x.double() - sigma_x0 * v.double()).float()
        if s + 1 < len(chosen):
            sr = torch.tensor(chosen[s + 1][2], dtype=torch.float32)
            x = (1 - sr) * x0 + sr * noise.drawn[s + 1]
    torch.testing.assert_close(latent, x0, rtol=0, atol=1e-6)
    torch.testing.assert_close(calls[-1][0], x0, rtol=0, atol=1e-6)  # the refresh pass sees the clean latent


def test_a_session_can_change_its_steps_from_one_chunk_to_the_next_and_bad_steps_fail_the_chunk() -> None:
    stage = LingbotDenoiseStage(DiTConfig.from_name("tiny", attention="sdpa"), GEOMETRY, init_seed=5)
    stage.open(SessionSpec(session="s", seed=0, prompt=""), torch.zeros(16, 32))
    calls: list[float] = []
    stage.model.register_forward_hook(lambda m, args, out: calls.append(args[2]))
    condition = torch.zeros(20, 3, 4, 6)
    for index, steps in enumerate((4, 1, 2)):
        stage.denoise("s", index, condition, ChunkControl(), steps=steps)
    assert len(calls) == 5 + 2 + 3
    with pytest.raises(ValueError, match="quality preset"):
        stage.denoise("s", 3, condition, ChunkControl(), steps=3)
    stage.denoise("s", 3, condition, ChunkControl(), steps=4)  # the failed chunk changed nothing


def test_the_synthetic_denoise_costs_in_proportion_to_its_passes() -> None:
    assert [pass_cost(0.5, s) for s in (None, 4, 2, 1)] == pytest.approx([0.5, 0.5, 0.3, 0.2])
    with pytest.raises(ValueError):
        pass_cost(0.5, 3)
