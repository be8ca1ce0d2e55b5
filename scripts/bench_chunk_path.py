"""The chunk path per chunk: rank 0's loop, the SDK's receive, the gateway's page message (issue 29, point 8).

Built in-process from the real parts, at 480x832 by default (12 frames: 14 MB of uint8 RGB):

- **rank 0's loop**: ``Coordinator._emit`` as the loop calls it, from the frames in the mailbox to the message handed
  to the client's ROUTER socket (a real one, on loopback);
- **SDK receive**: the SDK's receive (``ipc.client_core.receive``: what both transports call) and its ``route`` (the
  decode into a ``ChunkResult``) on a real DEALER; ``sdk_s`` from rank 0's send returning to the ``ChunkResult``
  queued (the wire included), ``sdk_decode_s`` the route alone;
- **gateway**: the page's ``chunk`` message from the ``ChunkResult`` (what ``web.bridge`` builds per chunk), encoded.

Every chunk's frames are checked bit for bit on the SDK's side (``frames_identical``). The numbers of the code this
replaced (the frames copied into one encoded map on rank 0's loop, re-wrapped three times in the gateway) were taken
with this script before the change and are read from ``docs/bench_chunk_path_before.json``; the JSON puts both side
by side (``before``, ``measured``, ``ratio``: measured / before). ``--smoke``: 64x64, 3 chunks (numbers mean
nothing).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import queue
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ipc import client_core, protocol
from ipc import tensor_plane as tp
from ipc.client_lines import ClientLines
from ipc.transport import client_router, send_or_why
from ranks.coordinator import Coordinator
from runtime import core_types as ct
from runtime.watchers import Feeds
from scripts.bench_json import ROOT, out_path, parse_args, write_json
from web import chunks as web_chunks
from web import page_messages as pm
from web.playout import Dropped

BEFORE = ROOT / "docs" / "bench_chunk_path_before.json"  # this script's numbers on the code before the change
STAGES = ("rank0_loop_s", "sdk_s", "sdk_decode_s", "gateway_s")
SESSION = "bench"


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
    coordinator.ctx = SimpleNamespace(frames=tp.Mailbox())
    coordinator.lines = ClientLines(lambda who, data: send_or_why(router, who, data, copy=False))
    coordinator.feeds = Feeds()
    coordinator.carried = []
    return coordinator


def page_message(chunk: Any) -> str:
    """What the gateway builds per chunk: the page's ``chunk`` message (and what its trace keeps), encoded."""
    if hasattr(web_chunks, "page_chunk"):  # the gateway's own builder from the ``ChunkResult``
        trace = web_chunks.Timeline(chunk.session, chunk.facts)
        assert trace.frames == chunk.facts.frames
        return pm.encode(web_chunks.page_chunk(chunk, Dropped()))
    view = web_chunks.read_chunk(chunk)  # the code before: ChunkResult -> ChunkView -> Timeline -> pm.Chunk
    view.timeline()
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
    receive = getattr(client_core, "receive", None)  # the SDK's receive (``None``: the code before read one frame)
    generator = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {stage: [] for stage in STAGES}
    identical = True
    for index in range(chunks):
        tensor = torch.randint(0, 256, (frames, height, width, 3), dtype=torch.uint8, generator=generator)
        digest = hashlib.sha256(tensor.numpy().tobytes()).hexdigest()
        coordinator.ctx.frames.put((SESSION, index), tensor)
        del tensor  # rank 0 holds the frames through the mailbox only, as in the server
        began = time.perf_counter()
        coordinator._emit(ct.EmitChunk(SESSION, facts_of(index, frames), to=identity), set())
        sent = time.perf_counter()
        data = receive(dealer) if receive is not None else dealer.recv()
        received = time.perf_counter()
        core.route(data)
        chunk = events.get_nowait()
        routed = time.perf_counter()
        page_message(chunk)
        paged = time.perf_counter()
        assert not coordinator.carried and not errors, (coordinator.carried, errors)
        identical &= hashlib.sha256(chunk.frames.tobytes()).hexdigest() == digest and chunk.index == index
        for stage, seconds in zip(STAGES, (sent - began, routed - sent, routed - received, paged - routed)):
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
    """after / before per stage (p50), where the saved numbers are of the same size."""
    if before is None or (before["height"], before["width"], before["frames"]) != (
            after["height"], after["width"], after["frames"]):
        return {}
    return {stage: after[stage]["p50"] / before[stage]["p50"] for stage in STAGES if before[stage]["p50"] > 0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--frames", type=int, default=12, help="video frames per chunk (12: 14 MB at 480x832)")
    parser.add_argument("--chunks", type=int, default=40)
    parser.add_argument("--before", type=Path, default=BEFORE, help="saved numbers of the code before the change")
    parser.add_argument("--json", type=Path, default=None, help="where to write (default $OUT/bench_chunk_path.json)")
    args = parse_args(parser, argv, {"height": 64, "width": 64, "chunks": 3})
    torch.set_num_threads(1)
    after = measure(args.height, args.width, args.frames, args.chunks)
    before = json.loads(args.before.read_text())["measured"] if args.before.is_file() else None
    ratio = side_by_side(before, after)
    for stage in STAGES:
        was = "" if not ratio else f"   before {before[stage]['p50'] * 1e3:8.3f} ms   ratio {ratio[stage]:.3f}"
        print(f"{stage:14s} p50 {after[stage]['p50'] * 1e3:8.3f} ms{was}")
    print(f"{after['frame_bytes'] / 2**20:.1f} MiB per chunk, frames identical: {after['frames_identical']}")
    path = write_json(args.json or out_path("bench_chunk_path.json"),
                      {"measured": after, "before": before, "ratio": ratio,
                       "frames_identical": after["frames_identical"]}, smoke=args.smoke)
    print(f"wrote {path}")
    return 0 if after["frames_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
