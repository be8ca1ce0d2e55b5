"""Rank 0's work off its loop (the shell's side of ``DecodeImage``, ``ReadManifest``, ``WriteManifest``,
``ListSnapshots`` and ``DropSnapshotFiles``): each runs on a worker thread or is small enough for the loop, and
what finished comes back as the core's events at the next turn. Nothing here decides anything.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

from runtime import core_types as ct
from runtime.images import decode_image
from runtime.snapshots import SnapshotStore, read_manifest, remove_files, write_manifest

log = logging.getLogger(__name__)

OffLoopOutput = ct.DecodeImage | ct.ReadManifest | ct.WriteManifest | ct.ListSnapshots | ct.DropSnapshotFiles


class OffLoop:
    """The jobs in flight and the threads that run them."""

    def __init__(self) -> None:
        self.decoding: dict[int, Future[object]] = {}  # start images being decoded, by ticket
        self.image_decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="image-decode")
        self.reading: dict[int, Future[tuple[object, str]]] = {}  # restores' manifests being read, by ticket
        self.listing: list[tuple[str, Future[list[object]]]] = []  # the folder listed for the budget, after a save
        self.written: list[ct.Event] = []  # manifests written on the loop, answered at the next turn
        self.manifest_reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="manifest-read")
        self.file_remover = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot-remove")

    def start(self, output: OffLoopOutput, store: SnapshotStore) -> None:
        if isinstance(output, ct.DecodeImage):
            self.decoding[output.ticket] = self.image_decoder.submit(decode_image, output.data, output.max_pixels)
        elif isinstance(output, ct.ReadManifest):  # off the loop: a shared folder may hold anything
            self.reading[output.ticket] = self.manifest_reader.submit(read_manifest, store, output.snapshot)
        elif isinstance(output, ct.WriteManifest):  # a small JSON file: on the loop, as before it was an output
            self.written.append(ct.ManifestWritten(output.manifest.id, write_manifest(store, output.manifest)))
        elif isinstance(output, ct.ListSnapshots):  # reads every manifest: never on the loop
            self.listing.append((output.written, self.manifest_reader.submit(store.listing)))
        else:
            self._drop_files(output, store)

    def done(self) -> list[ct.Event]:
        """What finished since the last turn, as events."""
        events, self.written = self.written, []
        for ticket in [t for t, future in self.decoding.items() if future.done()]:
            future = self.decoding.pop(ticket)
            error = future.exception()
            events.append(ct.ImageDecoded(ticket, None, str(error)) if error is not None  # BadImage says why
                          else ct.ImageDecoded(ticket, future.result()))  # type: ignore[arg-type]
        for ticket in [t for t, future in self.reading.items() if future.done()]:
            read = self.reading.pop(ticket)
            error = read.exception()  # a bug in the read costs this restore, never the loop
            events.append(ct.ManifestRead(ticket, None, f"the snapshot cannot be read ({type(error).__name__})")
                          if error is not None else ct.ManifestRead(ticket, *read.result()))  # type: ignore[arg-type]
        while self.listing and self.listing[0][1].done():  # in order: each after its save
            written, listed = self.listing.pop(0)
            if listed.exception() is not None:  # a save that succeeded never fails for it: the budget waits
                log.warning("the snapshot folder could not be listed: %r", listed.exception())
            stored = None if listed.exception() is not None else tuple(listed.result())
            events.append(ct.SnapshotsListed(written, stored))  # type: ignore[arg-type]
        return events

    def _drop_files(self, output: ct.DropSnapshotFiles, store: SnapshotStore) -> None:
        """Delete a failed save's folder (it has no manifest) or a snapshot over the budget (its manifest first);
        one it cannot delete costs disk, never the server."""
        try:
            folder = store.unlist(output.snapshot)
            self.file_remover.submit(remove_files, folder)  # gigabytes: never on the loop that serves the streams
        except (OSError, ValueError) as error:
            log.warning("could not delete the files of %s snapshot %s: %s", "expired" if output.expired else "failed",
                        output.snapshot, error)

    def shutdown(self) -> None:
        self.image_decoder.shutdown(wait=False, cancel_futures=True)
        self.manifest_reader.shutdown(wait=False, cancel_futures=True)
        self.file_remover.shutdown(wait=True)  # a snapshot's files half removed would be left for ever
