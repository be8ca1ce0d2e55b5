"""Save and fork through the web gateway: ``python -m web`` in front of a 7-rank CPU server (synthetic stages) whose
snapshot folder is a temporary directory. Over real WebSockets (``web.tab``) one tab saves its session and a second
tab forks from the snapshot and gets chunks from the snapshot's chunk on; then the same in Chromium: the play page's
Save button, its fork link opening a new tab, and frames drawn there. Last, the server is stopped under a playing
page (SIGTERM, no router): the page is told its world was saved, and its fork link resumes it on the server that
comes back on the same port and snapshot folder."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from scripts.browser import launch, start_playing, wait_until, watched_page
from scripts.local_gateway import LocalGateway
from scripts.local_server import ROOT, LocalServer
from tests.shared import FAST, free_port
from tests.test_web import playwright_or_skip
from web.tab import connect

pytestmark = pytest.mark.multiprocess

CHUNKS = 12


def tiny_server(folder: Path, port: int) -> LocalServer:
    return LocalServer("cpu-tiny", [*FAST, f"--snapshots.dir={folder}", f"--server.port={port}"])


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("snapshots")


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[LocalServer]:
    with tiny_server(folder, free_port()) as running:
        yield running


@pytest.fixture(scope="module")
def gateway(server: LocalServer) -> Iterator[LocalGateway]:
    with LocalGateway(server.endpoint) as running:
        yield running


def test_a_tab_saves_and_another_tab_forks_from_the_snapshots_chunk(gateway: LocalGateway) -> None:
    async def scenario() -> dict[str, Any]:
        async with connect(gateway.port) as player, connect(gateway.port) as forker, \
                connect(gateway.port) as viewer:
            answers: dict[str, Any] = {"unsaved": await player.save()}  # no session yet: nothing to save
            opened = await player.open(prompt="a harbour", seed=5, num_chunks=CHUNKS)
            assert opened["type"] == "opened" and opened["first_chunk"] == 0 and opened["restored"] is None, opened
            await viewer.watch(opened["session"], opened["watch_token"])
            answers["viewer"] = await viewer.save()  # only the player saves its session
            await player.state(1, keys="w")
            await player.next("chunk")
            saved = await player.save()
            assert saved["type"] == "saved", saved
            answers["unknown"] = await forker.fork("A" * 22)  # well formed, never saved: refused, its slot returned
            forked = await forker.fork(saved["snapshot"])
            assert forked["type"] == "opened", forked
            await forker.state(1, keys="d")  # the fork is steered on its own
            answers["fork_closed"] = await forker.next("closed", timeout_s=60)
            answers["player_closed"] = await player.next("closed", timeout_s=60)
            answers |= {"saved": saved, "forked": forked, "fork_chunks": [t for t in forker.texts if t["type"] ==
                                                                            "chunk"], "fork_frames": forker.frames}
            return answers

    answers = asyncio.run(scenario())
    assert answers["unsaved"]["code"] == "no_session" and answers["viewer"]["code"] == "watch_only"
    assert answers["unknown"]["type"] == "error" and answers["unknown"]["code"] == "bad_snapshot", answers["unknown"]
    saved, forked = answers["saved"], answers["forked"]
    assert len(saved["snapshot"]) == 22 and saved["bytes"] > 0 and saved["files"] > 0 and saved["pause_s"] >= 0
    assert 1 <= saved["chunk"] < CHUNKS
    assert forked["first_chunk"] == saved["chunk"] and forked["restored"] == saved["snapshot"]
    assert forked["session"] != saved["session"]
    indices = [c["index"] for c in answers["fork_chunks"]]
    assert indices == list(range(saved["chunk"], CHUNKS)), indices  # the snapshot's numbering, to its end
    assert answers["fork_frames"] and min(h["chunk"] for _, h, _ in answers["fork_frames"]) >= saved["chunk"]
    assert answers["fork_closed"]["reason"] == answers["player_closed"]["reason"] == "complete"


def test_the_play_pages_save_button_and_fork_link_open_a_restored_session_in_chromium(
        gateway: LocalGateway, tmp_path: Path) -> None:
    sync_playwright = playwright_or_skip()
    with sync_playwright() as playwright:
        browser = launch(playwright, tmp_path / "profile")
        errors: list[str] = []
        player = watched_page(browser, errors)
        player.goto(gateway.url)
        wait_until(player, "() => window.worldstream.connected && !document.getElementById('start').disabled")
        assert player.is_disabled("#save") and not player.is_visible("#fork")  # no session: nothing to save
        player.set_input_files("#image", str(ROOT / "assets" / "start.png"))
        player.click("#start")
        wait_until(player, "() => window.worldstream.painted > 0", timeout_s=30)
        player.click("#save")
        wait_until(player, "() => window.worldstream.saves.length === 1", timeout_s=30)
        saved = player.evaluate("() => window.worldstream.saves[0]")
        link = player.get_attribute("#fork", "href")
        assert link and f"fork={saved['snapshot']}" in link and player.is_visible("#fork")
        wait_until(player, "() => document.getElementById('h-snapshot').textContent !== '–'")
        hud = player.inner_text("#h-snapshot")
        forked = watched_page(browser, errors)
        forked.goto(link)
        wait_until(forked, "() => window.worldstream.painted > 3", timeout_s=30)
        fork = forked.evaluate("() => ({opened: window.worldstream.opened, first: window.worldstream.chunks[0].index,"
                               " painted: window.worldstream.paintLog[0][0], session: window.worldstream.session})")
        forked_hud = forked.inner_text("#h-snapshot")
        for page in (player, forked):
            page.click("#stop")
            wait_until(page, "() => !window.worldstream.session", timeout_s=30)
        browser.close()
    assert not errors
    assert hud.startswith(f"{saved['snapshot']} · chunk {saved['chunk']}"), hud
    assert fork["opened"]["restored"] == saved["snapshot"] and fork["opened"]["first_chunk"] == saved["chunk"]
    assert fork["first"] == saved["chunk"] and fork["painted"] >= saved["chunk"]
    assert fork["session"] != saved["session"]
    assert forked_hud == f"forked from {saved['snapshot']} at chunk {saved['chunk']}", forked_hud


def test_a_page_whose_server_stops_is_told_its_world_was_saved_and_its_fork_link_resumes_it_on_the_next_server(
        server: LocalServer, gateway: LocalGateway, folder: Path, tmp_path: Path) -> None:
    # last in the module: it ends the shared server
    sync_playwright = playwright_or_skip()
    with sync_playwright() as playwright:
        browser = launch(playwright, tmp_path / "profile")
        errors: list[str] = []
        player = watched_page(browser, errors)
        start_playing(player, gateway.url, ROOT / "assets" / "start.png")
        assert server.process is not None and not player.is_visible("#fork")
        server.process.send_signal(signal.SIGTERM)
        wait_until(player, "() => window.worldstream.drained && window.worldstream.closed", timeout_s=60)
        drained = player.evaluate("() => ({notice: window.worldstream.drained, closed: window.worldstream.closed, "
                                  "arrived: window.worldstream.chunks.map((c) => c.index)})")
        link = player.get_attribute("#fork", "href")
        hint = player.inner_text("#hint")
        ended = "() => window.worldstream.errors.some((e) => ['shutdown', 'server_gone'].includes(e.code))"
        wait_until(player, ended, timeout_s=60)
        banner = player.inner_text("#banner-text")  # the server's end, heard after the notice, does not replace it
        assert player.is_visible("#fork")
        assert server.wait(60) == 0, server.log()
        with tiny_server(folder, int(server.endpoint.rsplit(":", 1)[1])):  # back, on the same port and folder
            resumed = watched_page(browser, errors)
            resumed.goto(link)
            wait_until(resumed, "() => window.worldstream.painted > 0", timeout_s=60)
            opened = resumed.evaluate("() => window.worldstream.opened")
            resumed.click("#stop")
            wait_until(resumed, "() => !window.worldstream.session", timeout_s=30)
        browser.close()
    assert not errors
    notice = drained["notice"]
    assert notice["session"] == drained["closed"]["session"] and len(notice["snapshot"]) == 22, notice
    assert drained["closed"]["reason"] == "drained" and "saved the world" in hint, (drained, hint)
    assert f"saved at chunk {notice['chunk']}" in banner, banner
    assert link and f"fork={notice['snapshot']}" in link
    assert max(drained["arrived"]) == notice["chunk"] - 1  # every chunk below the snapshot's came, none past it
    assert opened["restored"] == notice["snapshot"] and opened["first_chunk"] == notice["chunk"], opened
