"""A replica as the router sees one, without ranks: a real ZeroMQ ROUTER on loopback speaking the client protocol
(heartbeat acks with its server id, stats, opens, controls answered with a chunk each, closes) from a thread, and
what it is told to say instead (``stats``: a function of the asking client's sessions, to send hostile replies;
``extra``: fields a newer server would add, put into every reply and into a chunk's facts, times and control).
``register`` sends one registration to a router's registration port as a replica's rank 0 does, and returns the
answer."""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import zmq

from ipc import chunk_wire as wire
from ipc import protocol
from runtime.replicas import ReplicaStatsReply

Stats = Callable[[list[str], int], dict[str, Any]]  # (the asker's sessions, every session count) -> a stats reply


def sane_stats(mine: list[str], open_sessions: int) -> dict[str, Any]:
    return {"uptime_s": time.monotonic(), "open_sessions": open_sessions, "chunks_emitted": 0, "frames_emitted": 0,
            "sessions": {"open": open_sessions, "total": open_sessions}, "rejects": {}, "errors": {},
            "layout": "fake", "per_session": {sid: {"chunks": 0} for sid in mine}}


def chunk_parts(chunk: protocol.Chunk) -> list[bytes]:
    """A chunk as a server of protocol 4 sends it: its map, and its frames as a part of their own."""
    head, frames = wire.chunk_parts(chunk.session, np.frombuffer(chunk.frames, np.uint8).reshape(chunk.shape),
                                    chunk.facts)
    return [head, bytes(frames)]


class FakeReplica:
    def __init__(self, server_id: str, port: int = 0, extra: dict[str, Any] | None = None, side: int = 16) -> None:
        self.server_id = server_id
        self.extra = extra or {}
        self.side = side  # frames are side x side (large ones fill a slow reader's queues in a few chunks)
        self.stats: Stats = sane_stats
        # a chunk's ZeroMQ parts as it sends them (its map and frames apart, as a server of protocol 4): another
        # function sends them broken (a part missing, one too many, ...)
        self.chunk_parts: Callable[[protocol.Chunk], list[bytes]] = chunk_parts
        self.sessions: dict[str, bytes] = {}  # session -> the client that opened it
        self.heartbeats = 0
        self.stats_asked = 0
        self._ids = (uuid.uuid4().hex[:12] for _ in itertools.count())  # random, as a server's
        self._context = zmq.Context.instance()
        self._sock = self._context.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1") if port == 0 else self._rebind(port)
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _rebind(self, port: int) -> int:
        """Bind a port a stopped replica held (a requeued job at its old endpoint): ZeroMQ closes the old listener
        in its own thread, so the port is free a moment after ``stop``."""
        deadline = time.monotonic() + 10
        while True:
            try:
                self._sock.bind(f"tcp://127.0.0.1:{port}")
                return port
            except zmq.ZMQError as error:
                if error.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._sock.poll(20):
                    continue
                who, data = self._sock.recv_multipart()
                message = protocol.decode(data, "client", max_bytes=1 << 26)
                for reply in self._answer(who, message):
                    parts = self.chunk_parts(reply) if isinstance(reply, protocol.Chunk) and not self.extra else [
                        self._encode(reply)]
                    self._sock.send_multipart([who, *parts])
        finally:
            self._sock.close(linger=0)

    def _answer(self, who: bytes, message: Any) -> list[Any]:
        match message:
            case protocol.Heartbeat():
                self.heartbeats += 1
                return [protocol.HeartbeatAck(req=message.req, session=message.session, server=self.server_id)]
            case protocol.Stats():
                self.stats_asked += 1
                mine = sorted(s for s, c in self.sessions.items() if c == who)
                # as it says it (maybe hostile): the router reads a replica's stats as they come
                return [ReplicaStatsReply(req=message.req, stats=self.stats(mine, len(self.sessions)))]
            case protocol.Open():
                sid = next(self._ids)
                self.sessions[sid] = who
                return [protocol.Opened(req=message.req, session=sid, height=self.side, width=self.side, fps=16.0,
                                        frames_first_chunk=1, frames_per_chunk=4, num_chunks=message.num_chunks)]
            case protocol.Control() if message.session in self.sessions:
                frames, side = 1 if message.index == 0 else 4, self.side
                times = protocol.ChunkTimes(*[time.monotonic()] * 8)
                facts = protocol.ChunkFacts(message.index, frames, message.control, times,
                                            (protocol.Span("decode", 1, "decode", 0.0, 0.0, 0.0),))
                return [protocol.Accepted(req=message.req, session=message.session, index=message.index),
                        protocol.Chunk(session=message.session, shape=(frames, side, side, 3), facts=facts,
                                       frames=bytes([message.index % 256]) * (frames * side * side * 3))]
            case protocol.Close() if self.sessions.pop(message.session, None) is not None:
                return [protocol.Closed(session=message.session, reason="client")]
            case protocol.Control() | protocol.Close():
                return [protocol.Error(req=message.req, session=message.session, code="unknown_session",
                                       message=f"no session {message.session!r} for this client")]
        return []

    def _encode(self, reply: Any) -> bytes:
        if not self.extra:
            return protocol.encode(reply)
        raw = msgspec.msgpack.decode(protocol.encode(reply))
        raw.update(self.extra)
        if isinstance(reply, protocol.Chunk):
            for part in (raw["facts"], raw["facts"]["times"], raw["facts"]["control"]):
                part.update(self.extra)
            raw["facts"]["spans"] = [[*span, "newer"] for span in raw["facts"]["spans"]]
        return msgspec.msgpack.encode(raw)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def register(endpoint: str, name: str, replica_endpoint: str, incarnation: str, token: str = "",
             timeout_s: float = 10.0) -> protocol.Registered:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(protocol.encode(protocol.Register(name=name, endpoint=replica_endpoint, max_sessions=2,
                                                    layout="fake", incarnation=incarnation, token=token)))
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no answer from the router's registration port {endpoint}")
        return protocol.decode(sock.recv(), "router")
    finally:
        sock.close()
