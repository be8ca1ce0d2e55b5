"""The prompt revisions of one session on rank 0: which text each chunk attends to (``set_prompt``).

A session starts at revision 0 (the open's prompt). Each accepted ``set_prompt`` takes the next revision and is
encoded on the condition rank; once its context is encoded, rank 0 announces its broadcast to the DiT ranks and
from that moment every denoise it dispatches names the new revision (``DenoiseChunk.prompt_revision``). So the
switch chunk is the first chunk whose denoise had not been dispatched when the new context was announced: chunks
already dispatched keep the old text, and the DiT rank takes the new context from its mailbox before that chunk's
passes (it waits there only for the broadcast, never for the encode). A later revision announced before that chunk
was dispatched supersedes it at the same chunk: the older one is never used, and no chunk mixes two texts.

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

    def accept(self, req: int) -> int:
        """A valid ``set_prompt`` (request ``req``): its revision. ``PromptBackpressure`` when too many wait."""
        if len(self.encoding) + len(self.unused) >= MAX_PENDING:
            raise PromptBackpressure(f"{MAX_PENDING} prompt changes are waiting for their first chunk; send it again "
                                     "once the next chunk started")
        self.latest += 1
        self.encoding[self.latest] = req
        return self.latest

    def encoded(self, revision: int) -> int | None:
        """``revision``'s context is encoded and its broadcast announced: denoises dispatched from now on use it.
        The req of its ``set_prompt`` (None: not one this session waits for)."""
        req = self.encoding.pop(revision, None)
        if req is None:
            return None
        assert revision > self.announced, f"revision {revision} announced after {self.announced}"  # encodes are FIFO
        self.announced = revision
        self.unused.append(revision)
        return req

    def failed(self, revision: int) -> int | None:
        """``revision`` could not be encoded: nothing changes but its request (returned, to be answered)."""
        return self.encoding.pop(revision, None)

    def dispatched(self, index: int) -> int:
        """The denoise of chunk ``index`` was dispatched: the revision it uses (recorded for its facts)."""
        if self.announced != self.used:
            self.used = self.announced
            self.unused.clear()  # the DiT rank takes the newest and drops the older ones it holds
        self.chunks[index] = self.used
        return self.used

    def emitted(self, index: int) -> int:
        """The revision of emitted chunk ``index`` (its record ends here)."""
        return self.chunks.pop(index)

    def waiting(self) -> dict[int, int]:
        """revision -> req of every ``set_prompt`` still encoding (answered when the session ends first)."""
        return dict(self.encoding)
