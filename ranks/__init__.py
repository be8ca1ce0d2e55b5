"""One loop per role: the I/O shell around ``runtime/`` and ``models/`` on each rank."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.config import LayoutConfig


@dataclass(frozen=True)
class WorkerIds:
    """ZeroMQ identities of every worker thread of the job, derived from the layout (``"<rank>:<role>"``)."""

    condition: bytes
    condition_edges: tuple[bytes, ...]  # every member of the condition group: the condition rank and the DiT ranks
    dit: tuple[bytes, ...]  # leader first
    decode: bytes
    latent_receiver: bytes | None  # only when decode is not on the DiT leader's rank
    frames: bytes | None  # only when decode is not on the coordinator's rank
    heartbeat_ranks: tuple[int, ...]

    @staticmethod
    def heartbeat(rank: int) -> bytes:
        return f"{rank}:heartbeat".encode()

    @property
    def all(self) -> tuple[bytes, ...]:
        optional = (self.latent_receiver, self.frames)
        beats = tuple(self.heartbeat(r) for r in self.heartbeat_ranks)
        return (self.condition, *self.condition_edges, *self.dit, self.decode, *(i for i in optional if i is not None),
                *beats)


def workers_of(layout: LayoutConfig) -> WorkerIds:
    def ident(rank: int, role: str) -> bytes:
        return f"{rank}:{role}".encode()

    return WorkerIds(
        condition=ident(layout.condition, "condition"),
        condition_edges=tuple(ident(r, "condition_edge") for r in sorted({layout.condition, *layout.dit})),
        dit=tuple(ident(r, "dit") for r in layout.dit),
        decode=ident(layout.decode, "decode"),
        latent_receiver=None if layout.decode == layout.dit_leader else ident(layout.decode, "latent_receiver"),
        frames=None if layout.decode == layout.coordinator else ident(layout.coordinator, "frames"),
        heartbeat_ranks=tuple(r for r in range(layout.world_size) if r != layout.coordinator),
    )
