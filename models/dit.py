"""LingBot-World-Fast DiT (Wan2.x causal DiT with camera control), gpt-fast style.

Module names follow the official ``WanModelFast`` so released state dicts load strictly. One call denoises
one chunk of ``cs`` latent frames (``N = cs * fs`` tokens, ``fs = h*w/4``) against the session's rolling KV
cache. The exact computation is specified in ``shared/fixtures/golden/README.md`` (sections 5-6).

Work done once instead of per call:
- the timestep embedding depends only on ``t``: ``time_embed(t)`` computes ``e [1, d]`` / ``e0 [1, 6, d]``
  once per distinct ``t`` (memoised on the model) and blocks broadcast it over tokens;
- the camera modulation of every block depends only on the chunk's control: ``camera_modulation`` is run
  once per chunk and its result is reused by all denoising passes and the refresh pass;
- the text keys/values of every block are computed once per session (``text_cache``);
- the per-block modulation ``modulation + e0`` (with ``1 +`` already applied to the two scales) is memoised with
  the timestep embedding, and the camera's ``1 + scale`` is formed once per chunk.

Precision (as the reference's autocast regions): the residual stream, the modulation and the output head run in
float32; every other Linear runs in the weights' dtype (bf16 on GPU), and ``1 + cam_scale`` is rounded to that dtype
before it scales the float32 stream. The elementwise steps are written as few passes as eager PyTorch allows, since at
480x832 they were about a seventh of a chunk: LN + modulate is one ``layer_norm`` with the modulation as its affine,
then one cast; each RMS norm is one ``rms_norm`` with its float32 gain (cast once per load, ``float_param``); on one
rank q/k stay float32 from their norm into RoPE (one complex multiply), q is cast once after it and k by the copy that
writes it into the KV ring; gates and the camera are one ``addcmul`` each. ``scripts/op_count.py`` counts the aten ops
of one block (57 before, 48 now, in bf16 on CPU); compiled (``models.compiled``), a block is 7 generated kernels on
CPU besides its GEMMs and attentions, the k chain and the ring write among them as one (``tests/test_dit_fusion.py``).

Sequence parallelism is applied from outside with ``apply_sequence_parallel(model, group)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from models.attention import AttentionFn, select_attention
from models.dit_config import DiTConfig
from models.kv_cache import KVCache, LayerKV, TextCache
from models.rope import apply_rope, rope_angles, rope_freqs, rope_rotate
from models.ulysses import Ulysses


def float_param(module: nn.Module, name: str) -> torch.Tensor:
    """``module.<name>`` in float32, cast once per load instead of once per call: a bf16 model's norm gains and biases
    are kept as float32 copies (derived, outside the state dict), remade when the weight is replaced (another tensor,
    even one the allocator put at the old address) or written through autograd's view of it (its version changes).
    ``load_state_dict`` forgets every copy (``forget_float_params``); a writer that bypasses the version counter
    (``.data``, inference tensors) calls it too. A compiled block casts inline: the cast of a [d] vector fuses into
    its user."""
    weight: torch.Tensor = getattr(module, name)
    if weight.dtype == torch.float32 or torch.compiler.is_compiling():
        return weight.float()
    # ``module.to()`` swaps a parameter's storage in place (same tensor, same version): its address, device and
    # dtype tell. The weight is held (a norm gain or the head: small) so that ``is`` never meets a reused id.
    key = (weight.data_ptr(), weight.device, weight.dtype, -1 if weight.is_inference() else weight._version)
    memo: dict[str, tuple[torch.Tensor, tuple, torch.Tensor]] = module.__dict__.setdefault("_float_params", {})
    held = memo.get(name)
    if held is None or held[0] is not weight or held[1] != key:
        held = memo[name] = (weight, key, weight.detach().float())
    return held[2]


def forget_float_params(model: nn.Module) -> None:
    """Drop the float32 copies ``float_param`` keeps anywhere in ``model``: the next call casts the weights anew."""
    for module in model.modules():
        module.__dict__.pop("_float_params", None)


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight`` in float32, over the whole last dim (all heads jointly): one
    ``rms_norm``, which upcasts, applies the gain in float32 and rounds once to the input's dtype (one fused kernel on
    CUDA). With ``keep_float`` the result stays float32 (the self-attention's q/k on one rank: their RoPE runs in
    float32 anyway, so a round trip through bf16 in between would be two passes for nothing; under Ulysses they are
    sent in the compute dtype)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.keep_float = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.keep_float:
            return F.rms_norm(x.float(), x.shape[-1:], float_param(self, "weight"), self.eps)
        return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)


def layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Non-affine LayerNorm computed in float32."""
    return F.layer_norm(x.float(), x.shape[-1:], eps=eps).type_as(x)


def modulated_norm(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float,
                   dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """``LN(x) * scale + shift`` of the float32 stream ``x [n, d]``, cast to ``dtype`` for the Linear that follows.
    A modulation shared by all tokens (``[1, d]``) is the LayerNorm's own affine: one kernel instead of three; a
    per-token one (the uncached per-frame form) is applied after it."""
    if shift.shape[0] == 1 and scale.shape[0] == 1:
        return F.layer_norm(x, x.shape[-1:], scale[0], shift[0], eps).to(dtype)
    return torch.addcmul(shift, layer_norm(x, eps), scale).to(dtype)


class SelfAttention(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.q, self.k, self.v, self.o = (nn.Linear(cfg.dim, cfg.dim) for _ in range(4))
        self.norm_q, self.norm_k = RMSNorm(cfg.dim, cfg.eps), RMSNorm(cfg.dim, cfg.eps)
        self.sp = Ulysses(None)
        self.attend: AttentionFn = select_attention("sdpa")
        self.overlap = cfg.overlap_all_to_all
        # (weight [3d, d], bias [3d]) whose rows q, k and v's parameters are views of; None: three GEMMs
        self.fused_qkv: tuple[torch.Tensor, torch.Tensor] | None = None
        self.register_load_state_dict_post_hook(lambda module, _keys: module._fuse_again())
        self.set_fused_qkv(cfg.fused_qkv)

    def set_fused_qkv(self, on: bool) -> None:
        """Run q, k and v as one GEMM over the concatenated weights. The concatenation is made once and q, k and v's
        parameters become views of its rows, so the state dict (names, shapes, checkpoint format) is unchanged and
        the weights are held once; a load copies into the views."""
        if not on:
            self.fused_qkv = None
            return
        linears = (self.q, self.k, self.v)
        if self.fused_qkv is not None and all(  # fused already (a load copied into the views): nothing to redo
                lin.weight.data_ptr() == self.fused_qkv[0][i * lin.out_features].data_ptr()
                and lin.bias.data_ptr() == self.fused_qkv[1][i * lin.out_features:].data_ptr()
                for i, lin in enumerate(linears)):
            return
        with torch.no_grad():
            weight, bias = torch.cat([lin.weight for lin in linears]), torch.cat([lin.bias for lin in linears])
        for i, lin in enumerate(linears):
            rows = slice(i * lin.out_features, (i + 1) * lin.out_features)
            lin.weight = nn.Parameter(weight[rows], requires_grad=lin.weight.requires_grad)
            lin.bias = nn.Parameter(bias[rows], requires_grad=lin.bias.requires_grad)
        self.fused_qkv = weight, bias

    def _fuse_again(self) -> None:
        """Fuse again after the parameters were replaced (a move, a cast, a load with ``assign=True``)."""
        if self.fused_qkv is not None:
            self.set_fused_qkv(True)

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]  # nn.Module's own signature
        super()._apply(fn, recurse)  # .to() / .to_empty() replace each parameter on its own ...
        self._fuse_again()  # ... so q, k and v are views of one tensor again
        return self

    def project_linear(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``[n, d]`` before the norms: three GEMMs, or one (``fused_qkv``) whose column thirds they are."""
        if self.fused_qkv is None:
            return self.q(a), self.k(a), self.v(a)
        q, k, v = F.linear(a, *self.fused_qkv).split(self.q.out_features, dim=-1)
        return q, k, v

    @property
    def sp(self) -> Ulysses:
        return self._sp

    @sp.setter
    def sp(self, sp: Ulysses) -> None:
        # q/k go through the all-to-all in the compute dtype (float32 would double its bytes); one rank keeps them
        # float32 from their norm into RoPE (RMSNorm.keep_float). Set with the group, whoever sets it.
        self._sp = sp
        self.norm_q.keep_float = self.norm_k.keep_float = sp.size == 1

    def project(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``[n, heads, hd]`` of this rank's tokens ``a [n, d]`` (the q/k RMS norm spans all heads)."""
        n = a.shape[0]
        q, k, v = self.project_linear(a)
        q = self.norm_q(q).view(n, self.heads, self.head_dim)
        k = self.norm_k(k).view(n, self.heads, self.head_dim)
        return q, k, v.view(n, self.heads, self.head_dim)

    def attend_group(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: slice, rope: torch.Tensor,
                     kv: LayerKV | None, mask: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        """``attend_heads`` of local heads ``heads`` only, through those heads' rows of the ring (the ring's layout
        is ``[heads, S, hd]``: a head group is a view of it, written in place)."""
        group_kv = None if kv is None else replace(kv, k=kv.k[heads], v=kv.v[heads])
        return self.attend_heads(q, k, v, rope, group_kv, mask)

    def attend_heads(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: torch.Tensor,
        kv: LayerKV | None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of the whole sequence for this rank's heads: ``[N, heads/R, hd]`` in, out; the keys and values
        of a cached call go through the session's ring (``kv``) first. The rotated keys are cast to the compute dtype
        by the copy that writes them into the ring (no pass of their own)."""
        dtype = v.dtype  # the compute dtype (q and k may still be float32 from their norm)
        q, k = apply_rope(q, rope, dtype), rope_rotate(k, rope)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads/R, N, hd]
        if kv is not None:
            assert mask is None, "the cached path attends to every valid slot"
            k, v = kv.write(k, v)  # [heads/R, L, hd]
            out = self.attend(q, k, v)
        else:  # the uncached full-sequence form (tests of the cached path); 4-D as every SDPA call
            out = F.scaled_dot_product_attention(q[None], k.to(dtype)[None], v[None], attn_mask=mask)[0]
        return out.transpose(0, 1)


class CrossAttention(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.q, self.k, self.v, self.o = (nn.Linear(cfg.dim, cfg.dim) for _ in range(4))
        self.norm_q, self.norm_k = RMSNorm(cfg.dim, cfg.eps), RMSNorm(cfg.dim, cfg.eps)
        self.attend: AttentionFn = select_attention("sdpa")

    def kv(self, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values ``[heads, T, hd]`` of the embedded context ``[T, d]`` (once per session)."""
        t = ctx.shape[0]
        k = self.norm_k(self.k(ctx)).view(t, self.heads, self.head_dim).transpose(0, 1)
        v = self.v(ctx).view(t, self.heads, self.head_dim).transpose(0, 1)
        return k.contiguous(), v.contiguous()

    def forward(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q = self.norm_q(self.q(x)).view(n, self.heads, self.head_dim).transpose(0, 1)  # [heads, n, hd]
        out = self.attend(q, k, v).transpose(0, 1).reshape(n, -1)  # no mask: padded text rows are attended
        return self.o(out)


class Block(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        d, self.eps = cfg.dim, cfg.eps
        self.self_attn = SelfAttention(cfg)
        self.norm3 = nn.LayerNorm(d, eps=cfg.eps, elementwise_affine=True)
        self.cross_attn = CrossAttention(cfg)
        self.ffn = nn.Sequential(nn.Linear(d, cfg.ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(cfg.ffn_dim, d))
        self.modulation = nn.Parameter(torch.randn(1, 6, d) / d**0.5)
        self.cam_injector_layer1, self.cam_injector_layer2 = nn.Linear(d, d), nn.Linear(d, d)
        self.cam_scale_layer, self.cam_shift_layer = nn.Linear(d, d), nn.Linear(d, d)

    def camera(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(1 + scale, shift)`` of this block for the shared camera features ``c [n, d]``, both in the compute
        dtype: the reference forms ``1 + cam_scale`` in bf16, so the rounding is part of the numbers."""
        g = self.cam_injector_layer2(F.silu(self.cam_injector_layer1(c))) + c
        return 1 + self.cam_scale_layer(g), self.cam_shift_layer(g)

    def forward(
        self,
        x: torch.Tensor,  # [n, d] local tokens, float32
        mod: torch.Tensor,  # [1 or n, 6, d] float32: shift, 1 + scale, gate (attention); shift, 1 + scale, gate (ffn)
        rope: torch.Tensor,
        n_total: int,
        kv: LayerKV | None,
        text_kv: tuple[torch.Tensor, torch.Tensor],
        cam: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        attn = self.self_attn
        q, k, v = self.attention_inputs(x, mod)
        if attn.overlap:  # the exchanges of some head groups run while others attend
            out = attn.sp.attend_overlapped(q, k, v, n_total, partial(attn.attend_group, rope=rope, kv=kv, mask=mask))
        else:
            q, k, v = attn.sp.qkv_to_heads(q, k, v, n_total)  # [N, heads/R, hd] each
            out = attn.sp.heads_to_seq(attn.attend_heads(q, k, v, rope, kv, mask))  # [n, heads, hd]
        return self.after_attention(x, out, mod, text_kv, cam)

    # The two halves around the Ulysses all-to-alls (models/compiled.py compiles them apart when the DiT is sharded).
    # The residual stream and the modulation stay float32 (the reference's float32 autocast regions); each Linear gets
    # its input in the weights' dtype (bf16 on GPU). In float32 every cast is a no-op.

    def attention_inputs(self, x: torch.Tensor, mod: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.self_attn.project(modulated_norm(x, mod[:, 0], mod[:, 1], self.eps, self.norm3.weight.dtype))

    def after_attention(
        self,
        x: torch.Tensor,
        out: torch.Tensor,  # [n, heads, hd] self-attention output of this rank's tokens
        mod: torch.Tensor,
        text_kv: tuple[torch.Tensor, torch.Tensor],
        cam: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        wdt = self.norm3.weight.dtype
        x = torch.addcmul(x, self.self_attn.o(out.reshape(x.shape[0], -1)), mod[:, 2])
        x = torch.addcmul(cam[1], x, cam[0])  # (1 + cam_scale) * x + cam_shift, float32 result
        w3, b3 = float_param(self.norm3, "weight"), float_param(self.norm3, "bias")
        x = x + self.cross_attn(F.layer_norm(x, x.shape[-1:], w3, b3, self.eps).to(wdt), *text_kv)
        return torch.addcmul(x, self.ffn(modulated_norm(x, mod[:, 3], mod[:, 4], self.eps, wdt)), mod[:, 5])


class Head(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.eps = cfg.eps
        self.head = nn.Linear(cfg.dim, math.prod(cfg.patch_size) * cfg.out_dim)
        self.modulation = nn.Parameter(torch.randn(1, 2, cfg.dim) / cfg.dim**0.5)

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """Float32 throughout, whatever the weights' dtype (the reference runs the head under float32 autocast)."""
        s = float_param(self, "modulation") + e.float()[:, None]  # [1 or n, 2, d]; the head uses e, not e0
        h = torch.addcmul(s[:, 0], layer_norm(x, self.eps), 1 + s[:, 1])
        return F.linear(h, float_param(self.head, "weight"), float_param(self.head, "bias"))


class BlockRunner(Protocol):
    """Runs ``block(*args)``, compiled (``models.compiled``)."""

    failure: BaseException | None  # set once compiling failed: the blocks then run eagerly

    def __call__(self, block: Block, *args: object) -> torch.Tensor: ...


class PassGraphs(Protocol):
    """Replays a session's steady passes as CUDA graphs (``models.compiled``)."""

    def steady(self, cache: KVCache) -> bool: ...

    def __call__(self, model: WanModelFast, x: torch.Tensor, y: torch.Tensor, t: float, e: torch.Tensor,
                 mods: torch.Tensor, rope: torch.Tensor, text: TextCache, cam: ChunkCamera,
                 cache: KVCache) -> torch.Tensor: ...  # fmt: skip


@dataclass
class ChunkCamera:
    """Camera modulation of every block for one chunk: ``(1 + scale, shift)`` each ``[n_local, d]`` in the compute
    dtype; a block applies ``x = (1 + scale) * x + shift`` to its float32 stream."""

    per_block: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


class WanModelFast(nn.Module):
    """The causal DiT. Inputs of one call are unbatched: ``x [16, cs, h, w]``, ``y [20, cs, h, w]``."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.dim
        self.patch_embedding = nn.Conv3d(cfg.in_dim, d, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.text_embedding = nn.Sequential(nn.Linear(cfg.text_dim, d), nn.GELU(approximate="tanh"), nn.Linear(d, d))
        self.time_embedding = nn.Sequential(nn.Linear(cfg.freq_dim, d), nn.SiLU(), nn.Linear(d, d))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.patch_embedding_wancamctrl = nn.Linear(cfg.control_features, d)
        self.c2ws_hidden_states_layer1, self.c2ws_hidden_states_layer2 = nn.Linear(d, d), nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.head = Head(cfg)
        self.sp = Ulysses(None)
        self._time_memo: dict[float, tuple[torch.Tensor, torch.Tensor]] = {}
        self._rope_memo: tuple[tuple, torch.Tensor] | None = None
        # Set by models.compiled.compile_dit: the compiled block (None: eager) and the CUDA-graph replay of steady
        # passes (None: none).
        self.block_runner: BlockRunner | None = None
        self.graphs: PassGraphs | None = None
        self.register_load_state_dict_pre_hook(lambda *args, **kwargs: self._forget_derived())
        self.set_attention(select_attention(cfg.attention))

    def _forget_derived(self) -> None:
        """What was computed from the weights (time embeddings, float32 gains) is stale once new weights load."""
        self._time_memo.clear()
        forget_float_params(self)

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]  # nn.Module's own signature
        super()._apply(fn, recurse)  # a move or cast: no float32 gain of the old weights stays on their device
        forget_float_params(self)
        return self

    def set_qkv_exchange(self, fused_qkv: bool, overlap_all_to_all: bool) -> None:
        """The q/k/v projection and the Ulysses exchange as ``DiTConfig`` names them, on every block: a model built
        for another stage (benchmarks share one) then runs this stage's settings."""
        self.cfg = replace(self.cfg, fused_qkv=fused_qkv, overlap_all_to_all=overlap_all_to_all)
        for block in self.blocks:
            block.self_attn.set_fused_qkv(fused_qkv)
            block.self_attn.overlap = overlap_all_to_all

    def set_attention(self, fn: AttentionFn) -> None:
        """The self-attention kernel (the one that is timed and chosen); cross-attention over the 512 text rows stays
        on SDPA (Sage would copy its keys every call for no measured gain)."""
        for block in self.blocks:
            block.self_attn.attend = fn

    # ---- per-session / per-chunk / per-t precomputation -------------------------------------------------

    def _embed_t(self, t: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(e [1, d], mods [layers, 1, 6, d])`` of timestep ``t``, all float32 (the reference embeds t under float32
        autocast); ``mods`` is every block's ``modulation + e0`` with ``1 +`` applied to the two scales."""
        half = self.cfg.freq_dim // 2
        w = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64) / half)
        arg = torch.tensor([float(t)], dtype=torch.float64)[:, None] * w  # [1, half]
        sinus = torch.cat([torch.cos(arg), torch.sin(arg)], dim=1)
        lin1, lin2, proj = self.time_embedding[0], self.time_embedding[2], self.time_projection[1]
        sinus = sinus.to(device=lin1.weight.device, dtype=torch.float32)
        e = F.linear(F.silu(F.linear(sinus, lin1.weight.float(), lin1.bias.float())), lin2.weight.float(),
                     lin2.bias.float())  # [1, d]
        e0 = F.linear(F.silu(e), proj.weight.float(), proj.bias.float()).unflatten(1, (6, self.cfg.dim))
        mods = torch.stack([block.modulation.float() for block in self.blocks]) + e0  # [layers, 1, 6, d]
        mods[:, :, 1] += 1
        mods[:, :, 4] += 1
        return e, mods

    def time_embed(self, t: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``_embed_t`` memoised per distinct ``t`` (inference only; cleared on load)."""
        key = float(t)
        if key not in self._time_memo:
            self._time_memo[key] = self._embed_t(key)
        return self._time_memo[key]

    def text_cache(self, context: torch.Tensor) -> TextCache:
        """Embed the prompt context ``[L <= text_len, text_dim]`` (zero-padded to text_len) and project it."""
        rows, text_dim = context.shape
        assert rows <= self.cfg.text_len and text_dim == self.cfg.text_dim, f"bad context {tuple(context.shape)}"
        p = self.text_embedding[0].weight
        padded = context.new_zeros(self.cfg.text_len, text_dim)
        padded[:rows] = context
        ctx = self.text_embedding(padded.to(device=p.device, dtype=p.dtype))  # [T, d]
        kvs = [block.cross_attn.kv(ctx) for block in self.blocks]
        return TextCache(k=[k for k, _ in kvs], v=[v for _, v in kvs])

    def camera_modulation(self, control: torch.Tensor) -> ChunkCamera:
        """Per-block camera modulation of a chunk from its control ``[1, 384, F, h, w]`` (this rank's tokens)."""
        _, ch, f, h, w = control.shape
        assert ch * 4 == self.cfg.control_features, f"control has {ch} channels"
        c = control[0].reshape(ch, f, h // 2, 2, w // 2, 2).permute(1, 2, 4, 0, 3, 5).reshape(-1, ch * 4)
        p = self.patch_embedding_wancamctrl.weight
        c = self.patch_embedding_wancamctrl(self.sp.shard(c).to(device=p.device, dtype=p.dtype))  # [n, d]
        c = c + self.c2ws_hidden_states_layer2(F.silu(self.c2ws_hidden_states_layer1(c)))
        return ChunkCamera([block.camera(c) for block in self.blocks])

    def _rope(self, f: int, h: int, w: int, start_frame: int, device: torch.device) -> torch.Tensor:
        """RoPE rotations of a call, built on the device in the precision the q/k rotation runs in (complex128 for
        float32 weights, complex64 for bf16) and kept for the next calls of the same chunk."""
        wide = self.patch_embedding.weight.dtype in (torch.float32, torch.float64)
        key = (f, h, w, start_frame, device, wide)
        if self._rope_memo is None or self._rope_memo[0] != key:
            freqs = rope_freqs(rope_angles(self.cfg.head_dim, f, h, w, start_frame, device))
            self._rope_memo = (key, freqs if wide else freqs.to(torch.complex64))
        return self._rope_memo[1]

    # ---- one call -----------------------------------------------------------------------------------------

    def forward(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        t: float | list[float],
        start_frame: int,
        text: TextCache,
        cam: ChunkCamera,
        cache: KVCache | None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Velocity ``[out_dim, F, h, w]`` (float32) for latent ``x [16, F, h, w]`` starting at latent frame
        ``start_frame``.

        ``t`` is one timestep for all tokens (the streaming call) or one per latent frame (only for the
        uncached full-sequence form with a ``mask``, used to check the cached path).
        """
        _, f, h, w = x.shape
        fs = (h // 2) * (w // 2)
        if isinstance(t, list):
            assert cache is None and self.sp.size == 1, "per-frame timesteps only in the uncached 1-rank form"
            embs = [self._embed_t(tf) for tf in t]
            e = torch.cat([em for em, _ in embs]).repeat_interleave(fs, 0)  # [N, d]
            mods = torch.cat([m for _, m in embs], dim=1).repeat_interleave(fs, 1)  # [layers, N, 6, d]
        else:
            e, mods = self.time_embed(t)  # broadcast over tokens
        # Compiled blocks and captured passes write the ring through a slot index at a fixed address (the eager
        # reference writes runs of slices); only the streaming call is ever compiled.
        # After a compile failure the blocks run eagerly: then the eager form (complex RoPE, sliced ring writes) too.
        compiled = self.block_runner is not None and self.block_runner.failure is None
        fast = cache is not None and mask is None and (compiled or self.graphs is not None)
        if cache is not None:
            cache.begin(start_frame * fs, f * fs, indexed=fast)
        rope = self._rope(f, h // 2, w // 2, start_frame, self.patch_embedding.weight.device)
        if not fast:
            return self.run(x, y, e, mods, rope, text, cam, cache, mask)
        rope = torch.view_as_real(rope)  # (cos, sin) pairs: RoPE as real arithmetic, which compilers fuse
        assert cache is not None
        if self.graphs is not None and self.graphs.steady(cache):
            return self.graphs(self, x, y, float(t), e, mods, rope, text, cam, cache)  # type: ignore[arg-type]
        return self.run(x, y, e, mods, rope, text, cam, cache)

    def run(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        e: torch.Tensor,
        mods: torch.Tensor,
        rope: torch.Tensor,
        text: TextCache,
        cam: ChunkCamera,
        cache: KVCache | None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One pass with everything per call already prepared (the cache placed, the timestep embedded, the RoPE table
        built): tensors in, velocity out, no host work that depends on values (what a CUDA graph captures)."""
        _, f, h, w = x.shape
        p = self.patch_embedding.weight
        xin = torch.cat([x, y]).to(device=p.device, dtype=p.dtype)[None]  # [1, 36, F, h, w]
        tokens = self.patch_embedding(xin).flatten(2)[0].transpose(0, 1)  # [N, d], (frame, row, col)
        n_total = tokens.shape[0]
        # [n, d]; the residual stream is float32 and row-major (the patch embedding gives it column-major, which would
        # also give block 0 a compiled variant of its own)
        xs = self.sp.shard(tokens).float().contiguous()
        runner = self.block_runner if cache is not None and mask is None else None
        for i, block in enumerate(self.blocks):
            kv = None if cache is None else cache.layer(i)
            args = (xs, mods[i], rope, n_total, kv, (text.k[i], text.v[i]), cam.per_block[i], mask)
            xs = block(*args) if runner is None else runner(block, *args)
        out = self.sp.gather(self.head(xs, e), n_total)  # [N, 4 * out_dim]
        out = out.reshape(f, h // 2, w // 2, 2, 2, self.cfg.out_dim)  # (f, i, j, r, s, c)
        return out.permute(5, 0, 1, 3, 2, 4).reshape(self.cfg.out_dim, f, h, w)


def apply_sequence_parallel(model: WanModelFast, group: dist.ProcessGroup | Ulysses | None) -> WanModelFast:
    """Shard tokens over ``group`` (Ulysses); ``None`` or a one-rank group leaves the model single-process. A
    ``Ulysses`` is used as it is (``StandInUlysses``: one rank's compute of a larger group, on one device)."""
    sp = group if isinstance(group, Ulysses) else Ulysses(group)
    sp.local_heads(model.cfg.num_heads)  # validates divisibility
    model.sp = sp
    for block in model.blocks:
        block.self_attn.sp = sp
    return model


def chunk_flops(cfg: DiTConfig, lat_h: int, lat_w: int, kv_frames: int | None = None) -> dict[str, float]:
    """Matmul FLOPs (2 per multiply-add) of one chunk at steady state, for utilisation reports.

    ``kv_frames`` is the number of latent frames attended (default: the full window). A chunk is
    ``len(timestep_indices)`` denoising passes plus the refresh pass; the camera modulation runs once per
    chunk and the text keys/values once per session (not counted here).
    """
    d, ffn, text = cfg.dim, cfg.ffn_dim, cfg.text_len
    fs = (lat_h // 2) * (lat_w // 2)
    n = cfg.chunk_size * fs
    kv = (kv_frames if kv_frames is not None else cfg.kv_window) * fs
    per_block = (
        2 * n * d * d * 4  # self-attention q, k, v, o
        + 2 * n * kv * d * 2  # q k^T and attn v over the window
        + 2 * n * d * d * 2  # cross-attention q, o
        + 2 * n * text * d * 2  # cross-attention over text_len rows
        + 2 * n * d * ffn * 2  # MLP
    )
    embed = 2 * n * cfg.in_dim * math.prod(cfg.patch_size) * d + 2 * n * d * cfg.out_dim * math.prod(cfg.patch_size)
    per_pass = cfg.num_layers * per_block + embed
    camera = 2 * n * cfg.control_features * d + 2 * n * d * d * 2 + cfg.num_layers * 2 * n * d * d * 4
    passes = len(cfg.timestep_indices) + 1
    return {"per_pass": float(per_pass), "camera": float(camera), "per_chunk": float(passes * per_pass + camera)}
