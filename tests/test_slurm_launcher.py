"""The launcher at home inside a Slurm job, without a cluster: which environment is a rank launch, tokens off the
command line, logs/ on a fresh checkout, torchrun's --max-restarts refused clearly, @record's traceback. The
recipes themselves run on a real slurmctld/slurmd in ``tests/test_slurm.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import launch
from runtime import config as config_mod
from runtime import router_config
from scripts.local_server import ROOT

SLURM_JOB = {"SLURM_JOB_ID": "12", "SLURM_JOB_NODELIST": "node1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}


@pytest.mark.parametrize(("where", "env"), [
    ("the sbatch script", {**SLURM_JOB, "SLURM_NTASKS": "1"}),  # the batch step: no SLURM_STEP_ID
    ("salloc's shell", {"SLURM_JOB_ID": "12", "SLURM_NTASKS": "7"}),
    ("srun --pty", {**SLURM_JOB, "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0"}),
    ("srun -n2 for a 7-rank layout", {**SLURM_JOB, "SLURM_NTASKS": "2", "SLURM_STEP_ID": "3"}),
    ("the extern step", {**SLURM_JOB, "SLURM_NTASKS": "7", "SLURM_STEP_ID": "4294967295"}),
])
def test_launcher_inside_a_slurm_job_but_not_a_matching_srun_step_self_launches_and_says_why(
        where: str, env: dict[str, str]) -> None:
    ranks, why = launch.distributed_env(7, dict(env))
    assert ranks is None, where
    assert "Slurm job 12" in why and "starting torchrun here" in why and "7 tasks" in why


def test_launcher_in_an_srun_step_of_the_layouts_world_size_is_a_rank() -> None:
    env = {**SLURM_JOB, "SLURM_PROCID": "3", "SLURM_LOCALID": "3", "SLURM_NTASKS": "7", "SLURM_STEP_ID": "0"}
    assert launch.distributed_env(7, env)[0] == (3, 7, 3)
    assert env["MASTER_PORT"]  # a default the batch file may override


def test_torchrun_environment_wins_over_slurms() -> None:
    env = {**SLURM_JOB, "SLURM_NTASKS": "1", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    assert launch.distributed_env(2, env)[0] == (1, 2, 1)


def test_launcher_outside_any_job_self_launches() -> None:
    assert launch.distributed_env(7, {})[0] is None


def test_replica_and_router_tokens_come_from_files(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("s3cret\n")
    cfg = config_mod.load("cpu-mini", [f"--replica.token_file={secret}"])
    assert cfg.replica.token == "s3cret"
    router = router_config.load("router", [f"--router.register_token_file={secret}",
                                           "--router.register_bind=tcp://0.0.0.0:5561"])
    assert router.router.register_token == "s3cret"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(config_mod.ConfigError, match="is empty"):
        config_mod.load("cpu-mini", [f"--replica.token_file={tmp_path / 'empty'}"])
    with pytest.raises(config_mod.ConfigError, match="not both"):
        config_mod.load("cpu-mini", [f"--replica.token_file={secret}", "--replica.token=x"])


def test_recipes_never_put_a_token_on_a_command_line() -> None:
    for recipe in (ROOT / "scripts" / "slurm").glob("*.sbatch"):
        text = recipe.read_text()
        assert "--replica.token=" not in text and "--router.register_token=" not in text, recipe.name


def test_logs_folder_is_in_a_fresh_checkout_and_its_contents_are_ignored() -> None:
    tracked = subprocess.run(["git", "ls-files", "logs"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "logs/.gitignore" in tracked.stdout.split()  # Slurm opens logs/<job>.out before the script runs
    for name in ("logs/router-token", "logs/router-endpoint", "logs/worldstream-router-7.out"):
        ignored = subprocess.run(["git", "check-ignore", "-q", name], cwd=ROOT)
        assert ignored.returncode == 0, f"{name} would be committed by `git add -A`"


def torchrun(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--monitor-interval=0.2", *args]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCH"))}
    return subprocess.run(command, cwd=ROOT, env={**clean, **(env or {}), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.multiprocess
def test_torchrun_max_restarts_is_refused_with_what_to_do() -> None:
    run = torchrun("--nproc-per-node=2", "--max-restarts=1", "launch.py", "--config", "cpu-mini")
    assert run.returncode != 0
    assert "--max-restarts=1 needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in run.stderr, run.stderr[-3000:]


@pytest.mark.multiprocess
def test_an_exception_on_a_rank_reaches_torchruns_failure_summary_with_its_traceback() -> None:
    # NCCL asked of a machine without CUDA: the rank raises before joining (no GPU to bind to)
    run = torchrun("--nproc-per-node=2", "launch.py", "--config", "cpu-mini", "--layout.backend=nccl")
    assert run.returncode != 0
    summary = run.stderr[run.stderr.rfind("Root Cause"):]
    assert "Traceback (most recent call last)" in summary, run.stderr[-3000:]
    assert "To enable traceback" not in summary
