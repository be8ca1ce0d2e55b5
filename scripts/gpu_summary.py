"""The summary table ``scripts/bench_gpu.py`` prints and ``scripts/gpu_run.sh`` writes as ``summary.txt``: plain
formatting of its results (a missing or failed section reads "-", never an exception)."""

from __future__ import annotations

from typing import Any


def _f(value: Any, spec: str = ".3f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def _gib(nbytes: Any) -> str:
    if not isinstance(nbytes, (int, float)):
        return "-"
    return f"{nbytes / 2**30:.2f} GiB" if abs(nbytes) >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def _dit_lines(results: dict[str, Any]) -> list[str]:
    peak = results.get("matmul", {}).get("tflops")
    lines = []
    for name, entry in results.get("dit", {}).items():
        if "steady_s" not in entry:
            lines.append(f"DiT {name:9s} {str(entry.get('error', '?'))[:100]}")
            continue
        floor = entry["pflop_per_chunk"] * 1e15 / (peak * 1e12) if isinstance(peak, (int, float)) and peak else None
        over = entry["steady_s"] / floor if floor else None
        lines.append(f"DiT {name:9s} steady {entry['steady_s']:.3f} s/chunk (first {entry['chunk_s'][0]:.3f})  "
                     f"{entry['pflop_per_chunk']:.3f} PFLOP  floor {_f(floor)} s  x{_f(over, '.2f')}"
                     f"  {entry['tflops']:.0f} TFLOP/s  peak {entry['peak_gib']:.1f} GiB (model "
                     f"{_f(entry.get('model_peak_gib'), '.1f')})  fused-only "
                     f"{entry.get('fused_kernels_only', '-')}")  # fmt: skip
        lines.append(f"    session bytes: {_gib(entry.get('session_bytes_steady'))} measured (after open "
                     f"{_gib(entry.get('session_bytes_open'))}), KV ring computed "
                     f"{_gib(entry.get('session_bytes_computed_kv'))}")  # fmt: skip
    return lines


def _split_rank_lines(results: dict[str, Any]) -> list[str]:
    lines = []
    for name, entry in results.get("split_rank", {}).items():
        if "compute_s" not in entry:
            lines.append(f"DiT rank at {name}: {entry.get('skipped') or entry.get('error', '?')}"[:160])
            continue
        bound = entry["frames_per_chunk"] / entry["compute_s"]
        lines.append(f"DiT rank at {name}: {entry['local_heads']} heads x {entry['local_tokens']} tokens, compute "
                     f"{entry['compute_s']:.3f} s/chunk (all-to-alls not in it: {entry['alltoall_gb_per_chunk']:.2f} "
                     f"GB/chunk to move)  at most {bound:.1f} FPS  peak {entry['peak_gib']:.1f} GiB (model "
                     f"{_f(entry.get('model_peak_gib'), '.1f')})")  # fmt: skip
    return lines


def _sdpa_lines(results: dict[str, Any]) -> list[str]:
    sdpa = results.get("sdpa", {})
    if "q" not in sdpa:
        return []
    return [f"SDPA q {sdpa['q']} k/v {sdpa['kv']} {sdpa['dtype']}: " + "  ".join(
        f"{b} {entry['s'] * 1e3:.2f} ms {entry['tflops']:.0f} TFLOP/s" if "s" in entry else f"{b} refused"
        for b, entry in sdpa.items() if isinstance(entry, dict))]  # fmt: skip


def _vae_lines(results: dict[str, Any]) -> list[str]:
    lines = []
    for name, entry in results.get("vae", {}).items():
        if "decode_steady_s" in entry:
            err = f"rel L2 {entry['rel_l2_vs_fp32']:.4f}" if "rel_l2_vs_fp32" in entry else "reference"
            dec, enc = entry["decode_chunk_s"], entry["encode_chunk_s"]
            lines.append(f"VAE {name:9s} decode {entry['decode_steady_s']:.3f} s (first {dec[0]:.3f})  encode "
                         f"{entry['encode_steady_s']:.3f} s (first {enc[0]:.3f})  ({err})  session: decode "
                         f"{_gib(entry.get('decode_session_bytes'))} measured / "
                         f"{_gib(entry.get('decode_session_bytes_computed'))} counted, encode "
                         f"{_gib(entry.get('encode_session_bytes'))} / "
                         f"{_gib(entry.get('encode_session_bytes_computed'))}")  # fmt: skip
            lines.append(f"    peak above start: decode {_f(entry.get('decode_peak_gib'), '.2f')} GiB (model "
                         f"{_f(entry.get('decode_model_gib'), '.2f')} + workspace margin "
                         f"{_f(entry.get('workspace_margin_gib'), '.2f')}), encode "
                         f"{_f(entry.get('encode_peak_gib'), '.2f')} GiB (model "
                         f"{_f(entry.get('encode_model_gib'), '.2f')} + the same margin)")  # fmt: skip
    if "prompt_s" in results.get("umt5", {}):
        lines.append(f"umT5 prompt {results['umt5']['prompt_s']:.3f} s")
    return lines


def _serve_lines(results: dict[str, Any]) -> list[str]:
    served = results.get("serve", {})
    if not served.get("first"):
        return []
    first, steady = served["first"], served["steady"]
    return [f"served {served['size'][0]}x{served['size'][1]}: first chunk {_f(served['first_chunk_s'])} s "
            f"after open (denoise {_f(first['denoise_s'])}, decode {_f(first['decode_s'])}, encode "
            f"{_f(first['condition_s'])}); steady period {_f(served['steady_period_s'])} s (denoise "
            f"{_f(steady['denoise_s'])}, decode {_f(steady['decode_s'])}, encode {_f(steady['condition_s'])})"]


def _projection_lines(results: dict[str, Any]) -> list[str]:
    lines = []
    for layout, entry in results.get("projection", {}).items():
        if isinstance(entry, dict) and entry.get("projected"):
            lines.append(f"PROJECTED {layout:11s} period {entry['period_s']:.3f} s  {entry['fps']:.1f} FPS  (DiT "
                         f"{entry['dit_s']:.3f} s from {entry['dit_from']}"
                         f"{' + decode + encode: co-located' if entry['colocated'] else ''})")
        elif isinstance(entry, dict) and "why" in entry:
            lines.append(f"not projected {layout:11s} {entry['why']}")
    for key, entry in results.get("targets", {}).items():
        lines.append(f"target {key:18s} {entry['value']:.3f} vs {entry['target']}  "
                     f"{'PASS' if entry['pass'] else 'FAIL'}{' (projected)' if entry.get('projected') else ''}")
    return lines


def _probe_lines(results: dict[str, Any]) -> list[str]:
    if "probe" not in results:
        return []
    probe, cc = results["probe"], results["probe"].get("c_compiler", {})
    compiler = f"{cc['path']} ({cc['version']})" if cc.get("found") else "NONE (compile falls back to eager)"
    return [f"cold import torch {_f(probe.get('import_torch_s'), '.1f')} s  CUDA init "
            f"{_f(probe.get('cuda_init_s'), '.1f')} s  context {_f(probe.get('context_gib'), '.2f')} GiB  "
            f"triton {probe.get('triton')}  C compiler {compiler}"]


def table(results: dict[str, Any]) -> str:
    """The compact summary: DiT against the FLOP floor, SDPA backends, VAE per precision, bytes per session, the
    served session's first chunk against its steady chunks, projections and targets. A part whose entries are
    incomplete says so instead of ending the summary."""
    lines = [f"device: {results.get('device')}  torch {results.get('torch')}  sizes {results.get('sizes')}  "
             f"matmul peak {_f(results.get('matmul', {}).get('tflops'), '.0f')} TFLOP/s"]
    for part in (_probe_lines, _dit_lines, _split_rank_lines, _sdpa_lines, _vae_lines, _serve_lines, _projection_lines):
        try:
            lines += part(results)
        except (KeyError, IndexError, TypeError, ValueError) as error:
            lines.append(f"{part.__name__.strip('_')}: incomplete entry ({type(error).__name__}: {error})")
    failed = [name for name, entry in results.items() if isinstance(entry, dict) and "error" in entry]
    if failed:
        lines.append(f"sections with errors: {failed}")
    return "\n".join(lines)
