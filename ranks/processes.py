"""The processes of a job on this host: a rank dies with its parent, and rank 0 watches the others.

- ``die_with_parent``: Linux ``PR_SET_PDEATHSIG``, so no process of the job outlives the one that started it: the
  launcher's torchrun dies with the launcher, every rank with torchrun (or ``srun``'s step daemon). Without it, a
  killed ``python launch.py`` left torchrun and seven ranks serving the port with no owner.
- ``RankWatch``: rank 0's own view of the ranks on its host (their pids arrive in each worker's ``Hello``). A rank
  whose process is gone is named at once, before the errors its surviving peers report (a peer's "connection reset"
  names the peer, not the dead rank); when the job fails, the ranks still on this host are killed, so a frozen
  (``SIGSTOP``) or stuck rank cannot hold the job open for the launcher's grace period.
- ``DeathHold``: reports that end the job wait briefly for the rank that died to show, so the error names it.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from ipc import protocol
from runtime import core_types as ct

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: int) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux; elsewhere a no-op)."""
    if sys.platform != "linux":
        return
    parent = os.getppid()
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            log.warning("PR_SET_PDEATHSIG failed (errno %d): this process may outlive its launcher", ctypes.get_errno())
            return
    except (OSError, AttributeError):  # no prctl: nothing to arm
        return
    if os.getppid() != parent:  # the parent died before the signal was armed
        os.kill(os.getpid(), sig)


@dataclass(frozen=True)
class RankProcess:
    rank: int
    process: psutil.Process  # holds the creation time: a pid reused by another process is never mistaken for it


class RankWatch:
    """The rank processes rank 0 can see on its own host."""

    def __init__(self) -> None:
        self.host = socket.gethostname()
        self.ranks: dict[int, RankProcess] = {}

    def add(self, rank: int, pid: int, host: str) -> None:
        if pid <= 0 or pid == os.getpid() or host != self.host:
            return
        try:
            self.ranks[rank] = RankProcess(rank, psutil.Process(pid))
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # gone already: the failure reaches us otherwise
            return

    def dead(self) -> list[tuple[int, str]]:
        """``(rank, why)`` of the local ranks whose process is gone (exited, killed, a zombie not yet reaped), the
        ones already reaped first: a launcher reaps the rank that failed before it kills (and reaps) the rest, so
        when the teardown is already under way the reaped rank is the one that died first."""
        out: list[tuple[bool, int, str]] = []
        for rank in self.ranks.values():
            try:  # is_running is False for a reaped process, and for its pid taken by another one
                status = rank.process.status() if rank.process.is_running() else psutil.STATUS_DEAD
            except psutil.NoSuchProcess:
                status = psutil.STATUS_DEAD
            except psutil.AccessDenied:
                continue
            if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                why = f"its process {rank.process.pid} exited or was killed"
                out.append((status != psutil.STATUS_DEAD, rank.rank, why))
        return [(rank, why) for _, rank, why in sorted(out)]

    def end_others(self) -> None:
        """The job has failed: kill every other rank on this host now (SIGKILL works on a stopped process too),
        instead of leaving them to the launcher, which waits out its grace period for a frozen one."""
        for rank in self.ranks.values():
            try:
                rank.process.kill()  # psutil refuses a pid reused by another process
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            log.info("ended rank %d (pid %d)", rank.rank, rank.process.pid)


def breaks_the_job(event: ct.Event) -> bool:
    if isinstance(event, ct.WorkerSent):
        return isinstance(event.message, protocol.TaskFailed) and event.message.fatal
    return isinstance(event, ct.RankLost)


class DeathHold:
    """A broken collective is reported by the survivors in their own name, often within microseconds of a peer's
    death and before its process is seen gone. Such reports wait up to ``hold_s`` for the dead rank to show (looked
    for first), so the job's error names the rank that died, not the first peer that noticed."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.withheld: list[ct.Event] = []
        self.until = math.inf

    def sift(self, arrived: list[ct.Event], dead: Callable[[], list[ct.Event]],
             now: float) -> tuple[list[ct.Event], list[ct.Event]]:  # fmt: skip
        """(the dead ranks found: they go first, what goes on now); job-ending reports are held while none shows."""
        arrived, self.withheld = self.withheld + arrived, []
        if not any(breaks_the_job(e) for e in arrived):
            return [], arrived
        found = dead()
        if found or now >= self.until:
            self.until = math.inf
            return found, arrived
        self.until = min(self.until, now + self.hold_s)
        self.withheld = [e for e in arrived if breaks_the_job(e)]
        return [], [e for e in arrived if not breaks_the_job(e)]
