"""A rank's start in one process (real role threads, a real ZeroMQ socket on loopback standing in for rank 0): each
stage warms up in the very thread that then serves it (PyTorch keeps cuDNN's autotune results per thread), no hello
leaves before the rank's room is known (measured once every stage thread warmed up), and a stage out of memory at one
size reports that size as failed and still serves the others. The served path on real ranks is in
``tests/test_sizes.py`` and ``tests/test_start_ranks.py``."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq

from ipc import protocol
from ipc.tensor_plane import Groups
from ipc.transport import send_to
from models.stages import SessionSpec
from models.synthetic import SyntheticCondition, SyntheticDecode, SyntheticDenoise, synthetic_geometry
from ranks import roles
from ranks.backend import Backend
from ranks.warmup import StartGate, session_id, stages_of, warm_stage
from ranks.worker import RankContext
from runtime.config import LayoutConfig, TimeoutsConfig
from tests.faulty_backend import SmallCardDecode

CPU = torch.device("cpu")
SIZES = ((64, 96), (96, 64))
ONE_RANK = LayoutConfig(name="one-rank", world_size=1, coordinator=0, condition=0, decode=0, dit=[0])
ROOM = 12345


class Opened:
    """Which thread opened each session of a stage."""

    def __init__(self) -> None:
        self.by: dict[str, str] = {}

    def note(self, spec: SessionSpec) -> None:
        self.by[spec.session] = threading.current_thread().name


class SeenCondition(SyntheticCondition):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.opened = Opened()

    def open(self, spec: SessionSpec) -> torch.Tensor:
        self.opened.note(spec)
        return super().open(spec)


class SeenDenoise(SyntheticDenoise):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.opened = Opened()

    def open(self, spec: SessionSpec, context: torch.Tensor) -> None:
        self.opened.note(spec)
        super().open(spec, context)


class SeenDecode(SyntheticDecode):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.opened = Opened()

    def open(self, spec: SessionSpec) -> None:
        self.opened.note(spec)
        super().open(spec)


@pytest.fixture
def router() -> Iterator[tuple[zmq.Context, zmq.Socket, str]]:
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield context, sock, f"tcp://127.0.0.1:{port}"
    finally:
        sock.close()
        context.term()


def receive(sock: zmq.Socket) -> tuple[bytes, Any]:
    assert sock.poll(30_000), "no message from the rank's threads within 30 s"
    identity, data = sock.recv_multipart()
    return identity, protocol.decode(data, "worker")


def test_each_stage_warms_up_in_the_thread_that_serves_it_and_says_hello_with_the_room_measured_after(
        router: tuple[zmq.Context, zmq.Socket, str]) -> None:
    context, sock, endpoint = router
    geometry = synthetic_geometry(*SIZES[0], 3)
    backend = Backend(geometry, {protocol.Stage.CONDITION: SeenCondition(geometry, 0.0),
                                 protocol.Stage.DENOISE: SeenDenoise(geometry, 0.0),
                                 protocol.Stage.DECODE: SeenDecode(geometry, 0.0)})
    start = StartGate(stages_of(backend))
    ctx = RankContext(layout=ONE_RANK, timeouts=TimeoutsConfig(), rank=0, roles=ONE_RANK.roles_of(0),
                      endpoint=endpoint, zmq=context, groups=Groups(0, CPU, None),
                      backend=backend, sizes=SIZES, start=start)
    workers = {"condition": roles.condition_worker, "denoise": roles.denoise_worker, "decode": roles.decode_worker}
    threads = [threading.Thread(target=work, args=(ctx,), name=name, daemon=True) for name, work in workers.items()]
    for thread in threads:
        thread.start()
    warmed = start.wait_warm(ctx.stop)
    assert warmed is not None and len(warmed) == len(workers) * len(SIZES)
    assert not sock.poll(200)  # warm, but the room is not known yet: no hello
    ctx.room = ROOM
    start.ready.set()
    hellos = dict(receive(sock) for _ in workers)
    by_role = {hello.role: hello for hello in hellos.values()}
    assert set(by_role) == set(workers)
    for role, hello in by_role.items():
        assert hello.room == ROOM
        assert [(w.stage, w.height, w.width, w.thread, w.failed) for w in hello.warm_up] == [
            (role, h, w, role, "") for h, w in SIZES]
    # a real session: each stage opens it in the thread that warmed it up (not the main thread)
    image = torch.zeros(SIZES[0] + (3,), dtype=torch.uint8)
    ctx.inbox[protocol.Edge.CONTEXT].put(("real", -1), torch.zeros(geometry.context_shape))
    tasks = {"condition": protocol.InitCondition(session="real", seed=1, prompt="", image=image.numpy().tobytes(),
                                                 image_height=SIZES[0][0], image_width=SIZES[0][1],
                                                 height=SIZES[0][0], width=SIZES[0][1]),
             "denoise": protocol.InitDenoise(session="real", seed=1, prompt="", height=SIZES[0][0], width=SIZES[0][1]),
             "decode": protocol.InitDecode(session="real", height=SIZES[0][0], width=SIZES[0][1])}
    for role, task in tasks.items():
        assert send_to(sock, f"0:{role}".encode(), task)
    done = [receive(sock)[1] for _ in tasks]
    assert all(isinstance(d, protocol.InitDone) for d in done), done
    for role in workers:
        opened = getattr(backend, role).opened.by
        assert opened["real"] == opened[session_id(*SIZES[0])] == opened[session_id(*SIZES[1])] == role
    for role in workers:
        send_to(sock, f"0:{role}".encode(), protocol.Shutdown())
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive()


def test_a_size_out_of_memory_in_a_stage_warm_up_is_reported_and_the_others_still_serve(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAULTY_OOM_SIZE", "96x64")
    geometry = synthetic_geometry(*SIZES[0], 3)
    backend = Backend(geometry, {protocol.Stage.DECODE: SmallCardDecode(geometry, 0.0)})
    runs = warm_stage(backend, stages_of(backend)[0], SIZES, CPU)
    assert [(r.height, r.width, bool(r.failed)) for r in runs] == [(64, 96, False), (96, 64, True)]
    assert "OutOfMemoryError" in runs[1].failed and "96x64" in runs[1].failed
    assert session_id(96, 64) not in backend.decode._open  # type: ignore[union-attr]  # nothing left behind
    backend.decode.open(SessionSpec("real", 0, "", height=64, width=96))  # type: ignore[union-attr]
    assert backend.decode.decode("real", 0, torch.zeros(geometry.latent_shape)).shape[1:3] == (64, 96)  # type: ignore[union-attr]
