"""The chunk path per chunk: rank 0's loop, the SDK's receive, the gateway's page message (issue 29, point 8).

Built in-process from the real parts, at 480x832 by default (12 frames: 14 MB of uint8 RGB):

- **rank 0's loop**: ``Coordinator._emit`` as the loop calls it, from the frames in the mailbox to the message handed
  to the client's ROUTER socket (a real one, on loopback);
- **SDK receive**: a real DEALER's receive, as both SDK transports read, and the SDK's ``route`` (the decode into a
  ``ChunkResult``); ``sdk_s`` from rank 0's send returning to the ``ChunkResult`` queued (the wire included),
  ``sdk_decode_s`` the route alone;
- **gateway**: what ``web.bridge`` builds per chunk from the ``ChunkResult`` (its trace entry, the page's ``chunk``
  message, encoded).

Each stage is timed in wall seconds and in the CPU seconds of the thread that runs it (``*_cpu``: what the stage
costs its loop, whatever else the machine runs). Every chunk's frames are checked bit for bit on the SDK's side
(``frames_identical``). ``--before-ref REF`` measures the code of a git ref (e.g. ``main``, before the change: the
frames copied into one encoded map on rank 0's loop, re-wrapped three times in the gateway) in the same sitting, in a
process of its own on an export of that ref; without it the numbers saved in ``docs/bench_chunk_path_before.json``
are put beside. The JSON holds ``measured``, ``before`` and ``ratio`` (measured / before, per stage's p50).
``--smoke``: 64x64, 3 chunks (numbers mean nothing).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import zmq

sys.path.insert(0, os.environ.get("BENCH_CHUNK_PATH_TREE") or str(Path(__file__).resolve().parent.parent))

from ipc import client_core, protocol  # from the tree measured: this one, or a ref's
from ipc import tensor_plane as tp
from ipc.client_lines import ClientLines
from ipc.transport import client_router, send_or_why
from ranks.coordinator import Coordinator
from runtime import core_types as ct
from runtime.watchers import Feeds
from scripts.bench_json import out_path, parse_args, write_json
from web import chunks as web_chunks
from web import page_messages as pm
from web.playout import Dropped

HERE = Path(__file__).resolve().parent.parent
BEFORE = HERE / "docs" / "bench_chunk_path_before.json"  # this script's numbers on the code before the change
STAGES = ("rank0_loop_s", "rank0_loop_cpu_s", "sdk_s", "sdk_decode_s", "sdk_decode_cpu_s", "gateway_s",
          "gateway_cpu_s")
SESSION = "bench"
# protocol 4: a chunk's frames are a part of their own (asked of the tree measured, not of whatever is installed)
PARTS = (Path(protocol.__file__).parent / "chunk_wire.py").is_file()


def facts_of(index: int, frames: int) -> protocol.ChunkFacts:
    times = protocol.ChunkTimes(control_accepted=1.0, condition_submitted=0.5, condition_ready=0.6,
                                denoise_start=1.0, denoise_end=1.2, decode_start=1.2, decode_end=1.3, emitted=1.31)
    spans = tuple(protocol.Span(name, rank, role, 1.0, 1.1, 1.2) for rank, (name, role) in
                  enumerate([("condition", "condition"), ("denoise", "dit"), ("decode", "decode")]))
    return protocol.ChunkFacts(index=index, frames=frames, control=protocol.ChunkControl(keys=frozenset("w")),
                               times=times, spans=spans, steps=4)


def rank0(router: zmq.Socket) -> Coordinator:
    """The coordinator's shell with only what ``_emit`` touches: the frames mailbox, the client lines, the feeds."""
    coordinator = Coordinator.__new__(Coordinator)
    box = tp.Mailbox()  # the frames' mailbox, under its name in the tree measured (``inbox[Edge.FRAMES]`` or older)
    inbox = {protocol.Edge.FRAMES: box} if hasattr(protocol, "Edge") else {}
    coordinator.ctx = SimpleNamespace(frames=box, inbox=inbox)
    coordinator.lines = ClientLines(lambda who, data: send_or_why(router, who, data, copy=False))
    coordinator.feeds = Feeds()
    coordinator.carried = []
    return coordinator


def page_message(chunk: Any, trace: list[Any]) -> str:
    """What the gateway builds per chunk (``web.bridge``): what its trace keeps, and the page's ``chunk``, encoded."""
    if PARTS:
        trace.append((chunk.session, chunk.facts))
        return pm.encode(web_chunks.page_chunk(chunk, Dropped()))
    view = web_chunks.read_chunk(chunk)  # before protocol 4: ChunkResult -> ChunkView -> Timeline -> pm.Chunk
    trace.append(view.timeline())
    return pm.encode(view.message(Dropped()))


def measure(height: int, width: int, frames: int, chunks: int) -> dict[str, Any]:
    context = zmq.Context()
    router, port = client_router(context, "127.0.0.1", 0, send_hwm=4, max_message_bytes=1 << 30)
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"sdk")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(protocol.encode(protocol.Heartbeat()))
    identity, _ = router.recv_multipart()  # the client is known to the ROUTER from here on
    coordinator = rank0(router)
    errors: list[Any] = []
    core: client_core.ClientCore[Any, Any] = client_core.ClientCore(queue.SimpleQueue, errors.append)
    events = core.session(SESSION).events
    generator = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {stage: [] for stage in STAGES}
    identical = True
    trace: list[Any] = []
    for index in range(chunks):
        tensor = torch.randint(0, 256, (frames, height, width, 3), dtype=torch.uint8, generator=generator)
        digest = hashlib.sha256(tensor.numpy().tobytes()).hexdigest()
        coordinator.ctx.frames.put((SESSION, index), tensor)  # the same mailbox as inbox[Edge.FRAMES]
        del tensor  # rank 0 holds the frames through the mailbox only, as in the server
        began, began_cpu = time.perf_counter(), time.thread_time()
        coordinator._emit(ct.EmitChunk(SESSION, facts_of(index, frames), to=identity), set())
        sent, sent_cpu = time.perf_counter(), time.thread_time()
        data = dealer.recv_multipart(copy=False) if PARTS else dealer.recv()  # as the SDK's transports receive
        received, received_cpu = time.perf_counter(), time.thread_time()
        core.route(data)
        chunk = events.get_nowait()
        routed, routed_cpu = time.perf_counter(), time.thread_time()
        page_message(chunk, trace)
        paged, paged_cpu = time.perf_counter(), time.thread_time()
        assert not coordinator.carried and not errors, (coordinator.carried, errors)
        identical &= hashlib.sha256(chunk.frames.tobytes()).hexdigest() == digest and chunk.index == index
        for stage, seconds in zip(STAGES, (sent - began, sent_cpu - began_cpu, routed - sent, routed - received,
                                           routed_cpu - received_cpu, paged - routed, paged_cpu - routed_cpu)):
            times[stage].append(seconds)
    dealer.close(0)
    router.close(0)
    context.term()
    warm = {stage: values[1:] or values for stage, values in times.items()}  # the first chunk warms the sockets
    return {"height": height, "width": width, "frames": frames, "chunks": chunks,
            "frame_bytes": frames * height * width * 3, "frames_identical": identical,
            **{stage: {"p50": statistics.median(v), "mean": statistics.fmean(v), "min": min(v)}
               for stage, v in warm.items()}}


def side_by_side(before: dict[str, Any] | None, after: dict[str, Any]) -> dict[str, Any]:
    """after / before per stage (p50), where the numbers before are of the same size."""
    if before is None or (before["height"], before["width"], before["frames"]) != (
            after["height"], after["width"], after["frames"]):
        return {}
    return {stage: after[stage]["p50"] / before[stage]["p50"] for stage in STAGES
            if stage in before and before[stage]["p50"] > 0}


def measure_ref(ref: str, argv: list[str]) -> dict[str, Any]:
    """This benchmark on the code of git ref ``ref``: an export of it, measured by this script in a process of its
    own (so both sides run the same measurement in one sitting)."""
    with tempfile.TemporaryDirectory(prefix="bench_chunk_path_") as folder:
        tree = Path(folder) / "tree"
        tree.mkdir()
        archive = subprocess.run(["git", "-C", str(HERE), "archive", ref], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        out = Path(folder) / "before.json"
        env = {**os.environ, "BENCH_CHUNK_PATH_TREE": str(tree), "PYTHONPATH": str(tree)}
        subprocess.run([sys.executable, __file__, *argv, "--json", str(out)], check=True, env=env, cwd=folder)
        measured: dict[str, Any] = json.loads(out.read_text())["measured"]
        return {**measured, "ref": ref}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--frames", type=int, default=12, help="video frames per chunk (12: 14 MB at 480x832)")
    parser.add_argument("--chunks", type=int, default=40)
    parser.add_argument("--before-ref", default=None, help="measure this git ref's code too, in the same sitting")
    parser.add_argument("--before", type=Path, default=BEFORE, help="saved numbers of the code before the change")
    parser.add_argument("--json", type=Path, default=None, help="where to write (default $OUT/bench_chunk_path.json)")
    args = parse_args(parser, argv, {"height": 64, "width": 64, "chunks": 3})
    torch.set_num_threads(1)
    sizes = ["--height", str(args.height), "--width", str(args.width), "--frames", str(args.frames), "--chunks",
             str(args.chunks), "--before", os.devnull]
    before = measure_ref(args.before_ref, sizes) if args.before_ref else (
        json.loads(args.before.read_text())["measured"] if args.before.is_file() else None)
    after = measure(args.height, args.width, args.frames, args.chunks)
    ratio = side_by_side(before, after)
    for stage in STAGES:
        was = "" if stage not in ratio else (f"   before {before[stage]['p50'] * 1e3:8.3f} ms   "  # type: ignore
                                             f"ratio {ratio[stage]:.3f}")
        print(f"{stage:17s} p50 {after[stage]['p50'] * 1e3:8.3f} ms{was}")
    print(f"{after['frame_bytes'] / 2**20:.1f} MiB per chunk, frames identical: {after['frames_identical']}")
    path = write_json(args.json or out_path("bench_chunk_path.json"),
                      {"measured": after, "before": before, "ratio": ratio,
                       "frames_identical": after["frames_identical"]}, smoke=args.smoke)
    print(f"wrote {path}")
    return 0 if after["frames_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
