"""The web gateway measured side by side: input-to-photon in the page against ``scripts/client.py --live``, the
gateway's CPU per stream, and the bytes per second a stream costs at 160x256 and 480x832 (height x width).

    python scripts/bench_web.py [--rounds 3] [--seconds 8] [--sizes 160x256,480x832] [--no-page] [--json FILE]

1. One ``cpu-tiny`` server (the config's stage costs) and a gateway. Each round plays the same input timeline (the
   built-in one of ``scripts/client.py --live``) twice, alternating: once by keys and mouse in headless Chromium on
   the play page (input-to-photon timed on the page's clock: input sent -> first frame applying it drawn), once
   by ``play_live`` (timed on the client's clock: input sent -> chunk received). The page figure includes what the
   page adds on top: the gateway hop, encoding, the WebSocket, decoding, the playout's frame pacing, drawing.
2. The gateway process's CPU (user + system seconds over wall seconds) while one page streams.
3. Per frame format (JPEG, WebP) and size (the server at 160x256, then at 480x832): a tab in Python streams for
   ``--seconds`` while panning (J/L: the picture keeps its detail; W would zoom into flat colour), and the bytes
   received per second and the gateway's CPU per stream are reported. The synthetic frames are a simple picture plus
   a little noise; real model frames carry more detail and cost more bytes.
Needs Debian's chromium and the ``browser`` extra for step 1 (skipped with a note otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ipc.client import Client
from scripts import client as tool
from scripts.bench_json import out_path, parse_args, write_json
from scripts.browser import CHROMIUM, launch, wait_until
from scripts.local_gateway import LocalGateway
from scripts.local_server import ROOT, LocalServer
from web.tab import connect

MOUSE_DEG_PER_PX = 0.15  # play.js's sensitivity: degrees per pixel


def pick(values: list[float], q: float) -> float | None:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))] if values else None


class GatewayCpu:
    """CPU seconds of the gateway process over a wall interval."""

    def __init__(self, gateway: LocalGateway) -> None:
        assert gateway.process is not None
        self.process = psutil.Process(gateway.process.pid)

    def __enter__(self) -> GatewayCpu:
        times = self.process.cpu_times()
        self.cpu0, self.wall0 = times.user + times.system, time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        times = self.process.cpu_times()
        self.cpu = times.user + times.system - self.cpu0
        self.wall = time.monotonic() - self.wall0

    @property
    def share(self) -> float:
        return self.cpu / self.wall  # cores busy


def play_page(page: Any, timeline: dict[str, Any]) -> dict[str, Any]:
    """Play ``timeline`` by keys and mouse on the page until its session completes; what the page measured."""
    page.fill("#chunks", str(timeline["num_chunks"]))
    page.fill("#seed", str(timeline.get("seed", 0)))
    wait_until(page, "() => window.worldstream.connected && !document.getElementById('start').disabled")
    page.click("#start")
    wait_until(page, "() => window.worldstream.session !== null", timeout_s=30)
    box = page.locator("#video").bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.click(x, y)  # focus and pointer lock, before the clock starts
    ready, held = time.monotonic(), set()
    for event in timeline["events"]:
        time.sleep(max(0.0, ready + event["t"] - time.monotonic()))
        keys = set(event.get("keys", ""))
        for key in sorted(held - keys):
            page.keyboard.up(key)
        for key in sorted(keys - held):
            page.keyboard.down(key)
        held = keys
        for key in event.get("taps", ""):
            page.keyboard.press(key)
        dx, dy = event.get("mouse", (0.0, 0.0))
        if dx or dy:
            x, y = x + dx / MOUSE_DEG_PER_PX, y + dy / MOUSE_DEG_PER_PX
            page.mouse.move(x, y)
    wait_until(page, "() => window.worldstream.closed !== null", timeout_s=60, poll_s=0.1)
    page.wait_for_timeout(300)
    return page.evaluate("""() => { const w = window.worldstream; return {i2p: w.i2p, c2o: w.c2o,
        gateway: w.gatewayI2p, painted: w.painted, droppedPage: w.droppedPage, dropped: w.droppedGateway,
        bytes: w.bytes}; }""")


def photon_round_trips(server: LocalServer, gateway: LocalGateway, rounds: int) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    timeline = tool.DEFAULT_TIMELINE
    page_i2p: list[float] = []
    gateway_i2p: list[float] = []  # the page's inputs, timed at the gateway: sent to the server -> chunk back
    client_i2p: list[float] = []
    page_c2o: list[float] = []
    client_c2o: list[float] = []
    cpu: list[float] = []
    with sync_playwright() as playwright, tempfile.TemporaryDirectory() as profile:
        browser = launch(playwright, profile)
        page = browser.new_page()
        page.goto(gateway.url)
        for round_ in range(rounds):
            with GatewayCpu(gateway) as usage:
                measured = play_page(page, timeline)
            cpu.append(usage.share)
            page_i2p += measured["i2p"]
            gateway_i2p += measured["gateway"]
            page_c2o += measured["c2o"]
            with Client(server.endpoint) as client:
                played = tool.play_live(client, (ROOT / "assets" / "start.png").read_bytes(), timeline)
            client_i2p += [v * 1000 for c in played.chunks for v in c.input_to_photon_s.values()]
            client_c2o += [c.facts.times.control_to_output * 1000 for c in played.chunks
                           if c.facts.times.control_to_output is not None]
            print(f"  round {round_ + 1}: page {len(measured['i2p'])} inputs, p50 {pick(measured['i2p'], .5):.0f} "
                  f"ms; client.py --live {len(played.chunks)} chunks; gateway CPU {usage.share:.3f} cores", flush=True)
        browser.close()
    return {
        "page_input_to_photon_ms": {"n": len(page_i2p), "p50": pick(page_i2p, .5), "p90": pick(page_i2p, .9)},
        "gateway_input_to_photon_ms": {"n": len(gateway_i2p), "p50": pick(gateway_i2p, .5),
                                       "p90": pick(gateway_i2p, .9)},
        "client_input_to_photon_ms": {"n": len(client_i2p), "p50": pick(client_i2p, .5),
                                      "p90": pick(client_i2p, .9)},
        "page_control_to_output_ms": {"p50": pick(page_c2o, .5), "p90": pick(page_c2o, .9)},
        "client_control_to_output_ms": {"p50": pick(client_c2o, .5), "p90": pick(client_c2o, .9)},
        "gateway_cpu_cores_while_a_page_plays": statistics.fmean(cpu),
    }


async def stream_for(port: int, seconds: float) -> dict[str, Any]:
    """One live session panning (L held) for ``seconds``; bytes and frames received."""
    async with connect(port) as tab:
        opened = await tab.open(seed=3)
        assert opened["type"] == "opened", opened
        await tab.state(1, keys="l")
        began = time.monotonic()
        await tab.drain(seconds)
        wall = time.monotonic() - began
        ended = await tab.close_session(timeout_s=60)  # a 480x832 chunk in flight takes seconds on a busy CPU
    if ended["type"] != "closed":
        raise RuntimeError(f"the session ended before the measurement did: {tab.texts[-3:]}")
    frames = [f for f in tab.frames if f[0] >= began]
    total = sum(16 + len(picture) for _, _, picture in frames)
    return {"frames": len(frames), "fps": len(frames) / wall, "bytes_per_s": total / wall,
            "bytes_per_frame": total / max(1, len(frames)), "size": f"{opened['height']}x{opened['width']}"}


def bytes_and_cpu(size: tuple[int, int], seconds: float) -> list[dict[str, Any]]:
    height, width = size
    overrides = [f"--stream.height={height}", f"--stream.width={width}"]
    rows = []
    with LocalServer("cpu-tiny", overrides) as server:
        for fmt in ("jpeg", "webp"):
            with LocalGateway(server.endpoint, args=["--format", fmt]) as gateway:
                asyncio.run(stream_for(gateway.port, 1.0))  # warm up: first session, first encoder use
                with GatewayCpu(gateway) as usage:
                    row = asyncio.run(stream_for(gateway.port, seconds))
                # Per frame sent, the CPU covers the frame's encode and its share of receiving its chunk (12 frames
                # a chunk are sent whenever the server runs at or below real time), so x16 is a 16 fps stream's cost.
                per_frame_s = usage.cpu / max(1, row["frames"])
                row.update(format=fmt, gateway_cpu_cores=usage.share, gateway_cpu_ms_per_frame=1000 * per_frame_s,
                           bytes_per_s_at_16fps=16 * row["bytes_per_frame"], gateway_cores_at_16fps=16 * per_frame_s)
                rows.append(row)
                print(f"  {row['size']} {fmt}: {row['fps']:.1f} fps shown, "
                      f"{row['bytes_per_frame'] / 1024:.1f} KiB/frame -> "
                      f"{16 * row['bytes_per_frame'] / 1024:.0f} KiB/s at 16 fps; gateway CPU "
                      f"{1000 * per_frame_s:.1f} ms per frame sent -> {16 * per_frame_s:.3f} cores at 16 fps "
                      f"(measured {usage.share:.3f} cores at {row['fps']:.1f} fps)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--sizes", default="160x256,480x832", help="frame sizes (height x width) of step 3")
    parser.add_argument("--no-page", action="store_true", help="skip step 1 (the page in Chromium)")
    parser.add_argument("--json", type=Path, default=out_path("bench_web.json"))
    args = parse_args(parser, argv, {"rounds": 1, "seconds": 1.0, "sizes": "160x256", "no_page": True})
    results: dict[str, Any] = {}
    try:
        import playwright  # noqa: F401
        browser = CHROMIUM.exists() and not args.no_page
    except ImportError:
        browser = False
    if browser:
        print("input-to-photon, page vs scripts/client.py --live (cpu-tiny, same server, alternating):", flush=True)
        with LocalServer("cpu-tiny") as server, LocalGateway(server.endpoint) as gateway:
            results["photon"] = photon = photon_round_trips(server, gateway, args.rounds)
        page, client = photon["page_input_to_photon_ms"], photon["client_input_to_photon_ms"]
        print(f"input-to-photon p50/p90: page {page['p50']:.0f}/{page['p90']:.0f} ms (n={page['n']}), "
              f"client.py --live {client['p50']:.0f}/{client['p90']:.0f} ms (n={client['n']}); "
              f"page/client p50 {page['p50'] / client['p50']:.2f}, p90 {page['p90'] / client['p90']:.2f}")
        hop = photon["gateway_input_to_photon_ms"]
        print(f"  the page's inputs timed at the gateway (its AsyncClient: sent -> chunk received): "
              f"{hop['p50']:.0f}/{hop['p90']:.0f} ms; the browser side adds the rest")
        c2o_page, c2o_client = photon["page_control_to_output_ms"], photon["client_control_to_output_ms"]
        print(f"control-to-output p50 (server clock) in the same runs: page sessions {c2o_page['p50']:.0f} ms, "
              f"client.py sessions {c2o_client['p50']:.0f} ms; gateway CPU while a page plays "
              f"{photon['gateway_cpu_cores_while_a_page_plays']:.3f} cores")
    else:
        print("(--no-page, or no /usr/bin/chromium or no playwright: the page's input-to-photon is not measured)")
    print("bytes and gateway CPU per stream:", flush=True)
    sizes = [tuple(int(v) for v in size.split("x")) for size in args.sizes.split(",")]
    results["streams"] = [row for height, width in sizes for row in bytes_and_cpu((height, width), args.seconds)]
    write_json(args.json, results, smoke=args.smoke)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
