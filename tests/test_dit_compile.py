"""``[model] compile``: the compiled DiT conforms to the golden fixture, compiles once per (geometry, fill level of the
window) and never again, never breaks its graph, and falls back to eager (said once) when compilation fails.

Compiling is slow on a small CPU, so the compiled tests are few; each starts from a clean dynamo cache (inductor's
on-disk cache still makes a repeated compile cheap)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from ipc.protocol import Stage
from models.compiled import CompiledBlocks, CudaGraphPasses, compile_dit
from models.controls import ChunkControl
from models.dit import WanModelFast
from models.dit_config import DiTConfig
from models.kv_cache import KVCache
from models.lingbot_config import dit_config
from models.lingbot_denoise import LingbotDenoiseStage
from models.rope import apply_rope, rope_angles, rope_freqs
from models.stages import SessionSpec, StreamGeometry
from ranks.backend import Backend
from ranks.warmup import WARMUP_CHUNKS, stage_chunks, warm_stage
from runtime.config import ConfigError, ModelConfig, StreamConfig, load
from scripts import check_golden
from scripts.check_golden import compare
from scripts.golden_dit import checks
from tests.golden_fixtures import FIXTURES, fixture_params, require
from tests.test_dit_golden import REGRESSION_FRACTION
from tests.test_dit_stage import GEOMETRY, MOVE  # the stage tests' tiny geometry and control

torch.set_num_threads(1)


def _turn(k: int) -> ChunkControl:
    """A control that changes from chunk to chunk (a constant motion gives every chunk the same camera rays)."""
    return ChunkControl(keys=frozenset("wl" if k % 3 == 0 else "sj" if k % 3 == 1 else "ai"))


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()
    counters.clear()


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _breaks() -> int:
    return sum(counters["graph_break"].values())


def _stage(compile: str, **kw: object) -> LingbotDenoiseStage:
    return LingbotDenoiseStage(DiTConfig.from_name("tiny", attention="sdpa", compile=compile), GEOMETRY, init_seed=5,
                               **kw)  # fmt: skip


def _condition(geometry: StreamGeometry, index: int) -> torch.Tensor:
    return torch.randn(geometry.condition_shape, generator=torch.Generator().manual_seed(index))


@pytest.mark.parametrize("fixture", fixture_params())
def test_compiled_blocks_reproduce_every_dit_tensor_of_the_fixture_within_the_dit_bound(fixture: Path | None) -> None:
    failures = []
    for name, actual, expected in checks(require(fixture), compile="blocks"):  # strict: a graph break raises
        ok, error, _, bound = compare(name, actual, expected)
        if expected.is_floating_point() and not (ok and error <= REGRESSION_FRACTION * bound):
            failures.append(f"{name}: max error {error:.3e} > {REGRESSION_FRACTION * bound:.3e}")
        elif not ok:
            failures.append(f"{name}: {actual.tolist()} != {expected.tolist()}")
    assert not failures, "\n".join(failures)
    assert _graphs() == 3 and _breaks() == 0  # the fixture's window fills in 3 chunks: one graph per fill level


def test_check_golden_compile_runs_the_fixture_through_the_compiled_dit(capsys: pytest.CaptureFixture[str]) -> None:
    require(FIXTURES[0] if FIXTURES else None)
    assert check_golden.main(["--all", "--compile"]) == 0
    out = capsys.readouterr().out
    assert "ok   compile=blocks: 3 compiled graphs, 0 graph breaks" in out
    assert "ok   dit_v_refresh_c3 " in out and "ok   end_to_end:x0_c3 " in out


def test_two_sessions_and_another_geometry_compile_once_per_fill_level_and_never_again() -> None:
    """12 chunks through eviction and ring wrap-around: the tiny window (8 latent frames, 2 sink) holds chunk 0, then
    chunks 0-1, then is full from chunk 2 on; its ring of 6 frames wraps every 2 chunks. So a frame size compiles 3
    graphs (one per fill level) in its first session's first 3 chunks, and nothing else ever compiles."""
    stage, eager = _stage("blocks"), _stage("off")
    assert stage.compile == "blocks"
    other = (48, 64)  # a latent grid of 6x8: 12 tokens per latent frame instead of 6
    for s in (stage, eager):
        s.open(SessionSpec(session="a", seed=1, prompt=""), torch.zeros(16, 32))
        s.open(SessionSpec(session="b", seed=2, prompt=""), torch.zeros(16, 32))
    new_graphs: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    for k in range(12):
        for session in ("a", "b"):
            before = _graphs()
            got = stage.denoise(session, k, _condition(GEOMETRY, k), _turn(k))
            new_graphs[session].append(_graphs() - before)
            torch.testing.assert_close(got, eager.denoise(session, k, _condition(GEOMETRY, k), _turn(k)), atol=1e-5,
                                       rtol=1e-5)  # fmt: skip
    stage.open(SessionSpec(session="c", seed=3, prompt="", height=other[0], width=other[1]), torch.zeros(16, 32))
    geometry = GEOMETRY.with_size(*other)
    for k in range(12):
        before = _graphs()
        stage.denoise("c", k, _condition(geometry, k), MOVE)
        new_graphs["c"].append(_graphs() - before)
    failure = stage.model.block_runner.failure  # type: ignore[union-attr]
    assert failure is None, f"the compiled block fell back to eager: {failure}"
    assert _breaks() == 0, dict(counters["graph_break"])
    assert new_graphs == {"a": [1, 1, 1] + [0] * 9, "b": [0] * 12, "c": [1, 1, 1] + [0] * 9}


def test_a_compile_that_fails_runs_eagerly_with_one_warning_and_the_same_output(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> None:
        raise RuntimeError("injected compiler failure")

    eager = _stage("off")
    with caplog.at_level(logging.WARNING, logger="models.compiled"):
        stage = _stage("blocks", compile_backend=broken_backend)
        for s in (stage, eager):
            s.open(SessionSpec(session="a", seed=1, prompt=""), torch.zeros(16, 32))
        for k in range(4):
            got = stage.denoise("a", k, _condition(GEOMETRY, k), MOVE)
            torch.testing.assert_close(got, eager.denoise("a", k, _condition(GEOMETRY, k), MOVE), atol=1e-6, rtol=0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "injected compiler failure" in warnings[0], warnings
    assert "runs eagerly from now on" in warnings[0]


def test_graphs_on_cpu_runs_as_blocks_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    model = WanModelFast(DiTConfig.from_name("tiny"))
    with caplog.at_level(logging.WARNING, logger="models.compiled"):
        assert compile_dit(model, "graphs", "cpu") == "blocks"
    assert [r.getMessage() for r in caplog.records] == [
        "compile = 'graphs' needs CUDA (the DiT is on cpu): running as 'blocks'"]
    assert model.block_runner is not None and model.graphs is None
    assert compile_dit(model, "off") == "off" and model.block_runner is None
    with pytest.raises(ValueError, match="compile must be one of"):
        compile_dit(model, "fast")


def test_the_config_key_reaches_the_dit_defaults_to_off_and_rejects_other_values() -> None:
    stream = StreamConfig()
    assert dit_config(ModelConfig(kind="lingbot-fast"), stream).compile == "off"
    assert dit_config(ModelConfig(kind="lingbot-fast", compile="blocks"), stream).compile == "blocks"
    assert load("cpu-tiny-model", ["--model.compile=graphs"]).model.compile == "graphs"
    with pytest.raises(ConfigError, match=r"model\.compile"):
        load("cpu-tiny-model", ["--model.compile=fast"])


def test_the_indexed_ring_write_holds_exactly_what_the_slice_runs_hold() -> None:
    """The compiled write (one index_copy_ through the session's slot index, at one address) against the eager
    reference (runs of slices), through eviction and wrap-around, rewrites included."""
    fs, cs = 2, 3
    runs, indexed = (KVCache(1, 8 * fs, 2 * fs, 1, 1, "cpu", torch.float32) for _ in range(2))
    address = None
    for k in range(9):
        frames = torch.arange(k * cs, (k + 1) * cs, dtype=torch.float32).repeat_interleave(fs).view(1, -1, 1)
        for p in range(3):
            runs.begin(k * cs * fs, cs * fs)
            indexed.begin(k * cs * fs, cs * fs, indexed=True)
            want, _ = runs.write(0, frames + p, frames + p)
            got, _ = indexed.write(0, frames + p, frames + p)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        address = address or indexed.layer(0).slots.data_ptr()  # type: ignore[union-attr]
        assert indexed.layer(0).slots.data_ptr() == address  # type: ignore[union-attr]


def test_rope_as_real_arithmetic_equals_the_complex_rotation() -> None:
    freqs = rope_freqs(rope_angles(12, 3, 2, 3, start_frame=5))
    for dtype, table in ((torch.float32, freqs), (torch.bfloat16, freqs.to(torch.complex64))):
        x = torch.randn(18, 5, 12).to(dtype)
        want = apply_rope(x, table)
        got = apply_rope(x, torch.view_as_real(table))
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-2)


def test_the_sharded_form_compiles_the_halves_around_the_all_to_alls_once_each() -> None:
    """Under Ulysses the collectives stay eager between three compiled pieces (run here on one rank, where the
    all-to-alls are the identity): the two halves compile once, the attention once per fill level of the window."""
    stage, eager = _stage("blocks"), _stage("off")
    stage.model.block_runner = CompiledBlocks(sharded=True, strict=True)
    for s in (stage, eager):
        s.open(SessionSpec(session="a", seed=1, prompt=""), torch.zeros(16, 32))
    made = []
    for k in range(5):
        before = _graphs()
        got = stage.denoise("a", k, _condition(GEOMETRY, k), MOVE)
        made.append(_graphs() - before)
        torch.testing.assert_close(got, eager.denoise("a", k, _condition(GEOMETRY, k), MOVE), atol=1e-5, rtol=1e-5)
    assert made == [3, 1, 1, 0, 0] and _breaks() == 0


class _Rerun:
    """Stands in for a CUDA graph on CPU: a replay re-runs what was captured on the same static tensors and writes
    the same output tensor, which is what a replay does (addresses fixed at capture)."""

    def __init__(self, run: Callable[[], torch.Tensor]) -> None:
        self.run, self.out, self.replays = run, run(), 0

    def replay(self) -> None:
        self.out.copy_(self.run())
        self.replays += 1


class _RerunPasses(CudaGraphPasses):
    def __init__(self) -> None:
        super().__init__()
        self.recorded: list[_Rerun] = []

    def _record(self, run: Callable[[], torch.Tensor]) -> tuple[_Rerun, torch.Tensor]:
        self.recorded.append(_Rerun(run))
        return self.recorded[-1], self.recorded[-1].out


def test_steady_passes_replay_through_static_buffers_and_match_eager() -> None:
    """The replay logic of ``graphs`` (CUDA graphs cannot run here): from the first chunk whose window is full, each
    pass of each session is captured once and then replayed with that call's latent, condition, RoPE table, camera
    and ring slots copied into the captured tensors; two sessions interleaved give the eager stream."""
    stage, eager = _stage("off"), _stage("off")
    passes = stage.model.graphs = _RerunPasses()  # eager blocks: the replay logic alone
    for s in (stage, eager):
        for seed, session in enumerate(("a", "b")):
            s.open(SessionSpec(session=session, seed=seed, prompt=""), torch.zeros(16, 32))
    for k in range(6):
        for session in ("a", "b"):
            got = stage.denoise(session, k, _condition(GEOMETRY, k), _turn(k))
            want = eager.denoise(session, k, _condition(GEOMETRY, k), _turn(k))
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    passes_per_chunk = len(stage.steps) + 1
    assert len(passes.recorded) == 2 * passes_per_chunk  # captured at chunk 2 (window full), per session and pass
    assert [r.replays for r in passes.recorded] == [4] * 2 * passes_per_chunk  # chunk 2 (after capture), 3, 4, 5


def test_the_warm_up_of_a_compiled_dit_runs_every_fill_level_so_no_session_compiles() -> None:
    """The tiny window fills in 3 chunks: a compiled DiT's warm-up runs them and one steady chunk (4, not the 2 of an
    eager one), so every graph is compiled at start and a session's first chunks compile nothing."""
    stage = _stage("blocks", compile_backend="eager")  # dynamo counts its graphs whatever the backend; eager is quick
    backend = Backend(GEOMETRY, {Stage.DENOISE: stage})
    assert stage_chunks(backend, Stage.DENOISE) == 4
    assert stage_chunks(Backend(GEOMETRY, {Stage.DENOISE: _stage("off")}), Stage.DENOISE) == WARMUP_CHUNKS
    runs = warm_stage(backend, Stage.DENOISE, ((GEOMETRY.height, GEOMETRY.width),), torch.device("cpu"))
    assert [(r.chunks, r.failed) for r in runs] == [(4, "")]
    warmed = _graphs()
    assert warmed == 3
    stage.open(SessionSpec(session="s", seed=1, prompt=""), torch.zeros(16, 32))
    for k in range(5):
        stage.denoise("s", k, _condition(GEOMETRY, k), _turn(k))
    assert _graphs() == warmed and _breaks() == 0
