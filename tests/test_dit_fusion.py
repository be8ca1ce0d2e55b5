"""The DiT block's elementwise chain runs as few passes as it can: eager, one block dispatches at most 48 aten ops
in bf16 (57 before the chain was fused), 31 kernels when each RMS norm is one as on CUDA (45 before); compiled
(``blocks``), the q/k RMS norm, RoPE, cast and KV-ring write are one generated kernel that writes the ring in place,
and a block is at most 7 generated kernels besides its GEMMs and attentions (8 before). The norm gains are cast to
float32 once per load, not per call, and follow a new load. That the fused forms compute the same function is the
golden tests' job (``tests/test_dit_golden.py``, ``tests/test_dit_compile.py``).
"""

from __future__ import annotations

import re

import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

from models.compiled import compile_dit
from models.dit import DiTConfig, WanModelFast, float_param
from models.kv_cache import KVCache, new_kv_cache
from scripts.op_count import block_ops

torch.set_num_threads(1)

EAGER_OPS_BF16 = 48  # non-view aten ops of one block on CPU (main: 57)
EAGER_OPS_F32 = 43  # (main: 46)
CUDA_KERNELS_BF16 = 31  # the same with each rms_norm one fused kernel, as on CUDA (main: 45)
COMPILED_KERNELS = 7  # generated (fused) kernels of one compiled block, GEMMs and attentions not counted


def test_one_eager_block_dispatches_at_most_48_ops_in_bf16_and_43_in_float32() -> None:
    for dtype, pinned in ((torch.bfloat16, EAGER_OPS_BF16), (torch.float32, EAGER_OPS_F32)):
        blocks = block_ops("tiny", dtype)
        assert len(blocks) == 2 and blocks[0].ops == blocks[1].ops, [b.ops for b in blocks]
        assert blocks[0].ops <= pinned, (dtype, blocks[0].by_name)
        if dtype == torch.bfloat16:
            assert blocks[0].cuda_kernels <= CUDA_KERNELS_BF16, blocks[0].by_name
    ops = block_ops("tiny", torch.bfloat16)[0].by_name
    # each RMS norm casts its input up and its output down once; the two LN + modulate and LN3 one cast each; q once
    assert ops["_to_copy"] <= 8 and ops["addcmul"] <= 3, ops


def test_a_wrapping_chunk_adds_only_the_ring_writes_of_its_second_run() -> None:
    """Chunk 4 of the tiny window wraps the ring: k and v are written in two runs of slices, two copies more."""
    assert block_ops("tiny", torch.bfloat16, chunk=4)[0].ops <= EAGER_OPS_BF16 + 2


def test_norm_gains_are_cast_once_and_follow_a_new_load() -> None:
    norm = WanModelFast(DiTConfig.from_name("tiny")).to(torch.bfloat16).blocks[0].self_attn.norm_q
    first = float_param(norm, "weight")
    assert first.dtype == torch.float32 and float_param(norm, "weight") is first  # no new cast per call
    with torch.no_grad():
        norm.weight.copy_(torch.full_like(norm.weight, 0.5))  # what a checkpoint load does to the parameter
    again = float_param(norm, "weight")
    assert again is not first and bool((again == 0.5).all())
    fp32 = WanModelFast(DiTConfig.from_name("tiny")).blocks[0].norm3
    assert float_param(fp32, "bias") is fp32.bias  # float32 weights are used as they are


def test_a_replaced_norm_gain_is_cast_anew_even_at_the_old_weights_address() -> None:
    """``load_state_dict(assign=True)`` puts new tensors in; the allocator may hand the new one the old one's address
    and it starts at version 0 like the old one did, so only the tensor's identity tells them apart."""
    norm = WanModelFast(DiTConfig.from_name("tiny")).to(torch.bfloat16).blocks[0].self_attn.norm_q
    first = float_param(norm, "weight").clone()
    storage = norm.weight.detach()
    norm.weight = nn.Parameter(storage.view_as(storage), requires_grad=False)  # another tensor at the same address
    norm.weight.data.fill_(0.25)  # ``.data`` writes bypass the version counter: only the identity changed
    assert norm.weight.data_ptr() == storage.data_ptr()
    assert bool((float_param(norm, "weight") == 0.25).all()) and not bool((first == 0.25).all())


def test_a_model_moved_or_cast_after_a_cast_gets_its_gains_cast_from_the_moved_weights() -> None:
    """``module.to()`` swaps each parameter's storage in place: the same tensor, the same version."""
    model = WanModelFast(DiTConfig.from_name("tiny")).to(torch.bfloat16)
    norm = model.blocks[0].self_attn.norm_q
    first = float_param(norm, "weight")
    model.to(torch.float16)
    assert "_float_params" not in norm.__dict__  # dropped by the move: no copy is kept on the old device
    again = float_param(norm, "weight")
    assert again is not first and torch.equal(again, norm.weight.float())


def test_loading_a_state_dict_forgets_every_cast_even_into_inference_tensors() -> None:
    """Weights made under ``inference_mode`` have no version counter: a load copied into them in place is seen only
    because ``load_state_dict`` forgets the casts."""
    with torch.inference_mode():
        model = WanModelFast(DiTConfig.from_name("tiny")).to(torch.bfloat16)
        norm = model.blocks[0].self_attn.norm_k
        float_param(norm, "weight")
        state = {k: v.clone() for k, v in model.state_dict().items()}
        state["blocks.0.self_attn.norm_k.weight"].fill_(0.5)
        model.load_state_dict(state)
        assert bool((float_param(norm, "weight") == 0.5).all())


def _call_code(code: str) -> str:
    """The wrapper's ``call`` function: the buffers it allocates and the kernels it launches, in order."""
    call = code[code.index("def call(") :]
    return call[: call.index("def get_args")] if "def get_args" in call else call


def test_the_compiled_block_writes_the_ring_in_place_in_the_kernel_that_norms_and_rotates_k() -> None:
    """Under ``compile = blocks`` the ring is a graph input written through the slot index: inductor must write it
    where it is (no copy of the layer's keys or values made and copied back), and the k chain (RMS norm, RoPE, cast)
    should land in the same kernel as that write."""
    torch._dynamo.reset()
    cfg = DiTConfig.from_name("tiny", attention="sdpa")
    torch.manual_seed(0)
    model, eager = (WanModelFast(cfg).to(torch.bfloat16).eval() for _ in range(2))
    eager.load_state_dict(model.state_dict())
    assert compile_dit(model, "blocks", "cpu", strict=True) == "blocks"
    lat_h, lat_w, cs = 8, 12, cfg.chunk_size
    fs = (lat_h // 2) * (lat_w // 2)
    caches = [new_kv_cache(cfg, fs, cfg.num_heads, "cpu", torch.bfloat16) for _ in range(2)]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, cs, lat_h, lat_w, generator=g), torch.randn(20, cs, lat_h, lat_w, generator=g)
    control, context = torch.randn(1, 384, cs, lat_h, lat_w, generator=g), torch.randn(4, cfg.text_dim, generator=g)

    def call(m: WanModelFast, cache: KVCache) -> torch.Tensor:
        with torch.no_grad():
            return m(x, y, 900.0, 0, m.text_cache(context), m.camera_modulation(control), cache)

    compiled, codes = run_and_get_code(call, model, caches[0])
    reference = call(eager, caches[1])
    assert len(codes) == 1, "one compiled graph serves both blocks"
    wrapper = _call_code(codes[0])
    ring = tuple(caches[0].k[0].shape)
    made = re.findall(rf"empty_strided\w*\(\({ring[0]}, {ring[1]}, {ring[2]}\)", wrapper)
    assert not made, "a buffer of the ring's size is made: the ring is not written in place"
    assert ".copy_(" not in wrapper, wrapper
    kernels = re.findall(r"^\s+(cpp_fused_\w+)\(", wrapper, re.M)
    assert len(kernels) <= COMPILED_KERNELS, kernels
    ring_writer = [k for k in kernels if "index_copy" in k]
    assert len(ring_writer) == 1 and all(op in ring_writer[0] for op in ("rsqrt", "_to_copy")), kernels
    for compiled_ring, eager_ring in zip((*caches[0].k, *caches[0].v), (*caches[1].k, *caches[1].v)):
        torch.testing.assert_close(compiled_ring, eager_ring, atol=0.05, rtol=0.02)  # bf16: one step apart at most
    torch.testing.assert_close(compiled, reference, atol=0.1, rtol=0.05)
