"""A real single-node Slurm in a temporary folder: munged, slurmctld and slurmd, started as root without systemd.

    python scripts/slurm_local.py            # start one, print `export SLURM_CONF=...`, Ctrl-C stops it

The tests' session fixture (``tests/test_slurm.py``) uses ``LocalSlurm`` the same way. Everything lives in the
folder: the munge key and socket, ``slurm.conf`` and ``gres.conf``, state, spool and the daemons' logs; nothing
reads /etc/slurm (every Slurm command is pointed at the folder's config by ``SLURM_CONF``). The daemons run in the
foreground as this process's children, so each is stopped by its own pid. The node claims more CPUs and GPUs than
the machine has (``SlurmdParameters=config_overrides``) so the recipes' ``--cpus-per-task`` and GPU counts are
accepted on two cores; its GPUs are character devices (``/dev/null``'s numbers) listed in ``gres.conf``, so Slurm
still sets ``CUDA_VISIBLE_DEVICES`` per task. ``proctrack/linuxproc`` does not reap children a job re-parented,
so ``stop`` also ends every process whose environment names this folder's config.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from scripts.ports import free_port

DAEMONS = {"munged": "/usr/sbin/munged", "slurmctld": "/usr/sbin/slurmctld", "slurmd": "/usr/sbin/slurmd"}
CLIENTS = ("sbatch", "srun", "scontrol", "scancel", "sinfo")
NODE_CPUS = 1024  # claimed, not real: every recipe's --cpus-per-task fits, for several jobs at once
NODE_GPUS = 64  # fake devices: the tests run a handful of 7-GPU jobs side by side
UP_TIMEOUT_S = 60.0
CRED_EXPIRE_S = 10


def missing() -> list[str]:
    """What this machine lacks to run a local Slurm (empty when it can); the reason the Slurm tests skip."""
    lacks = [path for path in DAEMONS.values() if not os.access(path, os.X_OK)]
    lacks += [name for name in CLIENTS if shutil.which(name) is None]
    if os.geteuid() != 0:
        lacks.append("root (slurmd starts jobs as their user and needs root)")
    return lacks


def slurm_conf(folder: Path, node: str, ctld_port: int, slurmd_port: int) -> str:
    # cred_expire: a requeued batch job waits this long (+1 s) before it may start again; Slurm's 120 s default
    # would be most of the tests' time. Still ample for a step's launch credential on a loaded machine.
    munge = f"socket={folder / 'munge' / 'munge.socket'},cred_expire={CRED_EXPIRE_S}"
    return "\n".join([
        "ClusterName=worldstream-test",
        f"SlurmctldHost={node}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo={munge}",
        f"StateSaveLocation={folder / 'state'}",
        f"SlurmdSpoolDir={folder / 'spool'}",
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
        f"SlurmdPidFile={folder / 'slurmd.pid'}",
        f"SlurmctldLogFile={folder / 'slurmctld.log'}",
        f"SlurmdLogFile={folder / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc",  # no cgroups in a container
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SlurmdParameters=config_overrides",  # believe the node line below, not the hardware
        "GresTypes=gpu",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "ReturnToService=2",
        "MinJobAge=3600",  # ended jobs stay visible to `scontrol show job` for the tests' asserts
        "KillWait=5",
        "SchedulerParameters=sched_interval=1",
        "InactiveLimit=0",
        "Waittime=0",
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs={NODE_CPUS} Sockets=1 CoresPerSocket={NODE_CPUS} "
        f"ThreadsPerCore=1 Gres=gpu:{NODE_GPUS} State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


class LocalSlurm:
    """munged + slurmctld + slurmd in ``folder`` (a fresh temporary one by default); a context manager."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = Path(folder or tempfile.mkdtemp(prefix="worldstream-slurm-"))
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.folder / "slurm.conf"
        self.daemons: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def env(self) -> dict[str, str]:
        """The environment a Slurm command (and, through sbatch's --export=ALL, a job) needs to reach this one."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> LocalSlurm:
        lacks = missing()
        if lacks:
            raise RuntimeError(f"cannot start a local Slurm: missing {', '.join(lacks)}")
        for sub in ("munge", "state", "spool", "gpus"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.folder / "munge", 0o700)
        key = self.folder / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        for index in range(NODE_GPUS):
            device = self.folder / "gpus" / f"fakegpu{index}"
            if not device.exists():
                os.mknod(device, 0o666 | 0o020000, os.makedev(1, 3))  # a character device: /dev/null's numbers
        self.conf.write_text(slurm_conf(self.folder, self.node, free_port(), free_port()))
        (self.folder / "gres.conf").write_text(
            f"NodeName={self.node} Name=gpu File={self.folder / 'gpus'}/fakegpu[0-{NODE_GPUS - 1}]\n")
        munge = self.folder / "munge"
        self._spawn("munged", [DAEMONS["munged"], "-F", "--force", f"--key-file={key}",
                               f"--socket={munge / 'munge.socket'}", f"--pid-file={munge / 'munged.pid'}",
                               f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}"])
        self._wait(lambda: (munge / "munge.socket").exists(), "munged's socket")
        self._spawn("slurmctld", [DAEMONS["slurmctld"], "-D", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", [DAEMONS["slurmd"], "-D", "-f", str(self.conf), "-N", self.node])
        self._wait(self._node_idle, f"node {self.node} idle")
        return self

    def _spawn(self, name: str, command: list[str]) -> None:
        log = open(self.folder / f"{name}.out", "wb")  # noqa: SIM115 - the daemon holds it; closed at its end
        # its own session: a Ctrl-C in the terminal reaches this script, which stops the daemons in order
        self.daemons[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                              start_new_session=True)
        log.close()

    def _wait(self, ready: object, what: str) -> None:
        deadline = time.monotonic() + UP_TIMEOUT_S
        while not ready():  # type: ignore[operator]
            for name, process in self.daemons.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode} before {what}:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} after {UP_TIMEOUT_S:.0f} s:\n{self.logs()}")
            time.sleep(0.2)

    def _node_idle(self) -> bool:
        state = self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.strip()
        return state == "idle"

    def run(self, *command: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """A Slurm client command against this cluster."""
        return subprocess.run(list(command), env=self.env, capture_output=True, text=True, check=check,
                              timeout=timeout)

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log", "munge/munged.log", "munged.out", "slurmctld.out", "slurmd.out"):
            path = self.folder / name
            if path.exists():
                parts.append(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-20:]))
        return "\n".join(parts)

    def job_processes(self) -> list[int]:
        """Pids of every process started for this cluster's jobs (their environment names its config)."""
        marker = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker in environ and b"SLURM_JOB_ID" in b"\0".join(environ):
                found.append(int(entry.name))
        daemons = {process.pid for process in self.daemons.values()}
        return [pid for pid in found if pid not in daemons]

    def stop(self) -> None:
        """Cancel every job, stop each daemon by its pid (slurmd, slurmctld, munged), then end what jobs left."""
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            self.run("scancel", "--full", "--user=root", check=False)  # the batch shells too, not only the steps
        for name in ("slurmd", "slurmctld", "munged"):
            process = self.daemons.get(name)
            if process is None or process.poll() is not None:
                continue
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        deadline = time.monotonic() + 10
        while (left := self.job_processes()) and time.monotonic() < deadline:
            for pid in left:  # re-parented leftovers linuxproc never reaped
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)  # a killed process stays listed until the kernel has torn it down

    def __enter__(self) -> LocalSlurm:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()


def main() -> int:
    with LocalSlurm() as slurm:
        print(f"export SLURM_CONF={slurm.conf}   # Ctrl-C stops the cluster", flush=True)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    return 0


if __name__ == "__main__":
    sys.exit(main())
