"""Faults and abuse on the real 7-rank CPU layout: no message kills the server, one session's bad state stays in
that session, a dead or frozen rank is named and ends the job fast, and no process of the job outlives it. The
times measured (fault to client error, fault to the exit of every process; rank 0's memory under a huge frame)
are printed as a table and saved to out/faults.json.

Abuse cases run on the session's shared server (``tests/conftest.py``); each rank fault starts its own. Bounds
are generous for a busy 2-core machine but far below the old behaviour they guard against (a frozen DiT rank kept
the job alive 35 s; a killed launcher orphaned the whole job).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import psutil
import pytest
import zmq

from ipc import protocol
from ipc.client import BadRequest, Client, ServerError, ServerGone, input_state
from scripts.local_server import ROOT, LocalServer, ServerFailed
from tests.shared import FAST, read_server

pytestmark = pytest.mark.multiprocess

IMAGE = (ROOT / "assets" / "start.png").read_bytes()
DEAD_S = 3.0  # timeouts.rank_dead_s of the fault servers
# From a rank's silence to the exit of every process. The issue asks for DEAD_S + 5 (measured: about DEAD_S + 1 on a
# quiet machine); the slack is for two shared cores under load, where this is a bound against hangs, not a timing.
EXIT_BOUND_S = DEAD_S + 10


MEASURED: dict[str, dict[str, float]] = {}  # case -> seconds (or bytes), for the table


@pytest.fixture
def server(shared_server: LocalServer) -> LocalServer:
    return shared_server


@pytest.fixture(scope="module", autouse=True)
def fault_table() -> Iterator[None]:
    yield
    if not MEASURED:
        return
    (ROOT / "out").mkdir(exist_ok=True)
    (ROOT / "out" / "faults.json").write_text(json.dumps(MEASURED, indent=1))
    print()
    for case, facts in MEASURED.items():
        print(f"{case}: " + ", ".join(f"{name} {value:.2f}" for name, value in facts.items()))


def wait_logged(server: LocalServer, text: str, timeout_s: float, beat: zmq.Socket | None = None) -> bool:
    """Whether ``text`` appears in the server log within ``timeout_s`` (what no other client may see in stats);
    ``beat``: a raw socket kept alive meanwhile with heartbeats (and never read)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in server.log_path.read_text(errors="replace"):
            return True
        if beat is not None:
            beat.send(enc(type="heartbeat"), zmq.NOBLOCK)
        time.sleep(0.1)
    return False


def raw_socket(endpoint: str, **options: int) -> zmq.Socket:
    """A DEALER on the raw protocol; ``options`` are socket options set before connecting (buffers only apply to
    connections made after them)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(endpoint)
    return sock


def reply(sock: zmq.Socket, timeout_s: float = 30.0) -> object:
    assert sock.poll(int(timeout_s * 1000)), "no reply"
    return read_server(sock)


def rss(pid: int, field: str = "VmRSS") -> int:
    """The process's resident memory now (``VmRSS``) or its peak so far (``VmHWM``), bytes: read when asked, not
    as of rank 0's last memory sample."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")


def peak_rss(pid: int) -> int:
    return rss(pid, "VmHWM")


def enc(**fields: object) -> bytes:
    return msgspec.msgpack.encode({"v": protocol.PROTOCOL_VERSION, **fields})


# ------------------------------------------------------------------------------------------------ abuse


def test_no_message_kills_the_server_and_each_gets_a_clear_bounded_error(server: LocalServer) -> None:
    stats_with_x = msgspec.msgpack.encode({"v": 2, "type": "stats", "req": 1, "x": 0})
    cases = [
        (b"\x91" * 2000 + b"\x00", "must be a msgpack map"),  # a list 2000 deep: a few kilobytes
        (stats_with_x[:-1] + b"\x91" * 5000 + b"\x00", "nests deeper"),  # a valid stats with a field 5000 deep
        (msgspec.msgpack.encode({"type": "stats", "req": 1}), "no protocol version"),
        (enc(type="close", req=1, session="s" * (15 * 2**20)), "length <= 64"),  # must not be echoed back
        (b"", "not a msgpack message"),
    ]
    sock = raw_socket(server.endpoint)
    try:
        for data, text in cases:
            sock.send(data)
            error = reply(sock)
            assert isinstance(error, protocol.Error) and error.code == "bad_message" and text in error.message
            assert len(error.message) <= protocol.MAX_ERROR_CHARS and " at 0x" not in error.message
        sock.send_multipart([enc(type="stats", req=7), b"second frame"])
        error = reply(sock)
        assert isinstance(error, protocol.Error) and error.code == "bad_message" and "one ZeroMQ frame" in error.message
        sock.send(enc(type="open", req=8, image=b"GIF89a not really"))  # the decoder's text (object reprs) not echoed
        error = reply(sock)
        assert isinstance(error, protocol.Error) and error.code == "bad_image" and " at 0x" not in error.message
    finally:
        sock.close()
    with Client(server.endpoint) as client:
        assert client.stats().layout == "cpu-tiny"  # still serving


def test_a_huge_frame_is_dropped_before_it_is_buffered(server: LocalServer) -> None:
    with Client(server.endpoint) as client:
        rank0 = server.ranks()[0].pid
        before, peak_before = rss(rank0), peak_rss(rank0)
        sock = raw_socket(server.endpoint)
        try:
            sock.send(enc(type="open", req=1, image=b"\0" * (16 * 2**20 + 4096)))  # just over: read and refused
            error = reply(sock)
            assert isinstance(error, protocol.Error) and "exceeds the limit" in error.message
            sock.send(b"\0" * (256 * 2**20))  # far over: the connection is dropped, nothing is buffered
            assert not sock.poll(2000)
        finally:
            sock.close()
        after, peak_after = rss(rank0), peak_rss(rank0)  # read now: no memory sample to wait for
        MEASURED["huge frame (256 MiB): rank 0 RSS / peak RSS, MiB"] = {
            "rss_before_mib": before / 2**20, "rss_after_mib": after / 2**20,
            "peak_before_mib": peak_before / 2**20, "peak_after_mib": peak_after / 2**20}
        assert after - before < 64 * 2**20 and peak_after - peak_before < 64 * 2**20
        info = client.open(IMAGE, num_chunks=2)  # and it serves on
        for index in range(2):
            client.control(info.id, index, keys="w")
        assert [c.index for c in client.chunks(info.id, timeout_s=60)] == [0, 1]


def test_extreme_poses_are_refused_or_streamed_never_fatal(server: LocalServer) -> None:
    far = [1.0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, -1500.0, 0, 0, 0, 1]  # valid: the camera far out (overflowed before)
    with Client(server.endpoint) as client:
        info = client.open(IMAGE, num_chunks=2)
        client.control(info.id, 0, poses=[far] * 9)
        with pytest.raises(BadRequest, match="translation must stay within"):
            client.control(info.id, 1, poses=[[*far[:11], 2.0**512, *far[12:]]] * 12)
        with pytest.raises(BadRequest, match="orthonormal"):
            client.control(info.id, 1, poses=[[2.0, *far[1:11], 0.0, *far[12:]]] * 12)
        client.control(info.id, 1, poses=[far] * 12)
        assert [c.index for c in client.chunks(info.id, timeout_s=60)] == [0, 1]
    sock = raw_socket(server.endpoint)  # the same refusal from the server itself, not only from the SDK
    try:
        with Client(server.endpoint) as owner:
            sid = owner.open(IMAGE, num_chunks=1).id
        sock.send(enc(type="control", req=3, session=sid, index=0,
                      control={"poses": [[*far[:11], 2.0**512, *far[12:]]] * 9}))  # fmt: skip
        error = reply(sock)
        assert isinstance(error, protocol.Error) and error.code == "bad_message" and "translation" in error.message
    finally:
        sock.close()


def test_stats_show_a_client_only_its_own_sessions(server: LocalServer) -> None:
    with Client(server.endpoint) as alice, Client(server.endpoint) as bob:
        mine = alice.open(IMAGE, num_chunks=3).id
        theirs = bob.open(IMAGE, num_chunks=3).id
        seen = alice.stats()
        assert list(seen.per_session) == [mine] and seen.open_sessions >= 2
        assert theirs not in str(seen)
        alice.close(mine)
        bob.close(theirs)


def test_a_second_close_while_draining_is_answered(server: LocalServer) -> None:
    sock = raw_socket(server.endpoint)  # the raw protocol: every request gets its reply
    try:
        sock.send(enc(type="open", req=1, image=IMAGE))
        opened = reply(sock)
        assert isinstance(opened, protocol.Opened)
        sock.send(enc(type="control", req=2, session=opened.session, index=0))
        sock.send(enc(type="close", req=3, session=opened.session))
        sock.send(enc(type="close", req=4, session=opened.session))
        answers: list[object] = []
        while not any(isinstance(a, protocol.Closed) for a in answers):
            answers.append(reply(sock))
        errors = [a for a in answers if isinstance(a, protocol.Error)]
        assert [(e.req, e.code) for e in errors] == [(4, "closing")], answers
        sock.send(enc(type="close", req=5, session=opened.session))  # after the close: gone
        error = reply(sock)
        assert isinstance(error, protocol.Error) and (error.req, error.code) == (5, "unknown_session")
    finally:
        sock.close()


def test_a_vanished_client_has_its_session_closed_and_released(server: LocalServer) -> None:
    client = Client(server.endpoint)
    info = client.open(IMAGE, num_chunks=None)
    client.control(info.id, 0, keys="w")
    client.close_client()  # no close, no more heartbeats
    began = time.monotonic()
    assert wait_logged(server, f"session {info.id} closed (disconnect)", 15)
    MEASURED["client vanishes (client_timeout_s 2): session closed after"] = {"to_error_s": time.monotonic() - began}


def test_a_client_that_stops_reading_is_dropped_not_buffered(server: LocalServer) -> None:
    sock = raw_socket(server.endpoint, RCVHWM=1, RCVBUF=4096)
    try:  # a live session with a held key streams by itself, endlessly: it stays open unless it is dropped
        sock.send(enc(type="open", req=1, image=IMAGE, live=True))
        opened = reply(sock)
        assert isinstance(opened, protocol.Opened)
        sock.send(enc(type="control_state", req=2, session=opened.session, keys=["w"], revision=1))
        # then it never reads again, only beats (not silent, not gone): its queue on the server fills
        began = time.monotonic()
        assert wait_logged(server, f"session {opened.session}: client stopped reading", 60, beat=sock)
        MEASURED["client stops reading (send_hwm 4): dropped after"] = {"to_error_s": time.monotonic() - began}
        assert wait_logged(server, f"session {opened.session} closed (disconnect)", 10)
        told = None  # it is told why, once it reads again: after what its queue held (ipc.client_lines)
        while not isinstance(told, protocol.Error):
            told = reply(sock, timeout_s=10)
        assert (told.code, told.session) == ("not_reading", opened.session), told
    finally:
        sock.close()


# ------------------------------------------------------------------------------------------------ rank faults


def job_processes(server: LocalServer) -> list[psutil.Process]:
    assert server.process is not None
    launcher = psutil.Process(server.process.pid)
    return [launcher, *launcher.children(recursive=True)]


def running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(processes: list[psutil.Process], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    alive = processes
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if running(p)]
        time.sleep(0.05)
    return [p.pid for p in alive]


def fault(rank: int, sig: int, mid_stream: bool, tmp_path: Path,
          silent_s: float = 10.0) -> tuple[ServerError | None, float, float, str]:
    """Start a job, hurt ``rank`` with ``sig`` (while a session streams, or while it is idle); the client's error,
    seconds to that error and to the exit of every process, and the server log. ``silent_s``: the client's
    ``server_silent_s`` (short only where the server's silence is what is tested)."""
    overrides = [*FAST, f"--timeouts.rank_dead_s={DEAD_S}"]
    with LocalServer("cpu-tiny", overrides, log_path=tmp_path / "server.log") as server, \
            Client(server.endpoint, server_silent_s=silent_s) as client:  # fmt: skip
        if mid_stream:  # a live session with a key held streams without end: every stage has work in flight
            info = client.open(IMAGE, live=True)
            client.control_state(info.id, input_state(["w"], revision=1))
            for _ in range(3):
                client.next_chunk(info.id, timeout_s=30)
        else:  # one chunk, then nothing to do
            info = client.open(IMAGE, num_chunks=None)
            client.control(info.id, 0, keys="w")
            client.next_chunk(info.id, timeout_s=30)
        processes = job_processes(server)
        began = time.monotonic()
        os.kill(server.ranks()[rank].pid, sig)
        error = client.error(timeout_s=20)
        to_error = time.monotonic() - began
        left = wait_gone(processes, 30)
        to_exit = time.monotonic() - began
        assert not left, f"processes {left} outlived the job"
        return error, to_error, to_exit, server.log()


@pytest.mark.parametrize(("rank", "role", "mid_stream"), [
    (1, "decode", True), (2, "denoise", True), (4, "denoise", True), (1, "decode", False), (4, "denoise", False)])
def test_a_killed_rank_is_named_and_the_job_ends_fast(tmp_path: Path, rank: int, role: str, mid_stream: bool) -> None:
    error, to_error, to_exit, log = fault(rank, signal.SIGKILL, mid_stream, tmp_path)
    MEASURED[f"SIGKILL rank {rank} ({role}), {'mid-stream' if mid_stream else 'idle'}"] = {
        "to_error_s": to_error, "to_exit_s": to_exit}
    assert error is not None and error.code == "rank_failed", error
    assert f"rank {rank} ({role}) died" in error.message, error.message
    assert f"rank {rank} ({role}) died" in log
    assert to_error < 5 and to_exit < 15, (to_error, to_exit)


def test_a_frozen_dit_rank_ends_the_job_within_its_deadline(tmp_path: Path) -> None:
    error, to_error, to_exit, _ = fault(4, signal.SIGSTOP, True, tmp_path)
    MEASURED[f"SIGSTOP rank 4 (denoise), mid-stream, rank_dead_s {DEAD_S:.0f}"] = {
        "to_error_s": to_error, "to_exit_s": to_exit}
    assert error is not None and "rank 4 stopped answering" in error.message, error
    assert to_exit < EXIT_BOUND_S, to_exit


def test_a_killed_coordinator_is_noticed_by_the_client_from_missed_heartbeats(tmp_path: Path) -> None:
    error, to_error, to_exit, _ = fault(0, signal.SIGKILL, True, tmp_path, silent_s=3.0)
    MEASURED["SIGKILL rank 0 (coordinator, condition), mid-stream, server_silent_s 3"] = {
        "to_error_s": to_error, "to_exit_s": to_exit}
    assert isinstance(error, ServerGone) and error.code == "server_gone", error
    assert to_error < 3.0 + 3 and to_exit < 15, (to_error, to_exit)


def test_a_killed_launcher_leaves_no_process_and_frees_the_port(tmp_path: Path) -> None:
    with LocalServer("cpu-tiny", FAST, log_path=tmp_path / "server.log") as server:
        processes = job_processes(server)
        assert len(processes) >= 9  # launcher, torchrun, 7 ranks
        began = time.monotonic()
        server.process.send_signal(signal.SIGKILL)
        assert not wait_gone(processes, 15)
        MEASURED["SIGKILL of python launch.py (every process gone)"] = {"to_exit_s": time.monotonic() - began}
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", server.port))


def test_a_stage_past_its_deadline_ends_the_job_naming_the_ranks(tmp_path: Path) -> None:
    overrides = [*FAST, "--model.kind=tests.faulty_backend:build", "--timeouts.stage_s=2"]
    with LocalServer("cpu-tiny", overrides, log_path=tmp_path / "server.log") as server, \
            Client(server.endpoint) as client:  # fmt: skip
        processes = job_processes(server)
        info = client.open(IMAGE, prompt="HANG:denoise:1", num_chunks=4)
        for index in range(4):
            client.control(info.id, index, keys="w")
        assert client.next_chunk(info.id, timeout_s=30).index == 0  # chunk 1's denoise never ends
        began = time.monotonic()  # about when chunk 1's denoise was sent
        error = client.error(timeout_s=30)
        to_error = time.monotonic() - began
        assert error is not None and error.code == "rank_failed", error
        # the DiT leader (rank 2) answers for its group
        assert f"rank 2 did not finish the denoise of chunk 1 of session {info.id} within 2 s" in error.message, error
        assert server.wait(30) != 0
        assert not wait_gone(processes, 15)  # the sleeping DiT ranks were ended, not left holding the job
        MEASURED["denoise hangs past timeouts.stage_s 2 (from chunk 0's arrival)"] = {
            "to_error_s": to_error, "to_exit_s": time.monotonic() - began}


def test_a_rank_that_never_reports_in_fails_the_start_after_startup_s(tmp_path: Path) -> None:
    overrides = [*FAST, "--model.kind=tests.faulty_backend:build_never_ready", "--timeouts.startup_s=5"]
    server = LocalServer("cpu-tiny", overrides, log_path=tmp_path / "server.log")
    with pytest.raises(ServerFailed) as failed:
        server.start()
    assert server.process is not None and server.process.returncode not in (0, None)
    # every other rank waited for it at the start-up barrier, which rank 0 names
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert "rank 1 (decode) did not finish building its stages within 5 s" in log, failed.value
