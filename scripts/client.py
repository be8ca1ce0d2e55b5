"""Play a control trace against a running worldstream server; write the video, the per-chunk facts and a trace.

    python scripts/client.py --endpoint tcp://127.0.0.1:5555 --image assets/start.png \\
        --trace assets/demo_trace.json --out out/demo.mp4 --json out/demo.json [--chrome-trace out/trace.json]

A trace is JSON: ``{"prompt": str, "seed": int, "chunks": [{"keys": "wl", "mouse": [dx, dy]}, ...]}`` (the keys
held during each chunk), optionally with ``"intrinsics": [fx, fy, cx, cy]``: the camera in pixels of a 480x832
frame (default: the server's ``controls.intrinsics``); a timeline and a recording may carry it too.
A trace may change the prompt mid-stream: ``"prompts": [{"chunk": k, "prompt": str}, ...]`` (k increasing) sends
``set_prompt`` after chunk k-1 arrived and before control k, so chunk k is exactly the first to use it (checked
against the server's answer). A chunk may carry ``"steps"`` (asked from that chunk on), the trace ``"steps"`` (the
open's), ``"saves": [k, ...]`` (a save after chunk k-1 arrived and before control k: its boundary is exactly k) and
``"restore": <snapshot id>`` (the session restores it, with indexed controls, instead of opening from the image;
its chunks start at the snapshot's). ``--reactive`` sends control[i] only after chunk i-1 arrived (a person
reacting to what they see) instead of as soon as the server admits it (a recorded trace).

Live mode: ``--live`` plays an input timeline (``--timeline t.json``, or a built-in one) as a live session: at
each event's time (seconds after the session is ready) the whole input state is sent as a ``control_state``
and the server cuts per-chunk snapshots from it. A timeline is JSON: ``{"prompt", "seed", "num_chunks",
"pause_when_idle", "events": [{"t": 0.2, "keys": "w", "taps": "i", "mouse": [dx, dy]}, ...]}`` (``keys``: held
now; ``taps`` and ``mouse``: since the previous event); an event ``{"t": 1.0, "prompt": "..."}`` changes the prompt
instead (``set_prompt``), ``{"t": 1.0, "save": true}`` saves the session, and ``"steps": N`` in an event asks for
N denoising steps from the next chunk cut (alone, it keeps the held keys). A timeline with ``"restore": <id>``
restores that snapshot instead of opening. ``--record out/live_trace.json`` writes the recording:
the states, prompt changes, steps changes and saves as sent (revision, send time; a prompt change with the
``prompt_revision`` and ``chunk`` the server answered, a save with its ``snapshot`` and ``chunk``), the snapshot
restored and its ``first_chunk``, the control, prompt revision and steps the server applied to every chunk, the
frame hashes and the input-to-photon latencies. ``--replay out/live_trace.json`` sends the recorded states again
with their original timing; ``--replay ... --exact`` instead replays the applied snapshots as indexed controls
(restoring the same snapshot, changing the prompt and asking the recorded steps at the chunks that first used
them, saving at the same boundaries), which reproduces the recorded frames bit for bit and each chunk's prompt
revision and steps (checked; exit 1 on a mismatch, 2 when the snapshot it restores is gone).

Why the exact replay uses the applied snapshots: frames depend only on seed, image, prompt and the control
applied to each chunk, but *where* the server cuts a live state into chunks depends on when each state arrived
relative to the scheduler's room, i.e. on timing. The snapshots stored per chunk are those cut points, so
replaying them as indexed controls is deterministic whatever the machine load; re-sending the states with the
same timing is realistic but only reproduces the frames when the cuts happen to fall the same way.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ipc.client import ChunkResult, Client, LiveInput, ServerError, SessionClosed, SessionInfo, closed_summary
from ipc.metrics_types import SessionSummary
from ipc.protocol import to_builtins

LIVE_TRACE_FORMAT = "worldstream-live-trace/1"
DEFAULT_TIMELINE: dict[str, Any] = {  # ~2 s of a person walking, looking around, tapping keys
    "prompt": "a valley with pine trees under a clear sky, first-person walk",
    "seed": 7,
    "num_chunks": 24,
    "events": [
        {"t": 0.05, "keys": "w"}, {"t": 0.35, "keys": "w", "taps": "i"}, {"t": 0.6, "keys": "wd"},
        {"t": 0.8, "keys": "d", "mouse": [6.0, 0.0]}, {"t": 1.0, "keys": "d", "mouse": [6.0, -2.0]},
        {"t": 1.2, "keys": "", "taps": "k"}, {"t": 1.5, "keys": "l"}, {"t": 1.8, "keys": "", "taps": "j"},
    ],
}


@dataclass
class Played:
    session: str
    fps: float
    opened_s: float  # open -> session ready
    chunks: list[ChunkResult] = field(default_factory=list)
    summary: SessionSummary = field(default_factory=SessionSummary)
    wall_s: float = 0.0
    prompts: list[dict[str, Any]] = field(default_factory=list)  # set_prompt answers: chunk, prompt_revision, prompt
    saves: list[dict[str, Any]] = field(default_factory=list)  # saved answers: chunk, snapshot, bytes, pause_s
    first_chunk: int = 0  # its first chunk (a restored session's snapshot chunk)


class ReplayError(RuntimeError):
    """A recording cannot be replayed here (e.g. the snapshot it restored is gone); the message says why."""


def load_trace(path: Path) -> dict[str, Any]:
    trace = json.loads(path.read_text())
    if not isinstance(trace.get("chunks"), list) or not trace["chunks"]:
        raise ValueError(f"{path}: a trace needs a non-empty 'chunks' list")
    return trace


def intrinsics_of(trace: dict[str, Any]) -> tuple[float, float, float, float] | None:
    """The camera a trace or timeline asks for (``"intrinsics"``: fx, fy, cx, cy at 480x832), or None."""
    values = trace.get("intrinsics")
    return None if values is None else tuple(float(v) for v in values)  # type: ignore[return-value]


def open_restored(client: Client, snapshot: str, indexed: bool = False) -> SessionInfo:
    """``open(restore=snapshot)`` (``indexed``: with indexed controls, even if it was saved live); a snapshot this
    server cannot restore (deleted, or saved elsewhere) is a ``ReplayError`` naming it."""
    try:
        return client.open(restore=snapshot, indexed=indexed)
    except ServerError as error:
        raise ReplayError(f"the recording restores snapshot {snapshot}, which this server cannot restore "
                          f"({error})") from None


def play(client: Client, image: bytes, trace: dict[str, Any], reactive: bool = False,
         num_chunks: int | None = None) -> Played:
    """Open a session (or restore the trace's ``restore`` snapshot), send every control of the trace, collect
    every chunk, close. Raises on server errors."""
    steps = trace["chunks"][: num_chunks or len(trace["chunks"])]
    started = time.monotonic()
    if trace.get("restore"):
        info = open_restored(client, str(trace["restore"]), indexed=True)
    else:
        info = client.open(image, prompt=trace.get("prompt", ""), seed=int(trace.get("seed", 0)),
                           num_chunks=len(steps), intrinsics=intrinsics_of(trace), steps=trace.get("steps"))
    first = info.first_chunk
    played = Played(session=info.id, fps=info.fps, opened_s=time.monotonic() - started, first_chunk=first)
    errors: list[BaseException] = []

    changes = {int(change["chunk"]): str(change["prompt"]) for change in trace.get("prompts", ())}
    saves = {int(chunk) for chunk in trace.get("saves", ())}

    def send_all() -> None:
        try:
            for offset, step in enumerate(steps):
                index = first + offset
                if (reactive and offset > 0) or index in changes or index in saves:
                    while len(played.chunks) < offset and not errors:
                        time.sleep(0.0005)
                # chunk index-1 arrived and control[index] is not sent: index is the switch and the save's boundary
                # (the prompt first: a prompt encoded while a save holds its boundary starts after it)
                if index in changes:
                    played.prompts.append(change_prompt(client, info.id, changes[index], expect_chunk=index))
                if index in saves:
                    played.saves.append(save_at(client, info.id, expect_chunk=index))
                client.control(info.id, index, keys=step.get("keys", ""), mouse=tuple(step.get("mouse", (0, 0))),
                               steps=step.get("steps"))
        except BaseException as error:  # surfaced in the caller's thread
            errors.append(error)

    sender = threading.Thread(target=send_all, daemon=True)
    sender.start()
    for chunk in client.chunks(info.id):
        played.chunks.append(chunk)
        if errors or len(played.chunks) == len(steps):
            break
    sender.join(timeout=5)
    if errors:
        raise errors[0]
    ends = info.num_chunks is not None and first + len(steps) >= info.num_chunks  # else: close after the trace
    played.summary = client.wait_closed(info.id) if ends else client.close(info.id)
    played.wall_s = time.monotonic() - started
    return played


def change_prompt(client: Client, session: str, prompt: str, expect_chunk: int | None = None) -> dict[str, Any]:
    """``set_prompt``; the answer as a record. ``expect_chunk``: the chunk the change must take effect at."""
    reply = client.set_prompt(session, prompt)
    if expect_chunk is not None and reply.chunk != expect_chunk:
        raise RuntimeError(f"the new prompt took effect at chunk {reply.chunk}, not {expect_chunk}")
    return {"chunk": reply.chunk, "prompt_revision": reply.revision, "prompt": prompt}


def save_at(client: Client, session: str, expect_chunk: int | None = None) -> dict[str, Any]:
    """``save``; the answer as a record. ``expect_chunk``: the boundary the save must have."""
    snapshot = client.save(session)
    if expect_chunk is not None and snapshot.chunk != expect_chunk:
        raise ReplayError(f"the save's boundary is chunk {snapshot.chunk}, not {expect_chunk}")
    return {"chunk": snapshot.chunk, "snapshot": snapshot.id, "bytes": snapshot.bytes, "pause_s": snapshot.pause_s}


@dataclass
class LivePlayed(Played):
    sent: list[dict[str, Any]] = field(default_factory=list)  # the states as sent: t, revision, keys, taps, mouse


def load_timeline(path: Path) -> dict[str, Any]:
    """An input timeline or a live recording (both carry ``events``); validated."""
    timeline = json.loads(path.read_text())
    check_timeline(timeline, str(path))
    return timeline


def check_timeline(timeline: dict[str, Any], where: str = "timeline") -> None:
    events = timeline.get("events")
    if not isinstance(events, list):
        raise ValueError(f"{where}: a live timeline needs an 'events' list")
    last = 0.0
    for i, event in enumerate(events):
        t = event.get("t") if isinstance(event, dict) else None
        if not isinstance(t, (int, float)) or t < last:
            raise ValueError(f"{where}: event {i} needs a time 't' >= the previous one ({last}), got {event!r}")
        last = float(t)
    if timeline.get("num_chunks") is None and not events:
        raise ValueError(f"{where}: an endless session (no num_chunks) needs events to end after")


def play_live(client: Client, image: bytes, timeline: dict[str, Any], tail_s: float = 0.5) -> LivePlayed:
    """Open a live session and send the timeline's states at their times (from session ready) while collecting
    chunks. With ``num_chunks`` the session ends by itself; without, it is closed ``tail_s`` after the last
    event. Raises on server errors of the session."""
    check_timeline(timeline)
    started = time.monotonic()
    num_chunks = timeline.get("num_chunks")
    if timeline.get("restore"):  # a saved live session: its prompt, seed, length and held keys come with it
        info = open_restored(client, str(timeline["restore"]))
        num_chunks = info.num_chunks
    else:
        info = client.open(image, prompt=timeline.get("prompt", ""), seed=int(timeline.get("seed", 0)),
                           num_chunks=num_chunks, live=True, pause_when_idle=bool(timeline.get("pause_when_idle")),
                           intrinsics=intrinsics_of(timeline), steps=timeline.get("steps"))
    ready = time.monotonic()
    played = LivePlayed(session=info.id, fps=info.fps, opened_s=ready - started, first_chunk=info.first_chunk)
    live = LiveInput(client, info.id)
    done, finished = threading.Event(), threading.Event()

    def send_all() -> None:
        try:
            for event in timeline["events"]:
                if done.wait(max(0.0, ready + float(event["t"]) - time.monotonic())):
                    return
                if "prompt" in event:
                    change = change_prompt(client, info.id, str(event["prompt"]))
                    played.prompts.append(change)
                    played.sent.append({"t": time.monotonic() - ready, **change})
                    continue
                if event.get("save"):  # blocks this sender until every rank's file is written
                    saved = save_at(client, info.id)
                    played.saves.append(saved)
                    played.sent.append({"t": time.monotonic() - ready, "save": True, **saved})
                    continue
                held = sorted(live.held) if "steps" in event else ""  # a steps change alone keeps the keys held
                state = {"keys": "".join(event.get("keys", held)), "taps": "".join(event.get("taps", "")),
                         "mouse": [float(v) for v in event.get("mouse", (0.0, 0.0))]}
                steps = event.get("steps")
                revision = live.set(state["keys"], state["taps"], (state["mouse"][0], state["mouse"][1]), steps=steps)
                if revision is not None:
                    extra = {} if steps is None else {"steps": int(steps)}
                    played.sent.append({"t": time.monotonic() - ready, "revision": revision, **state, **extra})
        finally:
            finished.set()

    sender = threading.Thread(target=send_all, daemon=True)
    sender.start()
    heard = time.monotonic()
    try:
        while True:
            try:
                played.chunks.append(client.next_chunk(info.id, timeout_s=0.05))
                heard = time.monotonic()
            except TimeoutError:
                if time.monotonic() - heard > client.timeout_s:
                    raise
            if num_chunks is None and finished.is_set() and time.monotonic() > ready + played_until(played) + tail_s:
                played.summary = client.close(info.id)  # chunks still in flight are drained, not kept
                break
    except SessionClosed as closed:
        played.summary = closed_summary(closed.closed)
    finally:
        done.set()
        sender.join(timeout=5)
    played.wall_s = time.monotonic() - started
    return played


def played_until(played: LivePlayed) -> float:
    """Time (from session ready) of the last state sent."""
    return played.sent[-1]["t"] if played.sent else 0.0


def frame_hashes(chunks: list[ChunkResult]) -> list[str]:
    """SHA-256 of each chunk's frames (uint8 bytes and shape): equal hashes, equal frames."""
    return [hashlib.sha256(repr(c.frames.shape).encode() + c.frames.tobytes()).hexdigest() for c in chunks]


def photon_stats(chunks: list[ChunkResult]) -> dict[str, float | int | None]:
    """Input-to-photon latency (client clock) over every revision the chunks showed: count, mean, p50, p90, max."""
    values = sorted(v for c in chunks for v in c.input_to_photon_s.values())
    if not values:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "max": None}

    def pick(q: float) -> float:
        return values[min(len(values) - 1, round(q * (len(values) - 1)))]

    return {"count": len(values), "mean": statistics.fmean(values), "p50": pick(0.5), "p90": pick(0.9),
            "max": values[-1]}


def recording(timeline: dict[str, Any], played: LivePlayed) -> dict[str, Any]:
    """The live recording: the states, prompt changes, steps changes and saves as sent with their times (and the
    server's answers), the snapshot restored (if any), what every chunk applied (control, prompt revision, steps),
    the frame hashes, and the input-to-photon latency of every revision."""
    return {
        "format": LIVE_TRACE_FORMAT,
        "prompt": timeline.get("prompt", ""),
        "seed": int(timeline.get("seed", 0)),
        "num_chunks": timeline.get("num_chunks"),
        "pause_when_idle": bool(timeline.get("pause_when_idle")),
        "intrinsics": timeline.get("intrinsics"),
        "steps": timeline.get("steps"),
        "restore": timeline.get("restore"),
        "first_chunk": played.first_chunk,
        "events": played.sent,
        "saves": played.saves,
        "applied": [{"index": c.index, "control": to_builtins(c.control), "prompt_revision": c.prompt_revision,
                     "steps": c.facts.steps, "steps_changed": c.facts.steps_changed} for c in played.chunks],
        "hashes": frame_hashes(played.chunks),
        "input_to_photon_s": {str(r): v for c in played.chunks for r, v in sorted(c.input_to_photon_s.items())},
    }


def applied_trace(recorded: dict[str, Any]) -> dict[str, Any]:
    """A recording's applied snapshots as an indexed trace (``play`` input): the deterministic replay. It restores
    the recording's snapshot if it restored one, changes the prompt at the chunks that first used a new revision,
    asks for each chunk's recorded steps where they changed, and saves at the recorded boundaries."""
    applied = sorted(recorded["applied"], key=lambda a: a["index"])
    first = int(recorded.get("first_chunk") or 0)
    if [a["index"] for a in applied] != list(range(first, first + len(applied))) or not applied:
        raise ValueError(f"the recording's applied snapshots must cover chunks {first}..n-1")
    texts = {e["prompt_revision"]: e["prompt"] for e in recorded.get("events", ()) if "prompt" in e}
    # a restored session starts at its snapshot's revision (its changes are the recording's own, all newer)
    start = int(applied[0].get("prompt_revision", 0))
    prompts, shown = [], 0 if start in texts or not recorded.get("restore") else start
    chunks, last_steps = [], 0
    for a in applied:  # each chunk that first used a newer prompt revision: a change at that chunk
        revision = int(a.get("prompt_revision", 0))
        if revision != shown:
            if revision not in texts:
                raise ValueError(f"chunk {a['index']} used prompt revision {revision}, which the recording lacks")
            prompts.append({"chunk": a["index"], "prompt": texts[revision]})
            shown = revision
        chunk = {"keys": "".join(a["control"].get("keys", ())), "mouse": a["control"].get("mouse", (0.0, 0.0))}
        steps = int(a.get("steps") or 0)
        if steps and steps != last_steps:  # the same steps from the same chunk, whoever chose them then
            chunk["steps"] = last_steps = steps
        chunks.append(chunk)
    trace: dict[str, Any] = {"prompt": recorded.get("prompt", ""), "seed": recorded.get("seed", 0),
                             "intrinsics": recorded.get("intrinsics"), "chunks": chunks}
    if recorded.get("restore"):
        trace["restore"] = recorded["restore"]
    elif chunks[0].get("steps"):
        trace["steps"] = chunks[0]["steps"]  # admitted at them
    if prompts:
        trace["prompts"] = prompts
    saves = [int(s["chunk"]) for s in recorded.get("saves", ())]
    return {**trace, "saves": saves} if saves else trace


def applied_facts(chunks: list[ChunkResult]) -> list[tuple[int, int, int]]:
    """What a replay must reproduce besides the frames: each chunk's index, prompt revision and steps."""
    return [(c.index, c.prompt_revision, c.facts.steps) for c in chunks]


def replay_exact(client: Client, image: bytes, recorded: dict[str, Any]) -> tuple[Played, bool]:
    """Replay the applied snapshots as indexed controls; the result and whether every frame hash and every
    chunk's facts (index, prompt revision, steps) match the recording's (its saves landed at the same chunks, or
    ``ReplayError`` was raised)."""
    played = play(client, image, applied_trace(recorded))
    facts = [(int(a["index"]), int(a.get("prompt_revision", 0)), int(a.get("steps") or 0))
             for a in sorted(recorded["applied"], key=lambda a: a["index"])]
    got = applied_facts(played.chunks)
    if not any(steps for _, _, steps in facts):  # a recording from before quality presets
        got = [(index, revision, 0) for index, revision, _ in got]
    return played, frame_hashes(played.chunks) == recorded.get("hashes") and got == facts


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


def report(played: Played, summary: SessionSummary) -> dict[str, Any]:
    period, first, latency = summary.chunk_period_s, summary.time_to_first_frame_s, summary.latency_s
    return {
        "chunks": len(played.chunks),
        "frames": sum(c.frames.shape[0] for c in played.chunks),
        "wall_s": played.wall_s,
        "first_frame_from_open_s": first.from_open,
        "first_frame_from_first_control_s": first.from_first_control,
        "chunk_period_p50_s": period.p50,
        "chunk_period_p90_s": period.p90,
        "control_to_output_p50_s": latency.p50,
        "control_to_output_p90_s": latency.p90,
        "real_time_factor": summary.real_time_factor,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Give one of --trace, --live or --replay. The trace, timeline and "
                                            "recording formats: this script's docstring and docs/protocol.md.")
    parser.add_argument("--endpoint", default="tcp://127.0.0.1:5555",
                        help="the server's (or a router's) ZeroMQ client endpoint (default: %(default)s)")
    parser.add_argument("--token-file", default=None,
                        help="a file holding the client token the server or router requires (default "
                             "$WORLDSTREAM_TOKEN, else the file $WORLDSTREAM_TOKEN_FILE names)")
    parser.add_argument("--image", type=Path, required=True,
                        help="the start image, PNG or JPEG (the session's first frame; assets/start.png is one)")
    parser.add_argument("--trace", type=Path, help="indexed control trace to play (assets/demo_trace.json is one)")
    parser.add_argument("--live", action="store_true", help="play an input timeline as a live session")
    parser.add_argument("--timeline", type=Path, help="live input timeline (default: a built-in one)")
    parser.add_argument("--record", type=Path, help="live: write the recording (states, applied snapshots, hashes)")
    parser.add_argument("--replay", type=Path, help="replay a live recording with its original timing")
    parser.add_argument("--exact", action="store_true",
                        help="with --replay: replay the applied snapshots as indexed controls and check the hashes")
    parser.add_argument("--out", type=Path, help="mp4 to write")
    parser.add_argument("--json", type=Path, help="per-chunk facts and the session summary")
    parser.add_argument("--chrome-trace", "--trace-out", dest="chrome_trace", type=Path,
                        help="Chrome/Perfetto trace JSON of every span on one timeline")
    parser.add_argument("--reactive", action="store_true", help="send control[i] only after chunk i-1 arrived")
    parser.add_argument("--chunks", type=int, help="play only the first N chunks of the trace")
    args = parser.parse_args(argv)
    if sum(map(bool, (args.trace, args.live, args.replay))) != 1:
        parser.error("give exactly one of --trace, --live, --replay")
    if args.record and not args.live:
        parser.error("--record needs --live")
    image = args.image.read_bytes()
    try:
        played, matched = run(args, image)
    except ReplayError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return report_all(args, played, matched)


def run(args: argparse.Namespace, image: bytes) -> tuple[Played, bool | None]:
    """The session the arguments ask for: played, and whether it matched its recording (None: no recording)."""
    matched: bool | None = None
    with Client(args.endpoint, token_file=args.token_file) as client:
        if args.trace:
            played = play(client, image, load_trace(args.trace), reactive=args.reactive, num_chunks=args.chunks)
        elif args.live:
            timeline = load_timeline(args.timeline) if args.timeline else DEFAULT_TIMELINE
            played = play_live(client, image, timeline)
            if args.record:
                args.record.parent.mkdir(parents=True, exist_ok=True)
                args.record.write_text(json.dumps(recording(timeline, played), indent=1))
        else:
            recorded = load_timeline(args.replay)
            if args.exact:
                played, matched = replay_exact(client, image, recorded)
            else:
                played = play_live(client, image, recorded)
                matched = frame_hashes(played.chunks) == recorded.get("hashes")
    return played, matched


def report_all(args: argparse.Namespace, played: Played, matched: bool | None) -> int:
    summary = played.summary
    facts = report(played, summary)
    if isinstance(played, LivePlayed):
        facts.update({f"input_to_photon_{k}_s" if k != "count" else "input_revisions_shown": v
                      for k, v in photon_stats(played.chunks).items()})
    if matched is not None:
        facts["frames_match_recording"] = matched
    if args.out:
        write_video(played.chunks, args.out, played.fps)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        chunks = [to_builtins(c.facts) for c in played.chunks]
        args.json.write_text(json.dumps({"report": facts, "summary": to_builtins(summary), "prompts": played.prompts,
                                         "saves": played.saves, "chunks": chunks}, indent=1))
    if args.chrome_trace:
        write_chrome_trace(played, args.chrome_trace)
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in facts.items()))
    return 1 if args.exact and not matched else 0


def write_chrome_trace(played: Played, path: Path) -> None:
    from runtime.trace import chrome_trace

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace((played.session, chunk.facts) for chunk in played.chunks)))


if __name__ == "__main__":
    sys.exit(main())
