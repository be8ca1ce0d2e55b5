"""The router's migration part: sessions outlive their replica (``router.snapshot_every = K``). Sans-io: it owns
each session's ``Moves`` (on ``RoutedSession.migration``), answers the router core at fixed points and returns
outputs; it never calls back into the core, which routes, places and counts.

- **Autosave.** Every K chunks forwarded (``forwarded``), the part asks a session's replica to ``save`` it (the
  router owns the session there), one save at a time, under a negative request id so no answer to a client's
  request is taken for it; its ``saved`` is the router's own (``autosaved``). A client's own ``saved`` is forwarded
  and counts as a snapshot too (``snapshotted``), once its boundary passes ``runtime.chunk_claims``.
- **Drain.** A draining replica saves each session one last time and says so (``draining``, ``drained``): the
  session migrates from that snapshot at once, its replica placed nowhere any more.
- **Migrate.** When the replica goes down, each of its sessions with a snapshot is opened on another replica from
  the latest (``restore_open``: the core places it as any open) instead of ending; its requests the dead replica
  will never answer are refused with what a server says when it cannot take one now (``moving``). Once the restore
  opened (``restored``) the client keeps its session id: ``aliases`` maps the new replica's id to it (small messages
  are re-encoded, a chunk's head rewritten, ``runtime.migration``; ``renamed``) and it gets ``migrated``. Controls
  below the resume chunk are refused (``check_control``); other input during the restore gets ``not_now``.
- **Prompt replay.** The latest prompt its replica scheduled (``prompt_scheduled``: its text kept from the forwarded
  ``set_prompt``) whose chunk is after the snapshot's is not in the snapshot: once the restore opened the part sets
  it again there (``replay``: its own ``set_prompt``, a negative request id; ``replayed`` takes its answer).
- With ``router.snapshots_dir`` the router's own snapshots are deleted (``DropSnapshot``) once superseded or their
  session ended (``ended``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from ipc import protocol
from ipc.error_codes import ErrorCode
from runtime.chunk_claims import save_problem
from runtime.core_types import ClientError
from runtime.migration import renamed
from runtime.replicas import Replica
from runtime.router_config import RouterSection
from runtime.router_types import ChunkHead, DropSnapshot, Output, Payload, SessionOrigin, ToReplica

log = logging.getLogger("runtime.router")  # (the core's logger: the migration's lines read as the router's)

SESSION_RETRY_S = 0.01  # hint when a control met a full replica connection (a server's control_backpressure)
MAX_ASKED = 256  # unanswered requests remembered per session (a replica answers each at once; more is a flood)
MAX_PROMPTS_ASKED = 4  # set_prompt texts remembered per session until answered (a server refuses more waiting)
ANSWERED = ("control", "set_prompt", "save")  # the forwarded kinds a replica answers by request id
# what a server answers a request it cannot take now, by kind: the client sends it again (after a migration: to the
# new replica)
NOT_NOW = {"set_prompt": ErrorCode.PROMPT_BACKPRESSURE, "save": ErrorCode.BUSY}


@dataclass
class ScheduledPrompt:
    """A prompt a session's replica scheduled (``prompt_scheduled``): a snapshot of chunk k holds it when ``chunk``
    <= k. ``chunk`` None: the router sent it again to the session's new replica and no answer named its chunk yet
    (it is in no snapshot)."""

    text: str
    chunk: int | None
    revision: int


@dataclass
class Moves:
    """One session's migration state; only ``Migration`` changes it."""

    first: int = 0  # the index of its stream's first chunk on its replica (a restore's boundary, else 0)
    upstream: str = ""  # its id on its replica when that is not the client's (it migrated: restored under a new id)
    chunks: int = 0  # chunks forwarded since the router last asked its replica to save it (``snapshot_every``)
    autosave: int | None = None  # the router's own save in flight (its request id): its answer is the router's
    snapshot: str | None = None  # the latest snapshot of it (the router's or its client's): where it resumes from
    snapshot_chunk: int = 0  # that snapshot's boundary chunk
    forwarded: int = 0  # chunks forwarded since ``first`` (what a replica's save boundary is checked against)
    resume: int = 0  # the lowest control index it takes: after a migration, its snapshot's chunk
    migrating: bool = False  # its replica went down and its restore on another one is not answered yet
    own_snapshot: str | None = None  # the latest snapshot the router asked for (deleted when superseded or it ends)
    # requests forwarded and not answered yet (request id -> kind): a replica that goes down answers none of them,
    # so a migration answers them itself (bounded: the oldest are forgotten past MAX_ASKED)
    asked: dict[int, str] = field(default_factory=dict)
    # the texts of its set_prompts forwarded and not answered yet (request id -> text; the oldest forgotten past
    # MAX_PROMPTS_ASKED): a ``prompt_scheduled`` names its request, not its text
    prompts_asked: dict[int, str] = field(default_factory=dict)
    prompt: ScheduledPrompt | None = None  # the latest prompt its replica answered ``prompt_scheduled`` (one text)
    replay: int | None = None  # the router's own set_prompt of ``prompt`` in flight on its new replica (its req)


class Routed(Protocol):
    """What the part reads of a routed session (``runtime.router.RoutedSession``)."""

    id: str
    replica: str
    client: bytes
    gone: bool
    closing: bool
    migration: Moves
    opened: protocol.Opened | None

    @property
    def rid(self) -> str: ...


def _bounded(asked: dict[int, str], limit: int) -> None:
    if len(asked) > limit:
        del asked[next(iter(asked))]


class Migration:
    """See the module docstring. ``aliases``, ``autosaves`` and ``migrations`` are read by the core (its stats)."""

    def __init__(self, config: RouterSection, new_req: Callable[[], int]) -> None:
        self.config = config
        self.new_req = new_req
        self.aliases: dict[tuple[str, str], str] = {}  # (replica, id there) -> the id a migrated one's client knows
        self.autosaves = 0  # the router's own saves answered (``snapshot_every``)
        self.migrations = 0  # sessions restored on another replica after theirs went down

    # ------------------------------------------------------------------------------------------ routing

    def renamed(self, replica: str, message: protocol.ServerMessage | ChunkHead,
                raw: Payload | protocol.ServerMessage) -> tuple[protocol.ServerMessage | ChunkHead,
                                                                Payload | protocol.ServerMessage]:
        """A replica's message under the id its client knows (a migrated session's first id), else as it came."""
        sid = getattr(message, "session", None)
        if sid is None or (alias := self.aliases.get((replica, sid))) is None:
            return message, raw
        if isinstance(message, ChunkHead):
            return ChunkHead(alias), renamed(raw, sid, alias)
        message = msgspec.structs.replace(message, session=alias)
        return message, message

    def taken(self, replica: str, sid: str) -> bool:
        """Whether ``sid`` on ``replica`` is a migrated session's id there."""
        return (replica, sid) in self.aliases

    def ended(self, session: Routed) -> list[Output]:
        """The session ended here: its alias is forgotten and the router's own snapshot of it dropped."""
        self.aliases.pop((session.replica, session.rid), None)
        return self._drop_own(session.migration)

    # ------------------------------------------------------------------------------------------ client requests

    def check_control(self, session: Routed, index: int) -> None:
        """A control below the resume chunk of a migrated session is refused: its stream goes on from there."""
        resume = session.migration.resume
        if index < resume:
            raise ClientError(ErrorCode.REJECTED_CONTROL, f"session {session.id} resumed from its snapshot at chunk "
                              f"{resume} on replica {session.replica} (its replica went down): its controls go on "
                              f"from index {resume}, not {index}")

    def not_now(self, session: Routed, kind: str) -> ClientError:
        """What a session's request gets while its restore is on its way: what a server answers when it cannot take
        it now (live input waits instead: the core folds it)."""
        code = {"control": ErrorCode.CONTROL_BACKPRESSURE,
                "set_prompt": ErrorCode.PROMPT_BACKPRESSURE}.get(kind, ErrorCode.BUSY)
        return ClientError(code, f"session {session.id} is being restored from its snapshot at chunk "
                           f"{session.migration.snapshot_chunk} (its replica {session.replica} went down): send it "
                           "again", retry_after_s=self.config.heartbeat_s)

    def forwarding(self, session: Routed, message: protocol.ClientMessage, kind: str) -> None:
        """A client's request goes to the session's replica: one it answers is remembered until then (a migration
        answers those the dead replica never will), a prompt's text until its ``prompt_scheduled``."""
        moves = session.migration
        req = getattr(message, "req", None)
        if kind in ANSWERED and isinstance(req, int):
            moves.asked[req] = kind
            _bounded(moves.asked, MAX_ASKED)
        if isinstance(message, protocol.SetPrompt):  # its answer names the request: the text is kept till then
            moves.prompts_asked[message.req] = message.prompt
            pending = moves.prompt
            if pending is not None and pending.chunk is None and moves.replay is None:
                moves.prompt = None  # a replay not sent yet (a full link) must never follow the newer
            _bounded(moves.prompts_asked, MAX_PROMPTS_ASKED)

    def not_sent(self, session: Routed, kind: str, req: int | None) -> bool:
        """A request for the session met a full replica link: the router's own is tried again (a save at the next
        chunk, a replayed prompt on the next turn: True); a client's is forgotten (its client is told by the
        core)."""
        moves = session.migration
        if kind == "autosave":
            moves.autosave, moves.chunks = None, self.config.snapshot_every - 1
            return True
        if kind == "replay_prompt":
            moves.replay = None
            return True
        if req is not None:
            moves.asked.pop(req, None)
            moves.prompts_asked.pop(req, None)
        return False

    # ------------------------------------------------------------------------------------------ replica answers

    def forwarded(self, session: Routed, replica: Replica) -> list[Output]:
        """A chunk of the session was forwarded: every ``snapshot_every`` chunks the router asks its replica to save
        it (as its owner there). One at a time: a save slower than K chunks delays the next."""
        moves, every = session.migration, self.config.snapshot_every
        moves.chunks, moves.forwarded = moves.chunks + 1, moves.forwarded + 1
        if not every or moves.chunks < every or moves.autosave is not None or session.closing:
            return []
        # a negative request id: the replica echoes it, and no answer to the client's own requests (the SDK counts
        # from 1) is taken for the router's
        moves.chunks, moves.autosave = 0, -self.new_req()
        return [ToReplica(replica.name, replica.generation, protocol.Save(req=moves.autosave, session=session.rid),
                          SessionOrigin(session.client, moves.autosave, session.id, "autosave"))]

    def answered(self, session: Routed, message: protocol.ServerMessage) -> None:
        """A replica answered one of the session's forwarded requests: it is no longer waiting; a scheduled prompt
        is the latest of the session (a replica answers them in revision order). One whose text was forgotten
        (MAX_PROMPTS_ASKED) leaves none known: an older text must never be set again in its place."""
        req, moves = getattr(message, "req", None), session.migration
        if req is None:
            return
        moves.asked.pop(req, None)
        if isinstance(message, protocol.PromptScheduled | protocol.Error):
            text = moves.prompts_asked.pop(req, None)
            if isinstance(message, protocol.PromptScheduled):
                moves.prompt = None if text is None else ScheduledPrompt(text, message.chunk, message.revision)

    def autosaved(self, session: Routed | None, replica: str,
                  message: protocol.Saved | protocol.Error) -> list[Output] | None:
        """The outputs when ``message`` answers the router's own save (then it is the router's alone: recorded or
        logged); None when it is not one."""
        mine = session is not None and session.replica == replica
        if message.req is not None and message.req < 0 and not mine:
            # the router's own (negative request ids), of a session that ended here: its snapshot is not kept
            if isinstance(message, protocol.Saved) and self.config.snapshots_dir:
                return [DropSnapshot(message.snapshot)]
            return []
        if session is None or not mine or message.req is None or message.req != session.migration.autosave:
            return None
        moves = session.migration
        moves.autosave = None
        if not isinstance(message, protocol.Saved):  # e.g. the client's own save runs (busy): the next K chunks later
            log.info("session %s: the save on replica %s failed: %s: %s", session.id, replica, message.code,
                     message.message[:200])
            return []
        self.autosaves += 1
        if self.snapshotted(session, replica, message):
            out = self._drop_own(moves)
            moves.own_snapshot = message.snapshot
            return out
        return [DropSnapshot(message.snapshot)] if self.config.snapshots_dir else []  # no place to resume: not kept

    def snapshotted(self, session: Routed | None, replica: str, saved: protocol.Saved) -> bool:
        """Record ``saved`` as where its session resumes from; False when its boundary cannot be right
        (``runtime.chunk_claims``). The latest answered is the newest: a replica saves a session one at a time."""
        if session is None or session.replica != replica:
            return False
        return self._resumes_from(session, replica, saved.snapshot, saved.chunk)

    def drained(self, session: Routed | None, replica: str, notice: protocol.Draining) -> bool | None:
        """A draining ``replica`` saved ``session`` for the last time (``notice``): True when it moves from there
        now (recorded as its latest snapshot), False when that snapshot cannot be right; None when the notice is of
        no session the router has there (it is dropped)."""
        if session is None or session.replica != replica or session.migration.migrating or notice.snapshot is None \
                or notice.chunk is None:
            return None
        return self._resumes_from(session, replica, notice.snapshot, notice.chunk)

    def _resumes_from(self, session: Routed, replica: str, snapshot: str, chunk: int) -> bool:
        moves = session.migration
        num_chunks = session.opened.num_chunks if session.opened is not None else None
        if (why := save_problem(chunk, moves.first, moves.forwarded, num_chunks)) is not None:
            log.warning("session %s: replica %s's snapshot %s is not kept: %s", session.id, replica, snapshot[:64], why)
            return False
        moves.snapshot, moves.snapshot_chunk = snapshot, chunk
        return True

    def _drop_own(self, moves: Moves) -> list[Output]:
        """The router's latest snapshot of a session is not needed any more (a newer one, or the session ended)."""
        own, moves.own_snapshot = moves.own_snapshot, None
        return [DropSnapshot(own)] if own is not None and self.config.snapshots_dir else []

    # ------------------------------------------------------------------------------------------ migration

    def restore_open(self, session: Routed) -> protocol.Open | None:
        """The open that restores ``session`` elsewhere from its latest snapshot; None when it has none (or it is
        closing): it ends with its replica."""
        snapshot = session.migration.snapshot
        if snapshot is None or session.closing:
            return None
        return protocol.Open(req=0, image=b"", restore=snapshot)

    def moving(self, session: Routed, down: str, text: str) -> list[tuple[int, ClientError]]:
        """Its restore was placed (its replica ``down`` is going down): it waits for it. Returns the requests the dead
        replica never answers, each with what its client is told (it sends them again)."""
        moves = session.migration
        self.aliases.pop((down, session.rid), None)
        moves.migrating, moves.autosave = True, None
        refused = [(req, ClientError(NOT_NOW.get(kind, ErrorCode.CONTROL_BACKPRESSURE), f"session {session.id} is "
                                     f"moving off replica {down} (it {text}); send it again",
                                     retry_after_s=SESSION_RETRY_S))
                   for req, kind in moves.asked.items()]
        moves.asked.clear()
        moves.prompts_asked.clear()  # (their clients were told to send them again)
        moves.replay = None
        log.warning("session %s: replica %s %s; restoring it from its snapshot at chunk %d", session.id, down, text,
                    moves.snapshot_chunk)
        return refused

    def restored(self, session: Routed, replica: str, message: protocol.Opened) -> protocol.Migrated:
        """Its restore opened on ``replica`` (the core moved it there): its stream goes on from the restore's first
        chunk; the notice its client and watchers get."""
        moves = session.migration
        moves.migrating, moves.resume, moves.chunks = False, message.first_chunk, 0
        moves.first, moves.forwarded = message.first_chunk, 0
        moves.upstream = "" if message.session == session.id else message.session
        if moves.upstream:
            self.aliases[(replica, moves.upstream)] = session.id
        self.migrations += 1
        prompt = moves.prompt
        if prompt is not None and (prompt.chunk is None or prompt.chunk > moves.snapshot_chunk):
            # the snapshot holds the prompt in force at its chunk: one scheduled after it is set again there (by
            # ``replay``), and is in no snapshot until the new replica's answer names its chunk
            since = "not yet in force" if prompt.chunk is None else f"in force from chunk {prompt.chunk}"
            log.info("session %s: its prompt of revision %d (%s, after its snapshot at chunk %d) is sent again to "
                     "replica %s", session.id, prompt.revision, since, moves.snapshot_chunk, replica)
            moves.prompt = ScheduledPrompt(prompt.text, None, prompt.revision)
        return protocol.Migrated(session=session.id, chunk=message.first_chunk, replica=replica)

    def replay(self, session: Routed, replica: Replica | None) -> list[Output]:
        """Send the session's prompt that is in no snapshot (``ScheduledPrompt.chunk`` None) to its replica, as the
        router's own ``set_prompt`` (a negative request id, as its saves: no client's answer is taken for it)."""
        moves = session.migration
        prompt = moves.prompt
        if prompt is None or prompt.chunk is not None or moves.replay is not None or moves.migrating \
                or session.closing or replica is None:
            return []
        moves.replay = -self.new_req()
        return [ToReplica(replica.name, replica.generation,
                          protocol.SetPrompt(req=moves.replay, session=session.rid, prompt=prompt.text),
                          SessionOrigin(session.client, moves.replay, session.id, "replay_prompt"))]

    def replayed(self, session: Routed | None, replica: str,
                 message: protocol.PromptScheduled | protocol.Error) -> bool:
        """Whether ``message`` answers the router's own ``set_prompt`` (``replay``): then it is the router's alone.
        Scheduled: the prompt is known in force from its chunk (on the new replica's revisions); refused: the
        session goes on with its snapshot's prompt (logged: the client may send it again)."""
        if session is None or session.replica != replica or session.migration.replay is None \
                or message.req != session.migration.replay:
            return False
        moves = session.migration
        moves.replay = None
        pending = moves.prompt if moves.prompt is not None and moves.prompt.chunk is None else None
        if isinstance(message, protocol.PromptScheduled):
            log.info("session %s: its prompt is in force again on replica %s from chunk %d (revision %d)",
                     session.id, replica, message.chunk, message.revision)
            if pending is not None:  # (unless a client's newer prompt was answered meanwhile)
                moves.prompt = ScheduledPrompt(pending.text, message.chunk, message.revision)
        elif message.code == NOT_NOW["set_prompt"]:  # not now (prompts wait there): sent again on the next turn
            log.info("session %s: replica %s is not taking its prompt now (%s); it is sent again", session.id,
                     replica, message.code)
        else:
            log.warning("session %s: replica %s refused its prompt sent again (%s: %s); it goes on with its "
                        "snapshot's", session.id, replica, message.code, message.message[:200])
            if pending is not None:
                moves.prompt = None
        return True
