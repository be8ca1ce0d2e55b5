"""A new prompt from the play page: the gateway forwards a tab's ``prompt`` to the server and answers with the
revision and the first chunk that uses it; every chunk message names its prompt revision; in Chromium the prompt
box works during a session. The 7-rank CPU server (synthetic stages) behind ``python -m web``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.browser import launch, wait_until
from scripts.local_gateway import LocalGateway
from scripts.local_server import ROOT, LocalServer
from tests.shared import FAST
from tests.test_web import playwright_or_skip
from web.tab import connect

pytestmark = pytest.mark.multiprocess

IMAGE_PATH = ROOT / "assets" / "start.png"


@pytest.fixture(scope="module")
def gateway() -> Iterator[LocalGateway]:
    with LocalServer("cpu-tiny", FAST) as server, LocalGateway(server.endpoint) as running:
        yield running


def test_a_tab_changes_the_prompt_and_its_chunks_name_the_revision_from_the_announced_chunk(
        gateway: LocalGateway) -> None:
    async def scenario() -> None:
        async with connect(gateway.port) as page:
            refused = await page.set_prompt("no session yet")
            assert refused["type"] == "error" and refused["code"] == "no_session", refused
            opened = await page.open(prompt="a forest", seed=3)
            assert opened["type"] == "opened", opened
            await page.next("chunk")
            reply = await page.set_prompt("a desert")
            assert reply["type"] == "prompt" and reply["revision"] == 1 and reply["session"] == opened["session"]
            too_long = await page.set_prompt("p" * 2001)  # the server's max_prompt_chars: nothing changes
            assert too_long["type"] == "error" and too_long["code"] == "bad_request", too_long
            while (chunk := await page.next("chunk"))["index"] < reply["chunk"] + 1:
                assert chunk["prompt_revision"] == (1 if chunk["index"] >= reply["chunk"] else 0), chunk
            closed = await page.close_session()
            assert closed["type"] == "closed"
        chunks = [t for t in page.texts if t["type"] == "chunk"]
        assert [c["prompt_revision"] for c in chunks] == [int(c["index"] >= reply["chunk"]) for c in chunks]

    asyncio.run(scenario())


def test_the_play_pages_prompt_box_changes_the_prompt_during_a_session_in_chromium(
        gateway: LocalGateway, tmp_path: Path) -> None:
    sync_playwright = playwright_or_skip()
    with sync_playwright() as playwright:
        browser = launch(playwright, tmp_path / "profile")
        page = browser.new_page()
        page_errors: list[str] = []
        page.on("pageerror", lambda error: page_errors.append(str(error)))
        page.goto(gateway.url)
        wait_until(page, "() => window.worldstream.connected")
        assert page.is_disabled("#set-prompt")  # no session: nothing to change
        page.set_input_files("#image", str(IMAGE_PATH))
        wait_until(page, "() => !document.getElementById('start').disabled")
        page.click("#start")
        wait_until(page, "() => window.worldstream.painted > 0", timeout_s=30)
        page.fill("#prompt", "a snowy forest at night")
        page.click("#set-prompt")
        wait_until(page, "() => window.worldstream.prompts.length === 1", timeout_s=20)
        change = page.evaluate("() => window.worldstream.prompts[0]")
        wait_until(page, "() => window.worldstream.chunks.some(c => c.prompt_revision === 1)", timeout_s=20)
        chunks = page.evaluate("() => window.worldstream.chunks.map(c => [c.index, c.prompt_revision])")
        hud = page.inner_text("#h-prompt")
        page.click("#stop")
        wait_until(page, "() => !window.worldstream.session", timeout_s=20)
        browser.close()
    assert not page_errors
    assert change["revision"] == 1
    assert all(revision == int(index >= change["chunk"]) for index, revision in chunks), (change, chunks)
    assert hud.startswith("revision 1"), hud
