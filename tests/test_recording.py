"""Recording and replay (``scripts/client.py --record`` / ``--replay --exact``) of sessions that change their steps,
change their prompt, save and restore, through a real 7-rank CPU server (cpu-tiny, synthetic, gloo): the replay
reproduces every frame and every chunk's facts (prompt revision, steps), saves at the same chunks, and a recording
of a restored session replays by restoring the same snapshot, or fails saying the snapshot is gone."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ipc.client import Client
from scripts import client as tool
from scripts.local_server import ROOT, LocalServer
from tests.shared import FAST

pytestmark = pytest.mark.multiprocess

IMAGE_PATH = ROOT / "assets" / "start.png"
# the ladder off: on a shared CPU it would lower steps at random, and the replay must ask for exactly the recorded ones
FLAGS = [*FAST, "--capacity.ladder=off"]
TIMELINE: dict[str, Any] = {
    "prompt": "a quiet harbour", "seed": 4, "num_chunks": 40, "events": [
        {"t": 0.02, "keys": "w"}, {"t": 0.1, "steps": 2}, {"t": 0.15, "keys": "d", "mouse": [3.0, 0.0]},
        {"t": 0.2, "save": True}, {"t": 0.25, "prompt": "a harbour in the rain"}, {"t": 0.3, "keys": "", "taps": "j"},
        {"t": 0.35, "steps": 1},
    ]}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    folder = tmp_path_factory.mktemp("snapshots")
    with LocalServer("cpu-tiny", [*FLAGS, f"--snapshots.dir={folder}"]) as running:
        running.snapshots = folder  # type: ignore[attr-defined]
        yield running


def cli(server: LocalServer, *args: str) -> int:
    return tool.main(["--endpoint", server.endpoint, "--image", str(IMAGE_PATH), *args])


def test_a_recorded_session_that_changes_steps_prompt_and_saves_replays_frame_for_frame(server: LocalServer,
                                                                                         tmp_path: Path) -> None:
    (tmp_path / "timeline.json").write_text(json.dumps(TIMELINE))
    record, replayed = tmp_path / "trace.json", tmp_path / "replay.json"
    assert cli(server, "--live", "--timeline", str(tmp_path / "timeline.json"), "--record", str(record)) == 0
    recorded = json.loads(record.read_text())
    applied = recorded["applied"]
    steps = [a["steps"] for a in applied]
    assert steps[0] == 4 and 2 in steps and steps[-1] == 1  # both steps changes reached chunks
    assert [e["steps"] for e in recorded["events"] if "steps" in e] == [2, 1]
    (save,) = recorded["saves"]
    assert [e["snapshot"] for e in recorded["events"] if e.get("save")] == [save["snapshot"]]
    assert applied[-1]["prompt_revision"] == 1

    assert cli(server, "--replay", str(record), "--exact", "--json", str(replayed)) == 0
    out = json.loads(replayed.read_text())
    assert out["report"]["frames_match_recording"] is True
    assert [(c["index"], c["prompt_revision"], c["steps"]) for c in out["chunks"]] == [
        (a["index"], a["prompt_revision"], a["steps"]) for a in applied]
    (again,) = out["saves"]
    assert again["chunk"] == save["chunk"] and again["snapshot"] != save["snapshot"]  # a new snapshot, same boundary

    # the recording of a session restored from that snapshot replays by restoring it again
    restored_timeline = {"restore": save["snapshot"], "events": [{"t": 0.02, "keys": "a"}, {"t": 0.1, "steps": 4}]}
    with Client(server.endpoint) as client:
        live = tool.play_live(client, b"", restored_timeline)
    restored = tool.recording(restored_timeline, live)
    assert restored["first_chunk"] == save["chunk"] == restored["applied"][0]["index"]
    assert restored["applied"][-1]["steps"] == 4
    record_restored = tmp_path / "restored.json"
    record_restored.write_text(json.dumps(restored))
    assert cli(server, "--replay", str(record_restored), "--exact") == 0


def test_a_recording_of_a_restored_session_whose_snapshot_is_gone_fails_naming_it(
        server: LocalServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    with Client(server.endpoint) as client:
        info = client.open(IMAGE_PATH.read_bytes(), seed=1, num_chunks=40, live=True)
        client.live(info.id).press("w")
        client.next_chunk(info.id, timeout_s=60)
        snapshot = client.save(info.id)
        client.close(info.id)
        timeline = {"restore": snapshot.id, "events": [{"t": 0.01, "keys": "w"}]}
        restored = tool.recording(timeline, tool.play_live(client, b"", timeline))
    path = tmp_path / "restored.json"
    path.write_text(json.dumps(restored))
    shutil.rmtree(server.snapshots / snapshot.id)  # type: ignore[attr-defined]
    assert cli(server, "--replay", str(path), "--exact") == 2
    error = capsys.readouterr().err
    assert f"restores snapshot {snapshot.id}, which this server cannot restore" in error and "no snapshot" in error
