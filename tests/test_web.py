"""The web gateway end to end: the 7-rank CPU server, ``python -m web`` as its own process, real WebSockets, and a
real headless Chromium playing the page.

One server is shared by the module (fast synthetic stages: the stream runs far faster than real time, so the
latest-frame policy has frames to drop) with two gateways in front of it: an open one (``gateway``) and a
guarded one with an access token and a limit of one session (``guarded``). Tests close what they open; the last
one stops the server under an open session.

The browser test needs Debian's ``chromium`` (``/usr/bin/chromium``) and the Python ``playwright`` package (the
``browser`` extra); Playwright never downloads a browser here. Without them it skips with the reason, except in CI
(``CI`` set), where it fails: ``.ci/run`` installs both.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import os
import re
import time
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from PIL import Image

from ipc.client import Client, input_state
from scripts.browser import CHROMIUM, launch, wait_until
from scripts.local_gateway import LocalGateway
from scripts.local_server import ROOT, LocalServer
from web.tab import Tab, connect

pytestmark = pytest.mark.multiprocess

IMAGE_PATH = ROOT / "assets" / "start.png"
FAST = ["--synthetic.encode_s=0.01", "--synthetic.denoise_s=0.03", "--synthetic.decode_s=0.015"]
TOKEN = "s3cret-token"
SCREENSHOT = ROOT / "out" / "web-play.png"
SHOWING_W = """() => { const w = window.worldstream, last = w.paintLog[w.paintLog.length - 1];
                       const chunk = last && w.chunkByIndex.get(last[0]); return chunk && chunk.keys.includes('w'); }"""


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    # client_timeout_s stays 10 s: a release sooner is the gateway's; server.drain_s=0: its SIGTERM stops at once
    # (test_zz_...: the tab is told shutdown; a drain's own path is test_drain_e2e.py's)
    with LocalServer("cpu-tiny", [*FAST, "--server.drain_s=0"]) as running:
        yield running


@pytest.fixture(scope="module")
def gateway(server: LocalServer) -> Iterator[LocalGateway]:
    with LocalGateway(server.endpoint) as running:
        yield running


@pytest.fixture(scope="module")
def guarded(server: LocalServer) -> Iterator[LocalGateway]:
    with LocalGateway(server.endpoint, args=["--token", TOKEN, "--max-sessions", "1"]) as running:
        yield running


# ------------------------------------------------------------------------------------------------ helpers


def tab(gw: LocalGateway, token: str | None = None, origin: str | None = "same",
        host: str | None = None) -> AbstractAsyncContextManager[Tab]:
    return connect(gw.port, token=token, origin=origin, host=host)


async def health(gw: LocalGateway, token: str | None = None) -> tuple[int, dict[str, Any] | str]:
    query = f"?token={token}" if token is not None else ""
    async with aiohttp.ClientSession() as session, session.get(f"{gw.url}healthz{query}") as reply:
        json_body = reply.content_type == "application/json"
        return reply.status, (await reply.json() if json_body else await reply.text())


def close_reason(server: LocalServer, session: str) -> str | None:
    """Why the server closed ``session``, from its log (stats show a client only its own sessions); None: open."""
    found = re.search(rf"session {session} closed \((\w+)\)", server.log_path.read_text(errors="replace"))
    return found.group(1) if found else None


async def released(server: LocalServer, session: str, within_s: float) -> str:
    """The reason the server gives once it closed ``session`` (fails after ``within_s``)."""
    began = time.monotonic()
    while (reason := close_reason(server, session)) is None:
        assert time.monotonic() - began < within_s, f"session {session} still open after {within_s} s"
        await asyncio.sleep(0.05)
    return reason


def released_now(server: LocalServer, session: str, within_s: float) -> str:
    """``released`` for code that already runs inside an event loop (Playwright's sync API)."""
    began = time.monotonic()
    while (reason := close_reason(server, session)) is None:
        assert time.monotonic() - began < within_s, f"session {session} still open after {within_s} s"
        time.sleep(0.05)
    return reason


# ------------------------------------------------------------------------------------------------ serving, safety


def test_the_gateway_serves_the_page_its_files_and_the_sample_image(gateway: LocalGateway) -> None:
    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            async with session.get(gateway.url) as page:
                assert page.status == 200 and 'src="/static/play.js"' in await page.text()
                assert "default-src 'self'" in page.headers["Content-Security-Policy"]
                assert page.headers["Referrer-Policy"] == "no-referrer"  # a token in the URL never leaks
            for path in ("static/play.js", "static/play.css", "sample.png"):
                async with session.get(gateway.url + path) as reply:
                    assert reply.status == 200, path
            async with session.get(gateway.url + "static/../../pyproject.toml") as reply:
                assert reply.status in (403, 404)

    asyncio.run(scenario())


def test_a_websocket_from_another_sites_page_is_refused(gateway: LocalGateway) -> None:
    async def scenario() -> None:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            async with tab(gateway, origin="http://evil.example"):
                pass
        assert refused.value.status == 403
        async with tab(gateway, origin="same"), tab(gateway, origin=None):  # the page itself; a non-browser client
            pass

    asyncio.run(scenario())


def test_a_request_naming_another_host_is_refused_so_dns_rebinding_gets_nothing(gateway: LocalGateway) -> None:
    async def scenario() -> None:
        headers = {"Host": f"evil.example:{gateway.port}"}
        async with aiohttp.ClientSession() as session, session.get(gateway.url, headers=headers) as reply:
            assert reply.status == 403 and "unknown host" in await reply.text()
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            async with tab(gateway, origin=f"http://evil.example:{gateway.port}", host=headers["Host"]):
                pass
        assert refused.value.status == 403

    asyncio.run(scenario())


def test_with_a_token_the_websocket_and_health_check_need_it(guarded: LocalGateway) -> None:
    async def scenario() -> None:
        for token in (None, "wrong"):
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                async with tab(guarded, token=token):
                    pass
            assert refused.value.status == 401
            assert (await health(guarded, token))[0] == 401
        async with tab(guarded, token=TOKEN):
            status, body = await health(guarded, TOKEN)
            assert status == 200 and isinstance(body, dict) and body["tabs"] == 1

    asyncio.run(scenario())


# ------------------------------------------------------------------------------------------------ sessions


def test_bad_page_messages_get_clear_errors_and_the_session_streams_on(gateway: LocalGateway) -> None:
    async def scenario() -> None:
        async with tab(gateway) as page:
            opened = await page.open(prompt="bad input", seed=3)
            assert opened["type"] == "opened", opened
            await page.state(5, keys="w")
            for bad, code in [
                ("nonsense", "bad_message"),
                (json.dumps({"type": "state", "keys": ["x"], "revision": 6}), "unknown_keys"),
                (json.dumps({"type": "state", "keys": [], "revision": 5}), "stale_revision"),  # not newer than 5
                (json.dumps({"type": "teleport"}), "bad_message"),
                (json.dumps({"type": "state", "keys": [], "revision": 6, "pad": "x" * 10000}), "too_large"),
            ]:
                await page.ws.send_str(bad)
                error = await page.next("error")
                assert error["code"] == code and error["message"], (bad[:40], error)
            refused = await page.open()
            assert (refused["code"], refused["message"]) == ("bad_request", "a session is already open in this tab: "
                                                                            "stop it first")
            await page.state(6, keys="d")  # the session and its revisions are as they were: 6 is next
            while (chunk := await page.next("chunk"))["revision"] < 6:
                assert chunk["keys"] in ([], ["w"])
            assert chunk["keys"] == ["d"]
            closed = await page.close_session()
            assert closed["reason"] == "client" and closed["summary"]["chunks"] >= chunk["index"] + 1
            assert "recent_chunks" not in closed["summary"]

    asyncio.run(scenario())


def test_a_stale_revision_from_the_page_is_refused_by_rank_0_and_changes_nothing(gateway: LocalGateway) -> None:
    async def scenario() -> None:
        async with tab(gateway) as page:
            opened = await page.open(prompt="stale input", seed=4)
            assert opened["type"] == "opened", opened
            await page.state(5, keys="w", mouse=(2.0, 0.0))
            while (chunk := await page.next("chunk"))["revision"] < 5:
                pass
            for revision in (5, 3):  # the same revision again, an older one: the gateway forwards both
                await page.state(revision, keys="s", mouse=(90.0, 0.0), taps="i")
                error = await page.next("error")
                assert (error["code"], error["session"]) == ("stale_revision", opened["session"]), error
                assert error["message"] == f"revision {revision} is not newer than 5, the last one the server " \
                                           "folded in", error  # rank 0's words: the gateway checks no revision
            await page.state(6, keys="d")
            turned = 0.0
            while (chunk := await page.next("chunk"))["revision"] < 6:
                assert chunk["keys"] == ["w"], chunk  # the refused states changed nothing: no s, no tap of i
                turned += chunk["mouse"][0]
            assert chunk["keys"] == ["d"] and turned + chunk["mouse"][0] <= 2.0  # nor their 90 degrees of turn
            await page.close_session()

    asyncio.run(scenario())


def test_a_bad_mouse_value_is_refused_with_the_same_words_via_the_page_and_via_the_sdk(
        server: LocalServer, gateway: LocalGateway) -> None:  # fmt: skip
    async def by_page() -> dict[str, Any]:
        async with tab(gateway) as page:
            assert (await page.open(seed=5))["type"] == "opened"
            await page.state(1, keys="w", mouse=(400.0, 0.0))
            error = await page.next("error")
            await page.close_session()
            return error

    page_error = asyncio.run(by_page())
    with Client(server.endpoint) as client:
        info = client.open(IMAGE_PATH.read_bytes(), live=True, pause_when_idle=True)
        client.control_state(info.id, input_state("w", 1, mouse=(400.0, 0.0)))
        sdk_error = client.error(timeout_s=20)
        client.close(info.id)
    assert sdk_error is not None and (sdk_error.code, sdk_error.session) == ("malformed", info.id)
    assert page_error["code"] == "bad_message"  # each side keeps its code; the words are the one check's
    assert page_error["message"] == sdk_error.message == "mouse yaw must be finite and within ±360 degrees, got 400.0"


def test_the_gateway_session_limit_answers_busy_and_a_closed_session_frees_its_slot(guarded: LocalGateway) -> None:
    async def scenario() -> None:
        async with tab(guarded, token=TOKEN) as first, tab(guarded, token=TOKEN) as second:
            assert (await first.open())["type"] == "opened"
            busy = await second.open()
            assert busy["code"] == "busy" and busy["retry_after_s"] > 0
            assert "at most 1 sessions" in busy["message"]
            await first.close_session()
            assert (await second.open())["type"] == "opened"  # the retry the page makes on its own
            await second.close_session()
        assert (await health(guarded, TOKEN))[1]["sessions"] == 0  # type: ignore[index]

    asyncio.run(scenario())


def test_a_bad_image_is_reported_as_bad_image_and_frees_the_slot(guarded: LocalGateway) -> None:
    async def scenario() -> None:
        async with tab(guarded, token=TOKEN) as page:
            refused = await page.open(image=b"these bytes are not a picture")
            assert refused["code"] == "bad_image", refused
            opened = await page.open()  # the only slot was given back
            assert opened["type"] == "opened"
            await page.close_session()

    asyncio.run(scenario())


def test_frames_reach_the_tab_in_order_newest_first_and_never_faster_than_the_stream_fps(
    gateway: LocalGateway,
) -> None:
    async def scenario() -> Tab:
        async with tab(gateway) as page:
            assert (await page.open(num_chunks=30, seed=1))["type"] == "opened"
            await page.state(1, keys="w")
            closed = await page.next("closed", timeout_s=60)
            assert closed["reason"] == "complete"
            await page.drain(1.0)
            return page

    page = asyncio.run(scenario())
    chunks = [m for m in page.texts if m["type"] == "chunk"]
    assert [c["index"] for c in chunks] == list(range(30))
    revision = {c["index"]: c["revision"] for c in chunks}
    order = [(h["chunk"], h["frame"]) for _, h, _ in page.frames]
    assert order == sorted(set(order)), "frames arrive in order, none twice"
    assert all(h["revision"] == revision[h["chunk"]] for _, h, _ in page.frames)
    # Frame k of the tab's stream has its playout slot >= the first chunk's arrival + k / fps, and the first chunk
    # comes after `opened`: so the last frame cannot arrive before `opened` + (n - 1) / fps (50 ms for transit).
    fps, opened = 16.0, next(m["_received"] for m in page.texts if m["type"] == "opened")
    assert len(page.frames) - 1 <= (page.frames[-1][0] - opened + 0.05) * fps, "faster than the stream's fps"
    dropped = chunks[-1]["dropped"]
    frames = sum(c["frames"] for c in chunks)
    assert dropped["superseded"] > 0  # the synthetic stream outruns real time: old frames went, new ones came
    assert len(page.frames) + dropped["superseded"] + dropped["late"] <= frames
    assert order[-1] == (29, 11), "the last chunk plays out whole after the session completes"
    picture = Image.open(io.BytesIO(page.frames[-1][2]))
    assert (picture.format, picture.size) == ("JPEG", (256, 160))
    per_frame = sum(len(p) for _, _, p in page.frames) / len(page.frames)
    print(f"\n{len(page.frames)} of {frames} frames sent, {per_frame / 1024:.1f} KiB per frame at 160x256, "
          f"{per_frame * fps / 1024:.0f} KiB/s at 16 fps")


def test_a_tab_that_disconnects_releases_its_session_on_the_server(server: LocalServer,
                                                                    gateway: LocalGateway) -> None:
    async def scenario() -> float:
        async with tab(gateway) as page:
            opened = await page.open()
            await page.state(1, keys="a")
            await page.next("chunk")
            assert close_reason(server, opened["session"]) is None
        # the WebSocket is gone (no close message was sent): the gateway must close the session itself
        return await released(server, opened["session"], within_s=9.0)

    assert asyncio.run(scenario()) == "client"  # the gateway closed it, not the server's client timeout
    assert asyncio.run(health(gateway))[1]["sessions"] == 0  # type: ignore[index]


# ------------------------------------------------------------------------------------------------ a real browser


def playwright_or_skip() -> Any:
    """Playwright's sync API with Debian's Chromium present; skips (fails in CI) with the reason otherwise."""
    reason = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        reason = "the playwright package is missing: pip install -e '.[browser]'"
    if reason is None and not CHROMIUM.exists():
        reason = f"no {CHROMIUM}: apt-get install chromium (Debian's package; no browser is downloaded)"
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the browser test cannot run in CI: {reason}")
        pytest.skip(reason)
    return sync_playwright


def test_a_person_plays_the_world_in_chromium(server: LocalServer, gateway: LocalGateway, tmp_path: Path) -> None:
    sync_playwright = playwright_or_skip()
    with sync_playwright() as playwright:
        browser = launch(playwright, tmp_path / "profile", accept_downloads=True)
        page = browser.new_page()
        page_errors: list[str] = []
        page.on("pageerror", lambda error: page_errors.append(str(error)))
        page.goto(gateway.url)
        wait_until(page, "() => window.worldstream.connected")
        # a file that claims to be a PNG but is not: the server's bad_image reaches the page as a message
        page.set_input_files("#image", files=[{"name": "broken.png", "mimeType": "image/png",
                                               "buffer": b"\x89PNG but not really"}])
        page.click("#start")
        wait_until(page, "() => window.worldstream.errors.some(e => e.code === 'bad_image')")
        banner = page.inner_text("#banner-text")
        page.set_input_files("#image", str(IMAGE_PATH))
        page.fill("#seed", "11")
        wait_until(page, "() => window.worldstream.connected && !document.getElementById('start').disabled")
        page.click("#start")
        wait_until(page, "() => window.worldstream.painted > 0", timeout_s=30)
        session = page.evaluate("() => window.worldstream.session")

        box = page.locator("#video").bounding_box()
        x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
        page.mouse.click(x, y)  # focus for the keys, pointer lock for the mouse
        for step in range(1, 9):  # look right and a little down
            page.mouse.move(x + 12 * step, y + 3 * step)
            page.wait_for_timeout(30)
        wait_until(page, "() => window.worldstream.chunks.some(c => c.mouse[0] !== 0)", timeout_s=20)
        page.keyboard.down("w")
        wait_until(page, SHOWING_W, timeout_s=20)
        SCREENSHOT.parent.mkdir(exist_ok=True)
        page.screenshot(path=str(SCREENSHOT))  # the first frames walking forward (the synthetic zoom is quick)
        page.wait_for_timeout(800)  # hold W a while
        page.keyboard.up("w")
        # every input sent has been applied and a frame showing it drawn
        wait_until(page, "() => { const w = window.worldstream; return w.lastApplied >= w.input.revision && "
                         "w.input.sent.size === 0; }", timeout_s=20)
        played = page.evaluate("""() => { const w = window.worldstream; return {
            chunks: w.chunks.map(c => ({index: c.index, keys: c.keys, mouse: c.mouse, revision: c.revision,
                                        i2p: c.i2p.map(v => v.ms)})),
            paintLog: w.paintLog, orderErrors: w.orderErrors, painted: w.painted, i2p: w.i2p,
            mouseSent: w.input.mouseSent, revision: w.input.revision}; }""")
        hud = {name: page.inner_text(f"#h-{name}") for name in ("chunk", "c2o", "i2p", "dropped", "fps")}

        page.evaluate("() => document.exitPointerLock()")
        with page.expect_download() as download:
            page.click("#trace")
        trace = json.loads(Path(download.value.path()).read_text())

        page.close()  # closing the tab releases the session on the server
        closed_because = released_now(server, session, within_s=9.0)
        browser.close()

    assert not page_errors
    assert banner.startswith("The server could not use this image"), banner
    indices = [c["index"] for c in played["chunks"]]
    assert indices == list(range(len(indices))), "chunk facts arrive in order, none missing"
    painted = [tuple(p) for p in played["paintLog"]]
    assert played["orderErrors"] == 0 and all(a < b for a, b in itertools.pairwise(painted)), "frames drawn in order"
    assert played["painted"] >= 10
    with_w = [c for c in played["chunks"] if "w" in c["keys"]]
    assert with_w and all(c["revision"] >= 1 for c in with_w), "the held key reached the model"
    applied = [sum(c["mouse"][axis] for c in played["chunks"]) for axis in (0, 1)]
    assert applied == pytest.approx(played["mouseSent"], abs=1e-6), "mouse motion applied once, none lost"
    assert played["mouseSent"][0] > 5  # the drag to the right turned the camera
    assert played["i2p"] and all(0 < v < 5000 for v in played["i2p"])
    assert re.search(r"p50 \d+ ms · p90 \d+ ms", hud["i2p"]) and re.search(r"p50 \d+ ms", hud["c2o"]), hud
    assert re.search(r"\d+ older frames", hud["dropped"]), hud
    ranks = {e["pid"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert ranks == set(range(7)), "the trace shows every rank"
    assert closed_because == "client"  # the gateway closed it, not the server's client timeout
    assert SCREENSHOT.stat().st_size > 10_000
    values = sorted(played["i2p"])
    print(f"\npage input-to-photon over {len(values)} inputs: p50 {values[len(values) // 2]:.0f} ms, "
          f"p90 {values[min(len(values) - 1, round(0.9 * (len(values) - 1)))]:.0f} ms; HUD: {hud}")


def test_the_gateway_refuses_to_start_when_no_server_answers(tmp_path: Path) -> None:
    gateway = LocalGateway("tcp://127.0.0.1:9", args=["--check-timeout", "1"], log_path=tmp_path / "gateway.log")
    with pytest.raises(RuntimeError, match="exited with 2") as failed:
        gateway.start()
    assert "no worldstream server answers at tcp://127.0.0.1:9" in str(failed.value)


# ------------------------------------------------------------------------------------------------ server end


def test_zz_the_server_shutting_down_reaches_the_tab_as_shutdown(server: LocalServer, gateway: LocalGateway) -> None:
    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        async with tab(gateway) as page:
            assert (await page.open())["type"] == "opened"
            await page.next("chunk")
            stopping = asyncio.get_running_loop().run_in_executor(None, server.stop)
            error = await page.next("error", timeout_s=30)
            closed = await page.next("closed", timeout_s=30)
            assert await stopping == 0
            return error, closed

    error, closed = asyncio.run(scenario())
    assert error["code"] == "shutdown" and "shutting down" in error["message"]
    assert closed["reason"] == "shutdown"
    status, body = asyncio.run(health(gateway))  # the gateway lives on, and says its server is gone
    assert status == 503 and body["ok"] is False and body["sessions"] == 0  # type: ignore[index]
