"""Every recipe in scripts/slurm/ submitted as it is to a real single-node Slurm (``scripts/slurm_local.py``: munged,
slurmctld, slurmd in a temporary folder), from a fresh copy of the checkout (what git tracks, plus a link to
.venv), with the real launch.py on the smallest CPU layouts. The recipes take the layout, ports and hosts from the
environment variables they document, so nothing binds beyond loopback. Asserted: JobState and ExitCode of each job,
a requested stop ending COMPLETED 0:0, requeue (array, split7-torchrun) and restart (steps) serving again, the logs
of both runs kept, a missing router endpoint failing fast, tokens never on a command line, and srun --kill-on-bad-exit
ending every rank after a SIGKILL (srun -n7) or a SIGSTOP (-n2).

Without the Slurm packages (or root) the tests skip with the reason; with CI set they fail instead."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ipc.client import Busy, Client, SessionMigrated
from scripts.local_server import ROOT
from scripts.slurm_local import LocalSlurm, missing
from tests.shared import free_port

pytestmark = pytest.mark.multiprocess

IMAGE = (ROOT / "assets" / "start.png").read_bytes()
START_S = 300.0  # a job's ranks started and serving, on two cores shared with other test runs
DEAD_S = 3.0  # timeouts.rank_dead_s of the srun jobs


def wait_for(ready: Callable[[], object], timeout_s: float, what: str, log: Callable[[], str] = lambda: "") -> object:
    """Poll ``ready`` until it returns something true; fail with ``what`` (and a log) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = ready()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s:.0f} s\n{log()[-4000:]}")
        time.sleep(0.2)


@dataclass
class Cluster:
    slurm: LocalSlurm
    checkout: Path  # a fresh checkout: jobs are submitted from its root, as the recipes say
    jobs: list[str] = field(default_factory=list)

    def submit(self, recipe: str, env: dict[str, str], *options: str, args: tuple[str, ...] = ()) -> str:
        """``sbatch [options] scripts/slurm/<recipe> [args]`` from the checkout's root; the job id."""
        run = subprocess.run(["sbatch", "--parsable", *options, f"scripts/slurm/{recipe}", *args],
                             cwd=self.checkout, env={**self.slurm.env, **env}, capture_output=True, text=True,
                             timeout=30)
        assert run.returncode == 0, run.stderr
        job = run.stdout.strip().split(";")[0]
        self.jobs.append(job)
        return job

    def job(self, job: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobId, JobState, ExitCode, Restarts, StdOut, ...)."""
        text = self.slurm.run("scontrol", "show", "job", "-o", job, check=False).stdout
        return dict(part.split("=", 1) for part in text.split() if "=" in part)

    def ended(self, job: str, timeout_s: float = 60.0) -> dict[str, str]:
        final = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
        return wait_for(lambda: (info := self.job(job)).get("JobState") in final and info, timeout_s,
                        f"job {job} ended", lambda: self.log(job))  # type: ignore[return-value]

    def log(self, job: str) -> str:
        out = self.job(job).get("StdOut", "")
        path = Path(out) if out else None
        return path.read_text(errors="replace") if path and path.exists() else f"(no log for {job})"

    def processes(self, job: str, **env: str) -> list[int]:
        """Pids of the job's processes whose environment has SLURM_JOB_ID=<job id> and every ``env`` pair."""
        want = {f"SLURM_JOB_ID={self.job(job)['JobId']}".encode(), *(f"{k}={v}".encode() for k, v in env.items())}
        found = []
        for pid in self.slurm.job_processes():
            try:
                environ = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
            except OSError:
                continue
            if want <= environ:
                found.append(pid)
        return found

    def stop(self, job: str) -> None:
        """What a user (or the time limit's --signal=B:TERM) does: TERM to the batch shell alone."""
        self.slurm.run("scancel", "--batch", "--signal=TERM", job)


def fresh_checkout(into: Path) -> Path:
    """What `git clone` gives (tracked files, and new ones not ignored) with .venv linked in: no logs/ contents."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)
    (into / ".venv").symlink_to((ROOT / ".venv").resolve())
    return into


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    lacks = missing()
    if lacks:
        reason = f"no local Slurm: missing {', '.join(lacks)} (.ci/run installs slurmctld slurmd slurm-client munge)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    with LocalSlurm(tmp_path_factory.mktemp("slurm")) as slurm:
        yield Cluster(slurm, fresh_checkout(tmp_path_factory.mktemp("checkout")))
        left = slurm.job_processes()
    assert not left, f"processes of ended jobs still running: {left}"


@dataclass
class Serving:
    """A job submitted ahead of its test, and the file its rank 0 writes its client port to once serving."""

    job: str
    port_file: Path
    cluster: Cluster

    def endpoint(self) -> str:
        wait_for(self.port_file.exists, START_S, f"job {self.job} serving", lambda: self.cluster.log(self.job))
        return f"tcp://127.0.0.1:{self.port_file.read_text()}"


def submit_serving(cluster: Cluster, folder: Path, recipe: str, config: str, *options: str,
                   env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> Serving:
    port_file = folder / f"{recipe}-{len(cluster.jobs)}.port"
    job = cluster.submit(recipe, {"CONFIG": f"configs/{config}.toml", "OMP_NUM_THREADS": "1",
                                  "MASTER_PORT": str(free_port()), "WORLDSTREAM_PORT_FILE": str(port_file),
                                  **(env or {})}, *options, args=("--server.port=0", *args))
    return Serving(job, port_file, cluster)


@pytest.fixture(scope="module")
def early(cluster: Cluster, router: Router, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Serving]:
    """The jobs that need no router, submitted together once the router serves: they start while the replica tests
    wait on requeues and restarts (the suite's time is mostly ranks starting on two cores)."""
    folder = tmp_path_factory.mktemp("early")
    return {
        "torchrun": submit_serving(cluster, folder, "split7-torchrun.sbatch", "cpu-mini", env={"GPUS": "2"}),
        "srun7": submit_serving(cluster, folder, "split7-srun.sbatch", "cpu-tiny",
                                args=(f"--timeouts.rank_dead_s={DEAD_S}",)),
        # the recipe's --ntasks overridden on sbatch's command line for the 2-rank layout: the same srun path
        "srun-freeze": submit_serving(cluster, folder, "split7-srun.sbatch", "cpu-mini", "--ntasks=2",
                                      args=(f"--timeouts.rank_dead_s={DEAD_S}",)),
        "srun-stop": submit_serving(cluster, folder, "split7-srun.sbatch", "cpu-mini", "--ntasks=2"),
    }


@dataclass
class Router:
    job: str
    endpoint: str  # clients
    token: str  # the registration token, which the replicas' client ports require too
    client_token: str  # what the router's own clients present

    def states(self) -> dict[str, str]:
        with Client(self.endpoint, timeout_s=10, token=self.client_token) as client:
            return {name: r.state for name, r in client.stats().replicas.items()}


@pytest.fixture(scope="module")
def router(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    """router.sbatch, serving on loopback; its endpoint and token land in the checkout's logs/ (the defaults)."""
    port_file = tmp_path_factory.mktemp("router") / "port"
    job = cluster.submit("router.sbatch", {"ROUTER_PORT": str(free_port()), "REGISTER_HOST": "127.0.0.1",
                                           "REGISTER_PORT": str(free_port()), "WORLDSTREAM_PORT_FILE": str(port_file)})
    wait_for(port_file.exists, START_S, "router serving", lambda: cluster.log(job))
    token = (cluster.checkout / "logs" / "router-token").read_text().strip()
    client_token = (cluster.checkout / "logs" / "client-token").read_text().strip()
    for name in ("router-token", "client-token"):  # readable by its owner alone
        assert (cluster.checkout / "logs" / name).stat().st_mode & 0o077 == 0, name
    assert_no_token_on_a_command_line(cluster, job, client_token)
    yield Router(job, f"tcp://127.0.0.1:{port_file.read_text()}", token, client_token)
    cluster.stop(job)
    info = cluster.ended(job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), cluster.log(job)


REPLICA_ENV = {"CONFIG": "configs/cpu-mini.toml", "SERVER_HOST": "127.0.0.1", "SERVER_PORT": "0",
               "OMP_NUM_THREADS": "1"}


def serve_one_session(endpoint: str, timeout_s: float = START_S, token: str | None = None) -> None:
    """Open a session (retrying while the router has no replica up) and stream two chunks of it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with Client(endpoint, timeout_s=30, token=token) as client:
                info = client.open(IMAGE, num_chunks=2)
                for index in range(2):
                    client.control(info.id, index, keys="w")
                assert [c.index for c in client.chunks(info.id, timeout_s=60)] == [0, 1]
                return
        except Busy:
            assert time.monotonic() < deadline, "no replica took the session"
            time.sleep(0.5)


def assert_no_token_on_a_command_line(cluster: Cluster, job: str, token: str) -> None:
    pids = cluster.processes(job)
    assert pids
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        assert token.encode() not in argv, f"the token is in the arguments of pid {pid}: {argv!r}"


def kill_rank(cluster: Cluster, job: str, rank: int) -> None:
    """SIGKILL a torchrun-started rank of the job (one a dead GPU or an OOM kill would leave)."""
    pids = wait_for(lambda: cluster.processes(job, RANK=str(rank)), 30, f"rank {rank} of job {job}")
    for pid in pids:  # type: ignore[union-attr]
        os.kill(pid, signal.SIGKILL)


def test_a_replica_array_task_registers_serves_is_requeued_when_a_rank_dies_and_a_stop_ends_it_completed(
        cluster: Cluster, router: Router, early: dict[str, Serving]) -> None:
    array = cluster.submit("replicas-array.sbatch", REPLICA_ENV, "--array=0")
    task = f"{array}_0"
    name = f"replica-{array}-0"
    wait_for(lambda: router.states().get(name) == "up", START_S, f"{name} up", lambda: cluster.log(task))
    assert_no_token_on_a_command_line(cluster, task, router.token)
    serve_one_session(router.endpoint, token=router.client_token)

    kill_rank(cluster, task, 1)  # the task's job fails: the recipe asks Slurm to requeue it
    wait_for(lambda: cluster.job(task).get("Restarts") == "1", 90, "task requeued", lambda: cluster.log(task))
    wait_for(lambda: cluster.job(task).get("JobState") == "RUNNING" and router.states().get(name) == "up",
             START_S, f"{name} up again", lambda: cluster.log(task))
    serve_one_session(router.endpoint, token=router.client_token)

    stopped = time.monotonic()
    cluster.stop(task)
    info = cluster.ended(task)
    took = time.monotonic() - stopped
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), cluster.log(task)
    assert took < 60, f"the stop took {took:.1f} s, beyond the recipe's --signal lead of 60 s"
    log = cluster.log(task)  # --open-mode=append: the failed run and the requeue line are still there
    assert f"requeueing task {task}" in log and log.count("communicators made") == 4, log[-4000:]


def test_replica_steps_restart_a_failed_step_and_a_stop_drains_every_step_to_completed(
        cluster: Cluster, router: Router) -> None:
    job = cluster.submit("replicas-steps.sbatch", {**REPLICA_ENV, "RESTART_DELAY_S": "1"}, "--nodes=1")
    name = f"replica-{cluster.slurm.node}"
    wait_for(lambda: router.states().get(name) == "up", START_S, f"{name} up", lambda: cluster.log(job))
    assert_no_token_on_a_command_line(cluster, job, router.token)

    kill_rank(cluster, job, 1)  # the step fails: its loop starts it again
    wait_for(lambda: "starting it again" in cluster.log(job), 60, "step restarted", lambda: cluster.log(job))
    wait_for(lambda: router.states().get(name) == "up", START_S, f"{name} up again", lambda: cluster.log(job))
    serve_one_session(router.endpoint, token=router.client_token)

    cluster.stop(job)
    info = cluster.ended(job)
    log = cluster.log(job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]
    assert "rank 0 shut down cleanly" in log, log[-4000:]  # the step drained: rank 0 closed every rank itself


def test_a_replica_without_a_router_endpoint_fails_at_once_saying_so(cluster: Cluster, tmp_path: Path) -> None:
    env = {**REPLICA_ENV, "ROUTER_FILE": str(tmp_path / "no-router-endpoint")}
    array = cluster.submit("replicas-array.sbatch", env, "--array=0")
    steps = cluster.submit("replicas-steps.sbatch", env, "--nodes=1")
    for job in (f"{array}_0", steps):
        info = cluster.ended(job, timeout_s=120)
        assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "2:0", "0"), cluster.log(job)
        assert "no router endpoint" in cluster.log(job)
        assert not cluster.processes(job)


def test_a_replica_with_a_configuration_error_fails_once_and_is_not_requeued(cluster: Cluster) -> None:
    env = {**REPLICA_ENV, "ROUTER": "tcp://127.0.0.1:1"}
    task = f"{cluster.submit('replicas-array.sbatch', env, '--array=0', args=('--server.no_such_key=1',))}_0"
    info = cluster.ended(task, timeout_s=120)
    log = cluster.log(task)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "2:0", "0"), log
    assert "no_such_key" in log and "a configuration error): not requeued" in log, log


def test_split7_torchrun_serves_is_requeued_when_a_rank_dies_and_a_stop_ends_it_completed(
        cluster: Cluster, early: dict[str, Serving]) -> None:
    torchrun = early["torchrun"]
    job = torchrun.job
    serve_one_session(torchrun.endpoint())
    torchrun.port_file.unlink()

    kill_rank(cluster, job, 1)
    wait_for(lambda: cluster.job(job).get("Restarts") == "1", 90, "job requeued", lambda: cluster.log(job))
    serve_one_session(torchrun.endpoint())

    cluster.stop(job)
    info = cluster.ended(job)
    log = cluster.log(job)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), log[-4000:]
    assert f"requeueing job {job}" in log and "stopped on request" in log, log[-4000:]


def rank_task(cluster: Cluster, job: str, rank: int) -> int:
    [pid] = cluster.processes(job, SLURM_STEP_ID="0", SLURM_PROCID=str(rank))
    return pid


def test_split7_srun_starts_7_tasks_serves_and_a_killed_rank_ends_every_rank_and_the_job_failed(
        cluster: Cluster, early: dict[str, Serving]) -> None:
    job, endpoint = early["srun7"].job, early["srun7"].endpoint()
    assert len(cluster.processes(job, SLURM_STEP_ID="0")) == 7  # seven tasks, one per rank, no torchrun
    with Client(endpoint) as client:
        info = client.open(IMAGE, num_chunks=2)
        for index in range(2):
            client.control(info.id, index, keys="a")
        assert [c.index for c in client.chunks(info.id, timeout_s=30)] == [0, 1]
        os.kill(rank_task(cluster, job, 4), signal.SIGKILL)
        error = client.error(timeout_s=DEAD_S + 10)
    state = cluster.ended(job, timeout_s=30)
    assert state["JobState"] == "FAILED" and state["ExitCode"] != "0:0", cluster.log(job)
    assert error is not None and error.code == "rank_failed" and "rank 4" in error.message
    assert not cluster.processes(job)


def test_split7_srun_a_frozen_dit_rank_mid_stream_ends_every_rank_within_its_deadline(
        cluster: Cluster, early: dict[str, Serving]) -> None:
    job, endpoint = early["srun-freeze"].job, early["srun-freeze"].endpoint()
    with Client(endpoint) as client:
        info = client.open(IMAGE, num_chunks=200)
        for index in range(5):  # accepted as the stream moves: chunks 3 and 4 are in flight when the rank freezes
            client.control(info.id, index, keys="w")
        chunks = client.chunks(info.id, timeout_s=30)
        assert [next(chunks).index for _ in range(3)] == [0, 1, 2]
        frozen = time.monotonic()
        os.kill(rank_task(cluster, job, 1), signal.SIGSTOP)  # the DiT rank: alive to the kernel, silent to peers
        error = client.error(timeout_s=DEAD_S + 10)
        to_error = time.monotonic() - frozen
    state = cluster.ended(job, timeout_s=DEAD_S + 30)
    to_end = time.monotonic() - frozen
    print(f"\nsrun -n2, SIGSTOP rank 1 mid-stream (rank_dead_s {DEAD_S:.0f}): client error after {to_error:.2f} s, "
          f"job {state['JobState']} after {to_end:.2f} s")
    assert error is not None and error.code == "rank_failed" and "rank 1" in error.message, error
    assert state["JobState"] == "FAILED", cluster.log(job)
    assert not cluster.processes(job)
    assert to_end < DEAD_S + 10, to_end


def test_split7_srun_a_stop_ends_it_completed(cluster: Cluster, early: dict[str, Serving]) -> None:
    job = early["srun-stop"].job
    serve_one_session(early["srun-stop"].endpoint())
    cluster.stop(job)
    info = cluster.ended(job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), cluster.log(job)


def test_a_stopped_replica_task_hands_its_sessions_to_the_other_and_ends_completed(
        cluster: Cluster, router: Router) -> None:  # fmt: skip
    """The drain under Slurm: ``scancel --batch --signal=TERM`` of the replica task holding sessions (the recipe's
    trap forwards it to launch.py, which forwards it to rank 0): each of its sessions goes on on the other task under
    its own id (both read the checkout's out/snapshots), and the stopped task ends COMPLETED 0:0."""
    array = cluster.submit("replicas-array.sbatch", REPLICA_ENV, "--array=0-1")
    tasks = {f"replica-{array}-{i}": f"{array}_{i}" for i in (0, 1)}
    wait_for(lambda: all(router.states().get(name) == "up" for name in tasks), START_S, "both replicas up",
             lambda: "\n".join(cluster.log(task) for task in tasks.values()))
    with Client(router.endpoint, timeout_s=60, token=router.client_token) as client:
        sessions = [client.open(IMAGE, num_chunks=6).id for _ in range(3)]
        for sid in sessions:
            client.control(sid, 0, keys="w")
            assert client.next_chunk(sid, timeout_s=60).index == 0
        holders = {sid: client.stats().per_session[sid].replica for sid in sessions}
        drained = holders[sessions[0]]
        cluster.stop(tasks[drained])
        for sid in sessions:
            resume = 1
            if holders[sid] == drained:
                with pytest.raises(SessionMigrated) as moved:
                    client.next_chunk(sid, timeout_s=60)
                assert moved.value.session == sid and moved.value.replica != drained and moved.value.chunk == 1
            indices = []
            for index in range(resume, 6):
                client.control(sid, index, keys="w")
                indices.append(client.next_chunk(sid, timeout_s=60).index)
            assert indices == list(range(1, 6))
        info = cluster.ended(tasks[drained])
        log = cluster.log(tasks[drained])
        assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]
        moved_here = sum(holder == drained for holder in holders.values())
        assert f"every session handed off ({moved_here} of {moved_here})" in log, log[-4000:]
    for name, task in tasks.items():
        if name != drained:
            cluster.stop(task)
            assert cluster.ended(task)["JobState"] == "COMPLETED", cluster.log(task)
