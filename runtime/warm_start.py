"""What rank 0 knows of the start-up warm-up (``ranks.warmup``), for ``stats`` and the log.

Each stage thread reports in its ``hello`` the sizes its rank warmed that stage at, with the seconds each took; the
hellos arrive before the port opens. ``warm`` holds once every rank of every stage warmed every size the server
serves. A stage's ``seconds`` is its slowest rank's total (the job's start waited for that rank). A size a rank
could not warm (out of memory) is not warm, and rank 0 refuses sessions at it (``failures``), naming the rank.
"""

from __future__ import annotations

from collections.abc import Iterable

from ipc.metrics_types import WarmUpStage, WarmUpStages
from ipc.protocol import Stage, WarmUp
from runtime.placement import Placement
from runtime.sizes import Size


def size_name(height: int, width: int) -> str:
    return f"{height}x{width}"


class WarmStart:
    def __init__(self, placement: Placement, sizes: tuple[Size, ...]) -> None:
        self.placement = placement
        self.sizes = sizes
        self.runs: dict[tuple[str, int], list[WarmUp]] = {}  # (stage, rank) -> its warm-up, in order

    def add(self, rank: int, runs: Iterable[WarmUp]) -> None:
        for run in runs:
            self.runs.setdefault((run.stage, rank), []).append(run)

    def _sizes_of(self, stage: Stage, rank: int) -> list[str]:
        return [size_name(r.height, r.width) for r in self.runs.get((stage.value, rank), []) if not r.failed]

    def failures(self) -> dict[tuple[int, int], str]:
        """The sizes some rank could not warm up (out of memory: it cannot serve them), each with the first such
        rank and why; rank 0 refuses sessions at these sizes."""
        out: dict[tuple[int, int], str] = {}
        for (stage, rank), runs in sorted(self.runs.items(), key=lambda item: item[0][1]):
            for r in runs:
                if r.failed and (r.height, r.width) not in out:
                    out[(r.height, r.width)] = (f"rank {rank} could not run its {stage} stage at "
                                                f"{size_name(r.height, r.width)} when it warmed up ({r.failed})")
        return out

    @property
    def warm(self) -> bool:
        """Every rank of every stage warmed every served size."""
        wanted = sorted(size_name(*s) for s in self.sizes)
        return all(sorted(self._sizes_of(stage, rank)) == wanted
                   for stage in Stage for rank in self.placement.ranks_of(stage))

    def seconds(self, stage: Stage) -> float:
        return max((sum((r.seconds for r in self.runs.get((stage.value, rank), [])), 0.0)
                    for rank in self.placement.ranks_of(stage)), default=0.0)

    def stages(self) -> WarmUpStages:
        """Per stage: the slowest rank's seconds, the chunks of each throwaway session, and the sizes per rank."""
        out: dict[str, WarmUpStage] = {}
        for stage in Stage:
            ranks = self.placement.ranks_of(stage)
            chunks = {r.chunks for rank in ranks for r in self.runs.get((stage.value, rank), [])}
            runs = {rank: self.runs.get((stage.value, rank), []) for rank in ranks}
            failed = {str(rank): {size_name(r.height, r.width): r.failed for r in rs if r.failed}
                      for rank, rs in runs.items() if any(r.failed for r in rs)}
            out[stage.value] = WarmUpStage(
                seconds=round(self.seconds(stage), 3), chunks_per_size=max(chunks, default=0),
                ranks={str(rank): self._sizes_of(stage, rank) for rank in ranks},
                threads={str(rank): sorted({r.thread for r in rs}) for rank, rs in runs.items()}, failed=failed)
        return out

    def describe(self) -> str:
        seconds = ", ".join(f"{stage.value} {self.seconds(stage):.2f} s" for stage in Stage)
        sizes = ", ".join(size_name(*s) for s in self.sizes)
        return f"{'warm' if self.warm else 'NOT warm'} at {sizes}: {seconds}"
