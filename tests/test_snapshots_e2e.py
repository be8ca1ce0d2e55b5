"""Save, restore and fork through a real 7-rank CPU server (cpu-tiny: condition + coordinator on rank 0, decode on
rank 1, a 5-rank DiT group, gloo), its snapshot folder a temporary directory: frames bit-identical to the
uninterrupted session's, and every kind of snapshot it must refuse refused with what differs named."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ipc.client import BadSnapshot, Client, ServerError, Snapshot
from runtime.snapshots import MANIFEST, new_snapshot_id
from scripts.local_server import ROOT, LocalServer
from tests.shared import FAST

pytestmark = pytest.mark.multiprocess

IMAGE = (ROOT / "assets" / "start.png").read_bytes()
CHUNKS = 7
SAVE_AFTER = 3  # chunks 0..2 run before the save: the boundary is chunk 3
KEYS = ["w", "d", "wj", "", "l", "sa", "i"]  # one per chunk: the camera moves differently in each


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    folder = tmp_path_factory.mktemp("snapshots")
    # a budget of one snapshot: every test here saves before it restores or forges, so each keeps what it needs
    with LocalServer("cpu-tiny", [*FAST, f"--snapshots.dir={folder}", "--server.max_sessions=3",
                                  "--snapshots.max_count=1"]) as running:
        running.snapshots = folder  # type: ignore[attr-defined]
        yield running


def folder_of(server: LocalServer) -> Path:
    return server.snapshots  # type: ignore[attr-defined,no-any-return]


def run(client: Client, session: str, first: int, keys: list[str]) -> dict[int, np.ndarray]:
    """Send the controls of chunks first.. (one key string each) and collect their frames."""
    frames: dict[int, np.ndarray] = {}
    for offset, held in enumerate(keys):
        client.control(session, first + offset, keys=held)
    for _ in keys:
        chunk = client.next_chunk(session, timeout_s=60)
        frames[chunk.index] = chunk.frames.copy()
    return frames


def saved_session(client: Client) -> tuple[dict[int, np.ndarray], Snapshot]:
    """A session that is saved after its first SAVE_AFTER chunks and runs on to the end: its frames and snapshot."""
    info = client.open(IMAGE, prompt="a quiet harbour", seed=7, num_chunks=CHUNKS)
    frames = run(client, info.id, 0, KEYS[:SAVE_AFTER])  # every control sent is consumed: nothing runs ahead
    snapshot = client.save(info.id)
    frames |= run(client, info.id, SAVE_AFTER, KEYS[SAVE_AFTER:])
    client.wait_closed(info.id, timeout_s=60)
    return frames, snapshot


def test_a_restored_session_and_a_fork_give_the_uninterrupted_sessions_frames_bit_for_bit(
        server: LocalServer) -> None:  # fmt: skip
    with Client(server.endpoint) as client:
        reference = client.open(IMAGE, prompt="a quiet harbour", seed=7, num_chunks=CHUNKS)
        expected = run(client, reference.id, 0, KEYS)  # never saved
        client.wait_closed(reference.id, timeout_s=60)
        frames, snapshot = saved_session(client)
        assert snapshot.chunk == SAVE_AFTER and snapshot.files == 7 and snapshot.bytes > 0
        assert all(np.array_equal(frames[i], expected[i]) for i in range(CHUNKS)), "a save changed the stream"
        manifest = json.loads((folder_of(server) / snapshot.id / MANIFEST).read_bytes())
        assert manifest["chunk"] == SAVE_AFTER and len(manifest["files"]) == 7

        for _ in range(2):  # restoring twice is a fork: both continue exactly as the original did
            restored = client.open(restore=snapshot.id)
            assert restored.first_chunk == SAVE_AFTER and restored.num_chunks == CHUNKS
            got = run(client, restored.id, SAVE_AFTER, KEYS[SAVE_AFTER:])
            assert sorted(got) == list(range(SAVE_AFTER, CHUNKS))
            for i in range(SAVE_AFTER, CHUNKS):
                assert np.array_equal(got[i], expected[i]), f"chunk {i} of the restored session differs"
            client.wait_closed(restored.id, timeout_s=60)

        fork = client.open(restore=snapshot.id)  # a fork driven differently goes its own way
        other = run(client, fork.id, SAVE_AFTER, ["a"] * (CHUNKS - SAVE_AFTER))
        assert not np.array_equal(other[CHUNKS - 1], expected[CHUNKS - 1])
        client.wait_closed(fork.id, timeout_s=60)


def test_a_restored_session_refuses_a_control_before_its_snapshot_chunk(server: LocalServer) -> None:
    with Client(server.endpoint) as client:
        _, snapshot = saved_session(client)
        restored = client.open(restore=snapshot.id)
        with pytest.raises(ServerError, match="expected index 3"):
            client.control(restored.id, 0, keys="w")
        client.close(restored.id)


def forged(server: LocalServer, snapshot: str, change: dict[str, object] | None = None,
           identity: dict[str, object] | None = None, geometry: dict[str, object] | None = None) -> str:
    """A copy of ``snapshot`` under a new id, its manifest changed."""
    new = new_snapshot_id()
    shutil.copytree(folder_of(server) / snapshot, folder_of(server) / new)
    manifest = json.loads((folder_of(server) / new / MANIFEST).read_bytes())
    manifest["id"] = new
    manifest.update(change or {})
    manifest["identity"].update(identity or {})
    manifest["geometry"].update(geometry or {})
    (folder_of(server) / new / MANIFEST).write_text(json.dumps(manifest))
    return new


def test_snapshots_of_another_model_layout_degree_or_geometry_are_refused_naming_the_difference(
        server: LocalServer) -> None:  # fmt: skip
    with Client(server.endpoint) as client:
        _, snapshot = saved_session(client)
        cases = {
            "model": forged(server, snapshot.id, identity={"model": "lingbot-fast|v1|/ckpt"}),
            "sequence-parallel degree 4": forged(server, snapshot.id, identity={"dit": [2, 3, 4, 5]}),
            "layout layout 'split7'": forged(server, snapshot.id, identity={"layout": "split7"}),
            "frame size 512x320": forged(server, snapshot.id, geometry={"height": 320, "width": 512}),
            "snapshot format 9": forged(server, snapshot.id, change={"format": 9}),
        }
        for what, forged_id in cases.items():
            with pytest.raises(BadSnapshot, match=what) as refused:  # the SDK's class for the code
                client.open(restore=forged_id)
            assert refused.value.code == "bad_snapshot"


def test_bad_ids_truncated_corrupt_and_hand_made_snapshots_are_refused_and_the_server_serves_on(
        server: LocalServer) -> None:  # fmt: skip
    folder = folder_of(server)
    with Client(server.endpoint) as client:
        _, snapshot = saved_session(client)
        for bad in ("../../etc/passwd", "x" * 21, new_snapshot_id()):  # a path, a wrong shape, an id never saved
            with pytest.raises(ServerError) as refused:
                client.open(restore=bad)
            assert refused.value.code == "bad_snapshot"

        truncated = forged(server, snapshot.id)
        path = folder / truncated / "rank3-denoise.safetensors"
        path.write_bytes(path.read_bytes()[:-5])
        with pytest.raises(ServerError, match=r"rank3-denoise\.safetensors has .* bytes") as refused:
            client.open(restore=truncated)
        assert refused.value.code == "bad_snapshot"

        corrupt = forged(server, snapshot.id)  # same size, one byte flipped: the rank's hash check finds it
        path = folder / corrupt / "rank4-denoise.safetensors"
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
        with pytest.raises(ServerError, match=r"rank4-denoise\.safetensors is corrupt"):
            client.open(restore=corrupt)

        hand_made = forged(server, snapshot.id)  # a file that hashes right but is not safetensors
        path = folder / hand_made / "rank1-decode.safetensors"
        path.write_bytes(b"\x80\x04pickle?" + bytes(len(path.read_bytes()) - 9))
        manifest = json.loads((folder / hand_made / MANIFEST).read_bytes())
        import hashlib

        for entry in manifest["files"]:
            if entry["name"] == "rank1-decode.safetensors":
                entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        (folder / hand_made / MANIFEST).write_text(json.dumps(manifest))
        with pytest.raises(ServerError, match="not a safetensors file"):
            client.open(restore=hand_made)

        restored = client.open(restore=snapshot.id)  # the good one still restores
        assert restored.first_chunk == SAVE_AFTER
        client.close(restored.id)


def test_only_the_owner_of_a_session_can_save_it(server: LocalServer) -> None:
    with Client(server.endpoint) as owner, Client(server.endpoint) as other:
        info = owner.open(IMAGE, num_chunks=4)
        with pytest.raises(ServerError) as refused:
            other.save(info.id)
        assert refused.value.code == "unknown_session"
        owner.close(info.id)


def test_a_save_over_the_budget_deletes_the_older_snapshot_whose_restore_is_then_refused(server: LocalServer) -> None:
    unknown = folder_of(server) / "the operator's"
    unknown.mkdir(exist_ok=True)
    with Client(server.endpoint) as client:
        info = client.open(IMAGE, num_chunks=4)
        run(client, info.id, 0, ["w"])
        first = client.save(info.id)
        run(client, info.id, 1, ["d"])
        second = client.save(info.id)  # snapshots.max_count = 1: the first goes
        client.close(info.id)
        deadline = time.monotonic() + 30  # the shell lists the folder and deletes off rank 0's loop, after the reply
        while (folder_of(server) / first.id).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not (folder_of(server) / first.id).exists() and (folder_of(server) / second.id / MANIFEST).is_file()
        assert unknown.is_dir()  # not a snapshot: never touched
        with pytest.raises(BadSnapshot, match=f"no snapshot {first.id}"):
            client.open(restore=first.id)
        folder = client.stats().snapshots
        assert (folder.count, folder.bytes, folder.max_count) == (1, second.bytes, 1)
