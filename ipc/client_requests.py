"""Every request the SDK sends, built and checked once for both clients (``Requests``; ``BadRequest`` before
anything is sent), what each is answered with (``REPLIES``), and a live session's input device (``LiveInput``)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Protocol, TypedDict, Unpack

from ipc import protocol
from ipc.client_errors import BadRequest
from ipc.error_codes import ErrorCode


class StateSink(Protocol):
    def control_state(self, session: str, state: protocol.InputState, steps: int | None = None) -> None: ...


class LiveInput:
    """A live session's input device: tracks held keys, taps and mouse motion, and sends the whole state as a
    ``control_state`` with a strictly increasing revision whenever it changes (nothing is sent when nothing
    changed). Works with ``Client`` and ``AsyncClient`` (their ``control_state`` is fire-and-forget).

    Each method returns the revision it sent, or ``None`` when it sent nothing."""

    def __init__(self, sink: StateSink, session: str, first_revision: int = 1) -> None:
        if first_revision < 0:
            raise ValueError(f"revisions are >= 0, got first_revision={first_revision}")
        self.sink = sink
        self.session = session
        self.held: frozenset[str] = frozenset()
        self.revision = first_revision - 1  # the last revision sent

    def press(self, *keys: str) -> int | None:
        return self.set(self.held | _norm(keys))

    def release(self, *keys: str) -> int | None:
        return self.set(self.held - _norm(keys))

    def tap(self, *keys: str) -> int | None:
        """Keys pressed and released between two messages: each acts on exactly one chunk."""
        return self.set(self.held, taps=keys)

    def move(self, dx: float, dy: float) -> int | None:
        """Mouse motion (yaw, pitch degrees) since the previous message."""
        return self.set(self.held, mouse=(dx, dy))

    def reset(self) -> int | None:
        """Release everything (e.g. the window lost focus)."""
        return self.set(frozenset())

    def set(self, keys: Iterable[str], taps: Iterable[str] = (), mouse: tuple[float, float] = (0.0, 0.0),
            steps: int | None = None) -> int | None:  # fmt: skip
        """Send the whole state: ``keys`` held now, ``taps`` and ``mouse`` motion since the previous message;
        ``steps``: the session's best quality from the next chunk cut (a state with steps is always sent)."""
        held, tapped = _norm(keys), sorted(_norm(taps))
        mouse = (float(mouse[0]), float(mouse[1]))
        if held == self.held and not tapped and mouse == (0.0, 0.0) and steps is None:
            return None
        revision = self.revision + 1
        extra = {} if steps is None else {"steps": steps}  # a sink without quality presets is sent no steps
        self.sink.control_state(self.session, input_state(held, revision, mouse, tapped), **extra)
        self.held, self.revision = held, revision  # only once sent: a refused send (``OutboxFull``) changes nothing
        return revision


def _norm(keys: Iterable[str]) -> frozenset[str]:
    """``"wd"``, ``["w", "D"]`` -> ``{"w", "d"}``."""
    return frozenset(k.lower() for item in keys for k in item)


def input_state(keys: Iterable[str], revision: int, mouse: tuple[float, float] = (0.0, 0.0),
                taps: Iterable[str] = ()) -> protocol.InputState:
    """A live input state as it travels (``"wd"`` or ``["w", "D"]`` for keys). Its values are checked by the server
    (``protocol.check_input_state``; a refusal arrives through ``error()``), as a page's are by the gateway."""
    return protocol.InputState(keys=sorted(_norm(keys)), mouse=(float(mouse[0]), float(mouse[1])),
                               taps=sorted(_norm(taps)), revision=revision)


class ControlFields(TypedDict, total=False):
    """A chunk's control in keyword form (``client.control(sid, i, keys="w", mouse=(2, 0))``): the SDK's sugar for a
    ``protocol.ChunkControl``, spelled here only (``chunk_control`` builds the value both clients send)."""

    keys: Iterable[str]  # ``"wd"`` or ``["w", "D"]``
    mouse: tuple[float, float]
    poses: Iterable[Iterable[float]] | None


def chunk_control(control: protocol.ChunkControl | None = None, session: str | None = None,
                  **fields: Unpack[ControlFields]) -> protocol.ChunkControl:
    """The control of one chunk as it travels: ``control`` as given, or one built from its keyword form (the two
    are not mixed); ``BadRequest`` (code ``bad_control``) when it is not a valid control, before anything is sent."""
    if control is not None:
        if fields:
            raise BadRequest("bad_control", f"give a ChunkControl or its fields ({', '.join(sorted(fields))}), "
                                            "not both", session)
        return control
    try:
        keys, mouse, poses = fields.get("keys", ()), fields.get("mouse", (0.0, 0.0)), fields.get("poses")
        return protocol.ChunkControl(keys=_norm(keys), mouse=(float(mouse[0]), float(mouse[1])),
                                     poses=None if poses is None else tuple(tuple(map(float, p)) for p in poses))
    except (ValueError, TypeError) as error:
        raise BadRequest(ErrorCode.BAD_CONTROL, str(error), session) from None


def prompt_message(req: int, session: str, prompt: str) -> protocol.SetPrompt:
    """A ``set_prompt`` request (both SDKs); ``BadRequest`` for a prompt the protocol cannot carry."""
    try:
        return protocol.SetPrompt(req=req, session=session, prompt=prompt)
    except (TypeError, ValueError) as error:
        raise BadRequest(ErrorCode.BAD_REQUEST, str(error)) from None


def open_message(req: int, image: bytes, prompt: str = "", seed: int = 0, num_chunks: int | None = None,
                 live: bool = False, pause_when_idle: bool = False, intrinsics: Iterable[float] | None = None,
                 steps: int | None = None, min_steps: int | None = None,
                 restore: str | None = None, indexed: bool = False) -> protocol.Open:  # fmt: skip
    """An ``open`` request; ``BadRequest`` (code ``bad_request``) when its camera intrinsics or its steps (4, 2, 1)
    are not valid, before anything is sent. ``restore``: a snapshot id (``image`` is then not used); ``indexed``:
    restore a live session as one that takes indexed controls."""
    try:
        camera = None if intrinsics is None else tuple(float(v) for v in intrinsics)
        return protocol.Open(req=req, image=image, prompt=prompt, seed=seed, num_chunks=num_chunks, live=live,
                             pause_when_idle=pause_when_idle, intrinsics=camera,  # type: ignore[arg-type]
                             steps=steps, min_steps=min_steps, restore=restore, indexed=indexed)
    except (ValueError, TypeError) as error:
        raise BadRequest(ErrorCode.BAD_REQUEST, str(error)) from None


class Requests:
    """Every request a client sends, built once for ``Client`` and ``AsyncClient``: each with a fresh request id, its
    arguments checked before anything is sent (``BadRequest``). The clients differ only in how they send and wait."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)

    def open(self, image: bytes, prompt: str = "", seed: int = 0, num_chunks: int | None = None, live: bool = False,
             pause_when_idle: bool = False, intrinsics: Iterable[float] | None = None, steps: int | None = None,
             min_steps: int | None = None, restore: str | None = None, indexed: bool = False) -> protocol.Open:
        return open_message(next(self._ids), image, prompt, seed, num_chunks, live, pause_when_idle, intrinsics,
                            steps, min_steps, restore, indexed)

    def save(self, session: str) -> protocol.Save:
        return protocol.Save(req=next(self._ids), session=session)

    def control(self, session: str, index: int, control: protocol.ChunkControl,
                steps: int | None = None) -> protocol.Control:  # fmt: skip
        return protocol.Control(req=next(self._ids), session=session, index=index, control=control, steps=steps)

    def control_state(self, session: str, state: protocol.InputState,
                      steps: int | None = None) -> protocol.ControlState:  # fmt: skip
        return protocol.ControlState(req=next(self._ids), session=session, keys=state.keys, mouse=state.mouse,
                                     taps=state.taps, revision=state.revision, steps=steps)

    def set_prompt(self, session: str, prompt: str) -> protocol.SetPrompt:
        return prompt_message(next(self._ids), session, prompt)

    def close(self, session: str) -> protocol.Close:
        return protocol.Close(req=next(self._ids), session=session)

    def stats(self) -> protocol.Stats:
        return protocol.Stats(req=next(self._ids))

    def drain(self, operator_token: str) -> protocol.Drain:
        return protocol.Drain(req=next(self._ids), operator=operator_token)

    def watch(self, session: str, token: str) -> protocol.Watch:
        return protocol.Watch(req=next(self._ids), session=session, token=token)

    def unwatch(self, session: str) -> protocol.Unwatch:
        return protocol.Unwatch(req=next(self._ids), session=session)

    def resume(self, session: str) -> protocol.Heartbeat:
        """A heartbeat naming the session: its chunks come to this identity from now on."""
        return protocol.Heartbeat(req=next(self._ids), session=session)


# what each request is answered with (besides an ``error``): a reply of another kind fails the request as
# ``bad_reply`` instead of reaching a caller that reads fields it does not have
REPLIES: dict[type, tuple[type, ...]] = {
    protocol.Open: (protocol.Opened,), protocol.Save: (protocol.Saved,), protocol.Control: (protocol.Accepted,),
    protocol.ControlState: (protocol.Accepted,), protocol.SetPrompt: (protocol.PromptScheduled,),
    protocol.Close: (protocol.Closed,), protocol.Stats: (protocol.StatsReply,), protocol.Watch: (protocol.Watching,),
    protocol.Unwatch: (protocol.Closed,), protocol.Heartbeat: (protocol.HeartbeatAck,),
    protocol.Drain: (protocol.Draining,),
}


def _tag(kind: type) -> str:
    return str(getattr(getattr(kind, "__struct_config__", None), "tag", kind.__name__))
