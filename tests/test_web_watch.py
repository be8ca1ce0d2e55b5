"""A share link through the web gateway: ``python -m web`` in front of the session's shared 7-rank CPU server. Two
real WebSockets (``web.tab``): one tab plays, the other watches its session read-only with the token of its
``opened``; then the same in Chromium: the play page's share link opens a watch page that draws the player's
frames and steers nothing."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from scripts.browser import launch, start_playing, wait_until, watched_page
from scripts.local_gateway import LocalGateway
from scripts.local_server import ROOT, LocalServer
from tests.test_web import playwright_or_skip
from web.tab import connect

pytestmark = pytest.mark.multiprocess


def test_a_tab_watches_another_tabs_session_read_only_until_it_ends(shared_server: LocalServer) -> None:
    async def scenario(port: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any], Any]:
        async with connect(port) as player, connect(port) as viewer:
            opened = await player.open(num_chunks=16)
            assert opened["type"] == "opened" and len(opened["watch_token"]) >= 32
            await viewer.ws.send_str(json.dumps({"type": "watch", "session": opened["session"], "token": "nope"}))
            refused = await viewer.next("error")
            await viewer.ws.send_str(json.dumps({"type": "watch", "session": opened["session"],
                                                 "token": opened["watch_token"]}))
            watching = await viewer.next("watching", "error")
            assert watching["type"] == "watching", watching
            await viewer.state(1, keys="w")
            steer = await viewer.next("error")
            await player.state(1, keys="w")
            played = [await player.next("chunk") for _ in range(16)]
            ended = await viewer.next("closed", timeout_s=30)
            seen = [t for t in viewer.texts if t["type"] == "chunk"]
            return played, seen, {"refused": refused, "steer": steer, "watching": watching}, ended

    with LocalGateway(shared_server.endpoint) as gateway:
        played, seen, answers, ended = asyncio.run(scenario(gateway.port))
    assert answers["refused"]["code"] == "unknown_session"
    assert answers["steer"]["code"] == "watch_only"
    indices = [c["index"] for c in seen]
    assert indices and indices == [c["index"] for c in played][-len(indices):]  # the player's, from its next chunk
    assert all(c["missed"] == 0 for c in seen) and ended["reason"] == "complete"


def test_the_play_pages_share_link_opens_a_watch_page_in_chromium(shared_server: LocalServer, tmp_path: Path) -> None:
    sync_playwright = playwright_or_skip()
    with LocalGateway(shared_server.endpoint) as gateway, sync_playwright() as playwright:
        browser = launch(playwright, tmp_path / "profile")
        errors: list[str] = []
        player = watched_page(browser, errors)
        start_playing(player, gateway.url, ROOT / "assets" / "start.png")
        link = player.get_attribute("#share", "href")
        assert link and "watch=" in link and player.is_visible("#share")
        viewer = watched_page(browser, errors)
        viewer.goto(link)
        wait_until(viewer, "() => window.worldstream.watching && window.worldstream.painted > 3", timeout_s=30)
        viewer.keyboard.down("w")  # a watcher steers nothing: no input leaves the page
        viewer.wait_for_timeout(300)
        viewer.keyboard.up("w")
        watched = viewer.evaluate("() => ({session: window.worldstream.session, revision: window.worldstream.input"
                                  ".revision, hint: document.getElementById('hint').textContent, share: "
                                  "document.getElementById('share').hidden})")
        played = player.evaluate("() => window.worldstream.session")
        player.click("#stop")
        wait_until(viewer, "() => window.worldstream.closed !== null", timeout_s=30)
        reason = viewer.evaluate("() => window.worldstream.closed.reason")
        browser.close()
    assert not errors
    assert watched["session"] == played and watched["revision"] == 0 and watched["share"]
    assert "read-only" in watched["hint"] and reason == "client"
