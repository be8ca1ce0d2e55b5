"""Rank processes on one host, with real processes: rank 0's watch names a dead rank (reaped or a zombie) and ends
the others; a process armed with ``die_with_parent`` does not outlive its parent; reports that end the job wait
briefly for the dead rank to show."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import psutil

from ranks.processes import DeathHold, RankWatch
from runtime import core_types as ct

HOST = socket.gethostname()


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_the_watch_names_a_killed_rank_whether_reaped_or_a_zombie_and_ends_the_rest() -> None:
    ranks = {rank: sleeper() for rank in (1, 2, 3)}
    try:
        watch = RankWatch()
        for rank, process in ranks.items():
            watch.add(rank, process.pid, HOST)
        watch.add(4, os.getpid(), HOST)  # rank 0's own process is never watched
        watch.add(5, ranks[1].pid, "another-host")  # nor one on another host
        assert watch.dead() == []
        ranks[2].kill()
        ranks[2].wait()  # reaped
        ranks[3].kill()
        deadline = time.monotonic() + 10
        while psutil.Process(ranks[3].pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.01)  # a zombie: dead, not yet reaped
        dead = watch.dead()
        assert [rank for rank, _ in dead] == [2, 3]  # the reaped one first: a launcher reaps the first to die
        assert f"its process {ranks[2].pid} exited or was killed" in dead[0][1]
        watch.end_others()
        assert ranks[1].wait(timeout=10) == -signal.SIGKILL
    finally:
        for process in ranks.values():
            process.kill()
            process.wait()


ARMED_CHILD = """
import subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c",
    "from ranks.processes import die_with_parent; import signal, time; die_with_parent(signal.SIGKILL); "
    "print('armed', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
grandchild.stdout.readline()
print(grandchild.pid, flush=True)
time.sleep(60)
"""


def test_a_process_armed_to_die_with_its_parent_does_not_outlive_it() -> None:
    child = subprocess.Popen([sys.executable, "-c", ARMED_CHILD], stdout=subprocess.PIPE,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        assert child.stdout is not None
        grandchild = psutil.Process(int(child.stdout.readline()))
        child.kill()
        child.wait()
        gone, _ = psutil.wait_procs([grandchild], timeout=10)
        assert gone, "the armed grandchild outlived its parent"
    finally:
        child.kill()
        child.wait()


def test_reports_that_end_the_job_wait_for_the_dead_rank_which_is_named_first() -> None:
    hold, dead = DeathHold(0.5), []
    report, tick = ct.RankLost("rank 5: connection reset by peer"), ct.Tick()
    assert hold.sift([report, tick], lambda: dead, 0.0) == ([], [tick])  # held: the dead rank may show any moment
    dead.append(ct.RankLost("rank 4 (denoise) died"))
    assert hold.sift([], lambda: dead, 0.1) == (dead, [report])  # the rank that died goes first


def test_a_held_report_goes_on_by_itself_when_no_dead_rank_shows() -> None:
    hold, report = DeathHold(0.5), ct.RankLost("rank 3: stage failed inside a collective")
    assert hold.sift([report], list, 0.0) == ([], [])
    assert hold.sift([], list, 0.4) == ([], [])
    assert hold.sift([], list, 0.6) == ([], [report])
    assert hold.sift([ct.Tick()], list, 0.7) == ([], [ct.Tick()])  # nothing held any more
