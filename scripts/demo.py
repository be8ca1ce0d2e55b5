"""`make demo`: serve a layout, play the bundled trace on the bundled image, write the video and the facts.

Writes ``out/demo.mp4`` and ``out/demo.json`` (or ``--out``/``--json``) and prints a short summary. The default,
``--config cpu-tiny``, is the synthetic backend, whose frames follow the camera keys (what a newcomer should see
first); ``--config cpu-tiny-model`` runs the real LingBot-World-Fast code path with tiny random weights (its frames
are noise: it proves the model code runs end to end).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ipc.client import Client
from ipc.protocol import to_builtins
from runtime import config
from scripts.client import load_trace, play, report, write_video
from scripts.local_server import ROOT, LocalServer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="cpu-tiny")
    parser.add_argument("--image", type=Path, default=ROOT / "assets" / "start.png")
    parser.add_argument("--trace", type=Path, default=ROOT / "assets" / "demo_trace.json")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "demo.mp4")
    parser.add_argument("--json", type=Path, default=ROOT / "out" / "demo.json")
    args, overrides = parser.parse_known_args(argv)
    began = time.monotonic()
    cfg = config.load(args.config, overrides)
    if cfg.model.kind == "lingbot-fast" and not cfg.model.checkpoint_dir:
        print(f"PROOF that the model code runs: {args.out} comes from the real LingBot-World-Fast code path "
              f"({args.config}) with tiny RANDOM weights, so its video is noise. For real video set [model] "
              "checkpoint_dir (and a GPU layout such as configs/split7-h100.toml).", flush=True)
    elif cfg.model.kind == "synthetic":
        print(f"DEMO: {args.out} shows the controls acting: the synthetic backend ({args.config}) pans and zooms the "
              "start image by the camera the keys drive (W/S forward/back, A/D strafe, I/K/J/L look).", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    server = LocalServer(args.config, overrides, log_path=args.out.parent / f"{args.out.stem}-server.log")
    with server:
        print(f"server up in {server.started_s:.1f} s ({args.config}, log {server.log_path})", flush=True)
        with Client(server.endpoint) as client:
            played = play(client, args.image.read_bytes(), load_trace(args.trace))
            stats = client.stats()
    code = server.process.returncode if server.process else 1
    facts = report(played, played.summary)
    frames = write_video(played.chunks, args.out, played.fps)
    facts["demo_wall_s"] = time.monotonic() - began
    ranks = stats.ranks if isinstance(stats.ranks, dict) else {}
    facts["rank_rss_mb"] = {r: round(m.rss / 2**20) for r, m in ranks.items()}
    args.json.write_text(json.dumps({"report": facts, "summary": to_builtins(played.summary),
                                     "chunks": [to_builtins(c.facts) for c in played.chunks]}, indent=1))
    print(f"wrote {args.out} ({frames} frames) and {args.json}")
    print(f"chunks={facts['chunks']} first_frame_from_open={facts['first_frame_from_open_s']:.3f}s "
          f"first_frame_from_first_control={facts['first_frame_from_first_control_s']:.3f}s "
          f"period_p50={facts['chunk_period_p50_s']:.3f}s period_p90={facts['chunk_period_p90_s']:.3f}s "
          f"control_to_output_p50={facts['control_to_output_p50_s']:.3f}s wall={facts['demo_wall_s']:.1f}s")
    print(f"rank RSS (MB): {facts['rank_rss_mb']}; server exit code {code}")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
