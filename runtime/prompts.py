"""The prompt revisions of one session on rank 0: which text each chunk attends to (``set_prompt``).

A session starts at revision 0 (the open's prompt). Each accepted ``set_prompt`` takes the next revision and is
encoded on the condition rank; once its context is encoded, rank 0 announces its broadcast to the DiT ranks and
from that moment every denoise it dispatches names the new revision (``DenoiseChunk.prompt_revision``). So the
switch chunk is the first chunk whose denoise had not been dispatched when the new context was announced: chunks
already dispatched keep the old text, and the DiT rank takes the new context from its mailbox before that chunk's
passes (it waits there only for the broadcast, never for the encode). A later revision announced before that chunk
was dispatched supersedes it at the same chunk: the older one is never used, and no chunk mixes two texts.

A save pins the boundary (``pin``): from the moment its tasks go out, the boundary chunk ``k`` uses the revision
announced then (the one whose context the snapshot keeps and whose text its manifest names); a revision encoded
meanwhile is announced only once chunk ``k`` was dispatched (``unpin``), so it starts at ``k + 1``. Without the pin
the snapshot could hold one text while chunk ``k`` of the uninterrupted session used another.

A restored session starts at its snapshot's revision and text (``starting``): its revisions continue the saved
session's numbering, as its chunks do, so its chunk facts equal the uninterrupted session's.

Bounded: at most ``MAX_PENDING`` revisions per session are encoding or announced-but-unused (their contexts sit
on the condition rank or in the DiT ranks' mailboxes), and the per-chunk record exists only for chunks in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_PENDING = 4  # revisions encoding or announced but not yet used by a dispatched denoise


class PromptBackpressure(Exception):
    """Too many prompt changes wait for their first chunk; the message says when to try again."""


@dataclass
class PromptRevisions:
    """See the module docstring. ``announced`` is the revision every denoise dispatched from now on uses."""

    latest: int = 0  # the latest revision accepted (revisions only grow, also past a failed encode)
    announced: int = 0  # the latest revision whose context was announced to the DiT ranks
    used: int = 0  # the revision of the latest dispatched denoise
    encoding: dict[int, int] = field(default_factory=dict)  # revision -> req of its set_prompt, while encoded
    unused: list[int] = field(default_factory=list)  # announced revisions no dispatched denoise used yet
    chunks: dict[int, int] = field(default_factory=dict)  # dispatched, not yet emitted chunk -> its revision
    texts: dict[int, str] = field(default_factory=dict)  # the text of every revision from ``used`` on
    pinned: int | None = None  # a save's boundary chunk, until dispatched: it keeps the revision announced at ``pin``
    ready: list[int] = field(default_factory=list)  # revisions encoded while pinned, announced at ``unpin``

    @classmethod
    def starting(cls, revision: int, text: str) -> PromptRevisions:
        """A session whose first chunk uses ``revision`` (0: a fresh session's open prompt; a restored session's
        snapshot revision)."""
        return cls(latest=revision, announced=revision, used=revision, texts={revision: text})

    def accept(self, req: int, text: str = "") -> int:
        """A valid ``set_prompt`` (request ``req``): its revision. ``PromptBackpressure`` when too many wait."""
        if len(self.encoding) + len(self.unused) >= MAX_PENDING:
            raise PromptBackpressure(f"{MAX_PENDING} prompt changes are waiting for their first chunk; send it again "
                                     "once the next chunk started")
        self.latest += 1
        self.encoding[self.latest] = req
        self.texts[self.latest] = text
        return self.latest

    def in_force(self) -> tuple[int, str]:
        """The revision (and its text) the next dispatched denoise uses, as things stand now."""
        return self.announced, self.texts.get(self.announced, "")

    def pin(self, chunk: int) -> tuple[int, str]:
        """A save's boundary: chunk ``chunk`` (not yet dispatched) uses the revision in force now, whatever is
        encoded before its dispatch. That revision and its text (the snapshot's)."""
        self.pinned = chunk
        return self.in_force()

    def encoded(self, revision: int) -> int | None:
        """``revision``'s context is encoded and its broadcast announced: denoises dispatched from now on use it.
        The req of its ``set_prompt`` (None: not one this session waits for, or deferred past a pinned boundary:
        ``unpin`` returns it then)."""
        if self.pinned is not None and revision in self.encoding:
            self.ready.append(revision)
            return None
        req = self.encoding.pop(revision, None)
        if req is None:
            return None
        assert revision > self.announced, f"revision {revision} announced after {self.announced}"  # encodes are FIFO
        self.announced = revision
        self.unused.append(revision)
        return req

    def failed(self, revision: int) -> int | None:
        """``revision`` could not be encoded: nothing changes but its request (returned, to be answered)."""
        self.texts.pop(revision, None)
        return self.encoding.pop(revision, None)

    def dispatched(self, index: int) -> int:
        """The denoise of chunk ``index`` was dispatched: the revision it uses (recorded for its facts)."""
        if self.announced != self.used:
            self.used = self.announced
            self.unused.clear()  # the DiT rank takes the newest and drops the older ones it holds
            for old in [r for r in self.texts if r < self.used]:
                del self.texts[old]
        self.chunks[index] = self.used
        return self.used

    def unpin(self, index: int) -> list[tuple[int, int]]:
        """Chunk ``index`` was dispatched: if it was the pinned boundary, the revisions encoded meanwhile are
        announced now, in order (revision, req of its ``set_prompt``), and apply from the next chunk."""
        if self.pinned is None or index < self.pinned:
            return []
        self.pinned, ready, self.ready = None, self.ready, []
        announced = [(revision, self.encoded(revision)) for revision in ready]
        return [(revision, req) for revision, req in announced if req is not None]

    def emitted(self, index: int) -> int:
        """The revision of emitted chunk ``index`` (its record ends here)."""
        return self.chunks.pop(index)

    def waiting(self) -> dict[int, int]:
        """revision -> req of every ``set_prompt`` still encoding (answered when the session ends first)."""
        return dict(self.encoding)
