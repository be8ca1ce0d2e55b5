"""The aten op log of one DiT block: which ops one ``Block.forward`` dispatches, per block, eager.

    python scripts/op_count.py                       # tiny preset, bf16, one streaming call, prints and saves JSON
    python scripts/op_count.py --dtype float32 --out out/op_count.json

The block's elementwise chain is what a chunk spends on memory traffic besides attention and GEMMs; each op here is
(at least) one kernel launch and one pass over its tensors on a GPU. Counted: every aten op the block dispatches
(``total``), those that are not views (``ops``: the number the reviews quote), and among them the ones that run a
kernel (``kernels``: not an allocation such as ``empty``); ``cuda_kernels`` counts each ``rms_norm`` once, as the one
fused kernel CUDA runs for it (CPU runs its decomposition, which ``kernels`` counts op by op). The call is a
streaming one through the session's KV ring, as a served chunk runs it: the second pass of chunk 0 (``--chunk`` to
count a later chunk's, where the ring wraps), so that work done once per load or per chunk is not counted.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.dit import DiTConfig, WanModelFast
from models.kv_cache import new_kv_cache

ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


class OpLog(TorchDispatchMode):
    """The aten ops dispatched inside, by name, with whether each is a view. ``fused`` (set by ``FusedOps``) names
    the op being run as one fused kernel on CUDA: the ops it decomposes into here are logged once, under its name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, bool]] = []
        self.fused: str | None = None
        self.inside: list[tuple[str, bool]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        (self.ops if self.fused is None else self.inside).append((str(func.overloadpacket.__name__),
                                                                  bool(func.is_view)))  # fmt: skip
        return func(*args, **(kwargs or {}))


class FusedOps(TorchFunctionMode):
    """Counts ``rms_norm`` as the one kernel it is on CUDA (``_fused_rms_norm``); CPU runs its decomposition."""

    def __init__(self, log: OpLog) -> None:
        super().__init__()
        self.log = log

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func not in (F.rms_norm, torch.rms_norm) or self.log.fused is not None:
            return func(*args, **(kwargs or {}))
        self.log.fused = "rms_norm"
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.log.fused = None
            self.log.ops.append(("rms_norm", False))


@dataclass
class BlockOps:
    """The op log of one block call, summarised."""

    total: int
    ops: int  # not views
    kernels: int  # not views, not allocations
    cuda_kernels: int  # kernels, with each rms_norm one fused kernel as on CUDA instead of its CPU decomposition
    by_name: dict[str, int] = field(default_factory=dict)  # the non-view ops by name, most frequent first


def summarise(log: OpLog) -> BlockOps:
    fused = [name for name, view in log.ops if not view and name not in ALLOCATIONS]
    every = [*(entry for entry in log.ops if entry[0] != "rms_norm"), *log.inside]
    real = [name for name, view in every if not view]
    kernels = [name for name in real if name not in ALLOCATIONS]
    return BlockOps(len(every), len(real), len(kernels), len(fused), dict(Counter(real).most_common()))


def block_ops(preset: str = "tiny", dtype: torch.dtype = torch.bfloat16, chunk: int = 0,
              seed: int = 0) -> list[BlockOps]:  # fmt: skip
    """The op log of every block of one streaming call (chunk ``chunk``'s second pass), eager, on CPU."""
    cfg = DiTConfig.from_name(preset, attention="sdpa")
    torch.manual_seed(seed)
    model = WanModelFast(cfg).to(dtype).eval()
    lat_h, lat_w, cs = 8, 12, cfg.chunk_size
    fs = (lat_h // 2) * (lat_w // 2)
    cache = new_kv_cache(cfg, fs, cfg.num_heads, "cpu", dtype)
    logs: list[OpLog] = []
    modes: list[tuple[OpLog, FusedOps]] = []

    def enter(module: torch.nn.Module, args: Any) -> None:
        log = OpLog()
        modes.append((log, FusedOps(log)))
        for mode in modes[-1]:
            mode.__enter__()

    def leave(module: torch.nn.Module, args: Any, out: Any) -> None:
        log, fused = modes.pop()
        fused.__exit__(None, None, None)
        log.__exit__(None, None, None)
        logs.append(log)

    for block in model.blocks:
        block.register_forward_pre_hook(enter)
        block.register_forward_hook(leave)
    with torch.no_grad():
        text = model.text_cache(torch.randn(4, cfg.text_dim))
        for k in range(chunk + 1):
            cam = model.camera_modulation(torch.randn(1, 384, cs, lat_h, lat_w))
            y = torch.randn(20, cs, lat_h, lat_w)
            for t in (900.0, 500.0):  # two passes: what a call does once per load (weight casts) is not counted
                logs.clear()  # only the last call's blocks are reported
                model(torch.randn(16, cs, lat_h, lat_w), y, t, k * cs, text, cam, cache)
    return [summarise(log) for log in logs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--chunk", type=int, default=0, help="count the first pass of this chunk (earlier ones run)")
    parser.add_argument("--out", type=Path, default=Path("out/op_count.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    blocks = block_ops(args.preset, getattr(torch, args.dtype), args.chunk)
    for i, b in enumerate(blocks):
        print(f"block {i}: {b.ops} ops ({b.kernels} kernels, {b.total} with views; {b.cuda_kernels} kernels with "
              f"rms_norm fused as on CUDA)")
    print("ops of block 0:", ", ".join(f"{name} x{count}" for name, count in blocks[0].by_name.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"preset": args.preset, "dtype": args.dtype, "chunk": args.chunk, "device": "cpu",
              "blocks": [b.__dict__ for b in blocks]}  # fmt: skip
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
