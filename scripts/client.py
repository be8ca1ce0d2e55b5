"""Play a control trace against a running worldstream server; write the video, the per-chunk facts and a trace.

    python scripts/client.py --endpoint tcp://127.0.0.1:5555 --image assets/start.png \\
        --trace assets/demo_trace.json --out out/demo.mp4 --json out/demo.json [--chrome-trace out/trace.json]

A trace is JSON: ``{"prompt": str, "seed": int, "chunks": [{"keys": "wl", "mouse": [dx, dy]}, ...]}`` (the keys
held during each chunk). ``--reactive`` sends control[i] only after chunk i-1 arrived (a person reacting to
what they see) instead of as soon as the server admits it (a recorded trace).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ipc.client import ChunkResult, Client


@dataclass
class Played:
    session: str
    fps: float
    opened_s: float  # open -> session ready
    chunks: list[ChunkResult] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0


def load_trace(path: Path) -> dict[str, Any]:
    trace = json.loads(path.read_text())
    if not isinstance(trace.get("chunks"), list) or not trace["chunks"]:
        raise ValueError(f"{path}: a trace needs a non-empty 'chunks' list")
    return trace


def play(client: Client, image: bytes, trace: dict[str, Any], reactive: bool = False,
         num_chunks: int | None = None) -> Played:
    """Open a session, send every control of the trace, collect every chunk, close. Raises on server errors."""
    steps = trace["chunks"][: num_chunks or len(trace["chunks"])]
    started = time.monotonic()
    info = client.open(image, prompt=trace.get("prompt", ""), seed=int(trace.get("seed", 0)), num_chunks=len(steps))
    played = Played(session=info.id, fps=info.fps, opened_s=time.monotonic() - started)
    errors: list[BaseException] = []

    def send_all() -> None:
        try:
            for index, step in enumerate(steps):
                if reactive and index > 0:
                    while len(played.chunks) < index and not errors:
                        time.sleep(0.0005)
                client.control(info.id, index, keys=step.get("keys", ""), mouse=tuple(step.get("mouse", (0, 0))))
        except BaseException as error:  # surfaced in the caller's thread
            errors.append(error)

    sender = threading.Thread(target=send_all, daemon=True)
    sender.start()
    for chunk in client.chunks(info.id):
        played.chunks.append(chunk)
        if errors:
            break
    sender.join(timeout=5)
    if errors:
        raise errors[0]
    played.summary = client.wait_closed(info.id)
    played.wall_s = time.monotonic() - started
    return played


def write_video(chunks: list[ChunkResult], path: Path, fps: float) -> int:
    """H.264 mp4 through imageio's bundled ffmpeg (the ``video`` extra); returns the frame count."""
    import imageio

    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with imageio.get_writer(path, fps=fps, codec="libx264", quality=8, macro_block_size=16) as writer:
        for chunk in chunks:
            for frame in chunk.frames:
                writer.append_data(frame)
                count += 1
    return count


def report(played: Played, summary: dict[str, Any]) -> dict[str, Any]:
    period = summary.get("chunk_period_s", {})
    first = summary.get("time_to_first_frame_s", {})
    latency = summary.get("latency_s", {})
    return {
        "chunks": len(played.chunks),
        "frames": sum(c.frames.shape[0] for c in played.chunks),
        "wall_s": played.wall_s,
        "first_frame_from_open_s": first.get("from_open"),
        "first_frame_from_first_control_s": first.get("from_first_control"),
        "chunk_period_p50_s": period.get("p50"),
        "chunk_period_p90_s": period.get("p90"),
        "control_to_output_p50_s": latency.get("p50"),
        "control_to_output_p90_s": latency.get("p90"),
        "real_time_factor": summary.get("real_time_factor"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", default="tcp://127.0.0.1:5555")
    parser.add_argument("--image", type=Path, required=True)
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--out", type=Path, help="mp4 to write")
    parser.add_argument("--json", type=Path, help="per-chunk facts and the session summary")
    parser.add_argument("--chrome-trace", "--trace-out", dest="chrome_trace", type=Path,
                        help="Chrome/Perfetto trace JSON of every span on one timeline")
    parser.add_argument("--reactive", action="store_true", help="send control[i] only after chunk i-1 arrived")
    parser.add_argument("--chunks", type=int, help="play only the first N chunks of the trace")
    args = parser.parse_args(argv)
    trace = load_trace(args.trace)
    with Client(args.endpoint) as client:
        played = play(client, args.image.read_bytes(), trace, reactive=args.reactive, num_chunks=args.chunks)
    summary = played.summary
    facts = report(played, summary)
    if args.out:
        write_video(played.chunks, args.out, played.fps)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"report": facts, "summary": summary, "chunks": [
            {"index": c.index, "frames": c.frames.shape[0], "control": c.control, "facts": c.facts}
            for c in played.chunks]}, indent=1))
    if args.chrome_trace:
        write_chrome_trace(played, args.chrome_trace)
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in facts.items()))
    return 0


def write_chrome_trace(played: Played, path: Path) -> None:
    from runtime.metrics import ChunkRecord, Span
    from runtime.trace import chrome_trace

    records = []
    for chunk in played.chunks:
        t = chunk.facts["times"]
        spans = tuple(Span(name, rank, role, queued, start, end) for name, rank, role, queued, start, end
                      in chunk.facts["spans"])
        records.append((played.session, ChunkRecord(
            index=chunk.index, frames=chunk.frames.shape[0], emitted=t["emitted"],
            control_accepted=t["control_accepted"], condition_submitted=t["condition_submitted"],
            condition_ready=t["condition_ready"], denoise_start=t["denoise_start"], denoise_end=t["denoise_end"],
            decode_start=t["decode_start"], decode_end=t["decode_end"], control=chunk.control, spans=spans)))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(records)))


if __name__ == "__main__":
    sys.exit(main())
