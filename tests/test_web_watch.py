"""A share link through the web gateway: ``python -m web`` in front of the session's shared 7-rank CPU server, two
real WebSockets (``web.tab``): one tab plays, the other watches its session read-only with the token of its
``opened``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from scripts.local_gateway import LocalGateway
from scripts.local_server import LocalServer
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
