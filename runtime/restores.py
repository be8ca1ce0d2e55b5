"""What a snapshot's manifest must satisfy to start a session on this server, and the length it runs to.

``runtime.snapshots`` checks what any server would (the manifest's size, shape and numbers, its files present);
here are the limits of this server, which a manifest is held to as a client's ``open`` is (a shared snapshot folder
is writable by others: a manifest is input like a client's): the identity and geometry (``refusal``), the session
length, the prompt length. An ``open(restore=...)`` may give its own ``num_chunks``: like the snapshot's, it counts
chunks from the saved session's chunk 0, and it must leave at least one chunk to run.
"""

from __future__ import annotations

from collections.abc import Callable

from ipc.error_codes import ErrorCode
from runtime.client_types import ClientError
from runtime.snapshots import Geometry, Identity, Manifest, refusal


def restore_problem(manifest: Manifest, identity: Identity, here: Geometry | None, max_chunks: int,
                    max_prompt_chars: int) -> str | None:  # fmt: skip
    """Why this server cannot restore ``manifest`` (``here``: its geometry at the snapshot's frame size, None when
    it does not serve that size), or None."""
    why = refusal(manifest, identity, here)
    if why is not None:
        return why
    if manifest.num_chunks is not None and manifest.num_chunks > max_chunks:
        return f"a session of {manifest.num_chunks} chunks (this server: at most {max_chunks})"
    if len(manifest.prompt) > max_prompt_chars:
        return f"a prompt of {len(manifest.prompt)} characters (this server: at most {max_prompt_chars})"
    return None


def restorable(manifest: Manifest | None, error: str, identity: Identity,
               here: Callable[[int, int], Geometry | None], max_chunks: int, max_prompt_chars: int) -> Manifest:
    """The manifest a restore read (None: ``error`` says why there is none), once this server can restore it
    (``here``: its geometry at a frame size, None when it does not serve it); else ``bad_snapshot``."""
    if manifest is None:
        raise ClientError("bad_snapshot", error)
    g = manifest.geometry
    why = restore_problem(manifest, identity, here(g.height, g.width), max_chunks, max_prompt_chars)
    if why is not None:
        raise ClientError("bad_snapshot", f"snapshot {manifest.id} cannot be restored here: {why}")
    return manifest


def restored_length(manifest: Manifest, asked: int | None, max_chunks: int) -> int | None:
    """The restored session's length in chunks from the saved session's chunk 0 (None: endless): the open's
    ``num_chunks`` when it gives one, else the snapshot's. ``ClientError`` ``bad_request`` when the open's leaves
    nothing to run after the snapshot's chunk or passes this server's limit (never silently replaced)."""
    if asked is None:
        return manifest.num_chunks
    if not manifest.chunk < asked <= max_chunks:
        raise ClientError(ErrorCode.BAD_REQUEST, f"num_chunks {asked}: a session restored at chunk {manifest.chunk} "
                          f"must run to a length in {manifest.chunk + 1}..{max_chunks} (counted from the saved "
                          "session's chunk 0)")
    return asked
