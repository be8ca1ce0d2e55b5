"""The live control service: a client's held-key state in, immutable per-chunk snapshots out.

Sans-io: no sockets, threads or clocks. The coordinator core feeds ``update`` with each ``control_state`` message
(``ipc.protocol.ControlState``, as decoded: an ``InputState``, the one live-input shape from the page on) of a live
session and calls ``cut`` when the scheduler wants the session's
next control (``Scheduler.control_wanted``); whatever ``cut`` returns it submits through the scheduler's normal
admission.

Rules (each one is enforced here and nowhere else):

Input is checked before it counts, by the check every trust boundary uses (``protocol.check_input_state``: the
gateway runs it too, so a page and a script are refused with the same words): unknown key names raise
``ControlStateError(reason="unknown_keys")``, motion that is not finite or beyond a turn, or a revision out of
range ``reason="malformed"``, and nothing changes (types are the decoder's).

1. **Revisions are strictly increasing per client**, checked here only (the gateway forwards a page's state, and
   this refusal back to it). A state whose revision is not greater than the last one folded in raises
   ``ControlStateError(reason="stale_revision")`` and changes nothing. Revisions are >= 0; a snapshot cut before
   any state arrived carries revision -1 ("no client state yet").
2. **Snapshots are cut in chunk order, only on demand.** ``cut(index, current)`` requires ``index`` to be the next
   index not yet cut (anything else is a coordinator bug: ``CutOrderError``). A snapshot exists only from the
   moment it is cut, and a cut snapshot is final: it is what the scheduler receives and what the model sees.
   Hence a release or new state always "replaces" the snapshots not yet submitted (they do not exist
   yet) and can never alter one already submitted (``ChunkControl`` is immutable and never re-cut).
3. **At most one chunk ahead.** ``cut`` returns ``None`` when ``index > current_chunk_index + 1``, where
   ``current_chunk_index`` is the chunk being produced (the lowest index not yet emitted). So at most two
   controls of the session are in the scheduler: the chunk being produced and the next one.
4. **A tap is consumed by exactly one chunk**: the next one cut after the state carrying it was folded in, even
   if the key was already released. A tap acts as a held key for that whole chunk (several taps folded in
   before one cut all land in that chunk).
5. **Mouse motion is accumulated between cuts and goes into the next snapshot only**, then the accumulator is
   zeroed: across all snapshots the motion sums to the motion received (never lost, never counted twice), except
   that a chunk turns at most ``MAX_MOUSE_DEGREES``: each fold holds the sum to it (``InputState.fold``, the rule
   the router folds by too, so input folded on its way here and input folded here come to the same state).
6. **Idle.** With no key held the world keeps running with a still camera (an empty snapshot). With
   ``pause_when_idle`` the service is paused while idle (no key held, no pending tap, no pending mouse motion):
   ``cut`` returns ``None`` until the next input makes it non-idle.

Every cut snapshot carries ``revision`` = the revision of the latest state folded in: the caller keeps the snapshot
it submitted (``Session.controls``), so an emitted chunk reports exactly what the model saw and which client
revision it came from.
"""

from __future__ import annotations

from collections.abc import Iterable

from ipc.error_codes import ErrorCode
from ipc.protocol import ChunkControl, InputState, InputStateError, check_input_state

NO_REVISION = -1  # revision of snapshots cut before any client state arrived

# Bad live input from a client (the shared check's ``unknown_keys`` and ``malformed``, and this service's own
# ``stale_revision``); the service state is unchanged. ``reason`` is a short machine-readable tag.
ControlStateError = InputStateError


class CutOrderError(RuntimeError):
    """The coordinator asked for a snapshot out of chunk order (a bug on the caller's side); nothing changed."""


class LiveControls:
    """Per-session live control state; see the module docstring for the rules."""

    def __init__(self, pause_when_idle: bool = False) -> None:
        self.pause_when_idle = pause_when_idle
        # the input folded in (``InputState.fold``, the router's rule too): the keys held now and the latest
        # revision, the taps and the motion since the last cut
        self._input = InputState(revision=NO_REVISION)
        self._next_index = 0  # next chunk index to cut
        self._recut: dict[int, ChunkControl] = {}  # a restored session's snapshots cut before its save

    @classmethod
    def restored(cls, held: Iterable[str], next_index: int, pause_when_idle: bool = False,
                 cut: Iterable[ChunkControl] = ()) -> LiveControls:  # fmt: skip
        """A session restored from a snapshot (``runtime.snapshots.LiveState``): the keys held when it was saved stay
        held, the next chunk to cut is the snapshot's; the revisions start again (a restore has a new client, whose
        input stream counts from 1; the saved revision stays in the manifest). ``cut``: the snapshots the saved
        session had already cut for its chunks from ``next_index`` on (taps and motion included); they are cut
        again, as they were, before any from this session's own input."""
        controls = cls(pause_when_idle=pause_when_idle)
        controls._input = InputState(keys=sorted(held), revision=NO_REVISION)
        controls._next_index = next_index
        controls._recut = {next_index + i: snapshot for i, snapshot in enumerate(cut)}
        return controls

    @property
    def held(self) -> frozenset[str]:
        """The keys held now."""
        return frozenset(self._input.keys)

    @property
    def next_index(self) -> int:
        """The next chunk index a snapshot will be cut for (= number of snapshots cut so far)."""
        return self._next_index

    @property
    def revision(self) -> int:
        """The latest client revision folded in (``NO_REVISION`` before the first state)."""
        return self._input.revision

    @property
    def idle(self) -> bool:
        """No key held, no pending tap, no pending mouse motion."""
        return not self._input.keys and not self._input.taps and self._input.mouse == (0.0, 0.0)

    def update(self, state: InputState) -> None:
        """Fold in a client's new input state (a decoded ``control_state`` message; key names case-insensitive).
        Raises ``ControlStateError`` (state unchanged) on unknown keys, bad motion, a revision out of range or a
        stale one."""
        check_input_state(state)
        if state.revision <= self.revision:
            raise ControlStateError(
                ErrorCode.STALE_REVISION, f"revision {state.revision} is not newer than {self.revision}, the last one "
                                  "the server folded in"
            )
        self._input = self._input.fold(state)

    def may_cut(self, index: int, current_chunk_index: int) -> bool:
        """Whether ``cut(index, current_chunk_index)`` would return a snapshot now (a pure query)."""
        self._check_order(index, current_chunk_index)
        if index in self._recut:
            return True
        if index > current_chunk_index + 1:
            return False
        return not (self.pause_when_idle and self.idle)

    def cut(self, index: int, current_chunk_index: int) -> ChunkControl | None:
        """Cut the snapshot for chunk ``index`` now, or return ``None`` when it may not be cut yet.

        Call it only when the scheduler can accept control[index] right now; a returned snapshot is final and
        must be submitted. ``current_chunk_index`` is the chunk being produced (lowest index not yet emitted).
        """
        if not self.may_cut(index, current_chunk_index):
            return None
        recut = self._recut.pop(index, None)
        if recut is not None:
            self._next_index += 1
            return recut
        held = self._input
        snapshot = ChunkControl(keys=frozenset((*held.keys, *held.taps)), mouse=held.mouse, revision=held.revision)
        # Consumed: taps and motion belong to this snapshot only (rules 4 and 5).
        self._input = InputState(keys=held.keys, revision=held.revision)
        self._next_index += 1
        return snapshot

    def _check_order(self, index: int, current_chunk_index: int) -> None:
        if index != self._next_index:
            raise CutOrderError(f"cut of chunk {index} out of order: the next chunk to cut is {self._next_index}")
        if current_chunk_index > index:
            raise CutOrderError(
                f"chunk {current_chunk_index} is being produced but chunk {index} has no control yet"
            )
