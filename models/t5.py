"""umT5 text encoder (encoder stack only), with the official parameter names.

``token_embedding`` -> ``num_layers`` x [RMS norm, self-attention with a per-layer relative position bias,
residual; RMS norm, gated-GELU FFN, residual] -> final RMS norm. Quirks of the reference that change numbers:
attention logits are ``q.k`` without 1/sqrt(d) scaling, masked keys are *filled* with the dtype minimum, the
softmax runs in float32, and the relative-position buckets are bidirectional with a log-spaced tail.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class T5Config:
    """Constructor arguments of the official ``T5Encoder``."""

    vocab: int = 256384  # token embedding rows
    dim: int = 4096  # model width
    dim_attn: int = 4096  # q/k/v width (all heads)
    dim_ffn: int = 10240  # gated FFN hidden width
    num_heads: int = 64
    num_layers: int = 24
    num_buckets: int = 32  # relative-position buckets (half per direction)
    max_dist: int = 128  # distance where the log-spaced buckets saturate
    shared_pos: bool = False  # False: every layer owns its relative-position table
    eps: float = 1e-6  # RMS norm epsilon

    def __post_init__(self) -> None:
        assert self.dim_attn % self.num_heads == 0, "dim_attn must split evenly into heads"

    @classmethod
    def preset(cls, name: str) -> T5Config:
        """``umt5-xxl`` (the real encoder, models_t5_umt5-xxl-enc-bf16.pth), ``small`` and ``tiny``."""
        presets = {
            "umt5-xxl": cls(),
            "small": cls(vocab=1024, dim=256, dim_attn=256, dim_ffn=640, num_heads=4, num_layers=4),
            "tiny": cls(vocab=256, dim=32, dim_attn=32, dim_ffn=64, num_heads=4, num_layers=2),
        }
        if name not in presets:
            raise KeyError(f"unknown T5 preset {name!r}; valid: {sorted(presets)}")
        return presets[name]

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor]) -> T5Config:
        """The sizes of an official umT5 encoder state dict, read from its tensor shapes (every size is one)."""
        try:
            vocab, dim = state["token_embedding.weight"].shape
            layers = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks."))
            shared = "pos_embedding.embedding.weight" in state
            buckets, heads = state["pos_embedding.embedding.weight" if shared else
                                   "blocks.0.pos_embedding.embedding.weight"].shape  # fmt: skip
            return cls(vocab=int(vocab), dim=int(dim), dim_attn=int(state["blocks.0.attn.q.weight"].shape[0]),
                       dim_ffn=int(state["blocks.0.ffn.fc1.weight"].shape[0]), num_heads=int(heads),
                       num_layers=layers, num_buckets=int(buckets), shared_pos=shared)  # fmt: skip
        except (KeyError, ValueError) as error:
            raise ValueError(f"not an umT5 encoder state dict (missing or odd {error})") from None

    @classmethod
    def from_fixture(cls, t5_section: dict[str, Any]) -> T5Config:
        """Build from the ``t5`` section of a golden fixture ``config.json``."""
        c = t5_section["constructor"]
        return cls(
            vocab=int(c["vocab"]),
            dim=int(c["dim"]),
            dim_attn=int(c["dim_attn"]),
            dim_ffn=int(c["dim_ffn"]),
            num_heads=int(c["num_heads"]),
            num_layers=int(c["num_layers"]),
            num_buckets=int(c["num_buckets"]),
            max_dist=int(t5_section.get("max_dist", 128)),
            shared_pos=bool(c.get("shared_pos", False)),
            eps=float(t5_section.get("eps", 1e-6)),
        )


class T5LayerNorm(nn.Module):
    """RMS norm without mean subtraction: ``x * rsqrt(mean(x^2) + eps) * weight`` (statistics in float32)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.type_as(self.weight)
        return self.weight * x


class T5Attention(nn.Module):
    def __init__(self, dim: int, dim_attn: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim_attn // num_heads
        self.q = nn.Linear(dim, dim_attn, bias=False)
        self.k = nn.Linear(dim, dim_attn, bias=False)
        self.v = nn.Linear(dim, dim_attn, bias=False)
        self.o = nn.Linear(dim_attn, dim, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos_bias: torch.Tensor) -> torch.Tensor:
        # x: [B, L, dim]; mask: [B, L] (1 = valid key); pos_bias: [1, nh, L, L]
        b, n, c = x.shape[0], self.num_heads, self.head_dim
        q = self.q(x).view(b, -1, n, c)
        k = self.k(x).view(b, -1, n, c)
        v = self.v(x).view(b, -1, n, c)
        bias = x.new_zeros(b, n, q.shape[1], k.shape[1]) + pos_bias
        bias = bias.masked_fill(mask.view(b, 1, 1, -1) == 0, torch.finfo(x.dtype).min)  # a fill, not an add
        logits = torch.einsum("binc,bjnc->bnij", q, k) + bias  # no 1/sqrt(d) scaling (T5)
        attn = F.softmax(logits.float(), dim=-1).type_as(logits)
        out = torch.einsum("bnij,bjnc->binc", attn, v).reshape(b, -1, n * c)  # [B, L, dim_attn]
        return self.o(out)


class GELUTanh(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class T5FeedForward(nn.Module):
    def __init__(self, dim: int, dim_ffn: int) -> None:
        super().__init__()
        self.gate = nn.Sequential(nn.Linear(dim, dim_ffn, bias=False), GELUTanh())
        self.fc1 = nn.Linear(dim, dim_ffn, bias=False)
        self.fc2 = nn.Linear(dim_ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x) * self.gate(x))


class T5RelativeEmbedding(nn.Module):
    """Bidirectional bucketed relative-position bias, one value per (bucket, head)."""

    def __init__(self, num_buckets: int, num_heads: int, max_dist: int) -> None:
        super().__init__()
        self.num_buckets = num_buckets
        self.max_dist = max_dist
        self.embedding = nn.Embedding(num_buckets, num_heads)

    def forward(self, lq: int, lk: int) -> torch.Tensor:
        device = self.embedding.weight.device
        rel = torch.arange(lk, device=device)[None, :] - torch.arange(lq, device=device)[:, None]  # key - query
        bias = self.embedding(self.bucket(rel))  # [lq, lk, nh]
        return bias.permute(2, 0, 1).unsqueeze(0).contiguous()  # [1, nh, lq, lk]

    def bucket(self, rel: torch.Tensor) -> torch.Tensor:
        nb = self.num_buckets // 2
        buckets = (rel > 0).long() * nb
        a = rel.abs()
        max_exact = nb // 2
        scaled = torch.log(a.clamp(min=1).float() / max_exact) / math.log(self.max_dist / max_exact)
        large = (max_exact + (scaled * (nb - max_exact)).long()).clamp(max=nb - 1)  # .long() truncates
        return buckets + torch.where(a < max_exact, a, large)


class T5SelfAttention(nn.Module):
    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.norm1 = T5LayerNorm(cfg.dim, cfg.eps)
        self.attn = T5Attention(cfg.dim, cfg.dim_attn, cfg.num_heads)
        self.norm2 = T5LayerNorm(cfg.dim, cfg.eps)
        self.ffn = T5FeedForward(cfg.dim, cfg.dim_ffn)
        self.pos_embedding = None if cfg.shared_pos else T5RelativeEmbedding(cfg.num_buckets, cfg.num_heads,
                                                                               cfg.max_dist)  # fmt: skip

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos_bias: torch.Tensor | None) -> torch.Tensor:
        if self.pos_embedding is not None:
            pos_bias = self.pos_embedding(x.shape[1], x.shape[1])
        assert pos_bias is not None, "shared_pos needs the encoder's shared bias"
        x = _fp16_clamp(x + self.attn(self.norm1(x), mask, pos_bias))
        return _fp16_clamp(x + self.ffn(self.norm2(x)))


def _fp16_clamp(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float16 and torch.isinf(x).any():
        limit = torch.finfo(x.dtype).max - 1000
        x = x.clamp(-limit, limit)
    return x


class T5Encoder(nn.Module):
    """umT5 encoder: ``ids [B, L]`` int64 + ``mask [B, L]`` -> ``[B, L, dim]``."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.token_embedding = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos_embedding = (T5RelativeEmbedding(cfg.num_buckets, cfg.num_heads, cfg.max_dist)
                              if cfg.shared_pos else None)  # fmt: skip
        self.blocks = nn.ModuleList(T5SelfAttention(cfg) for _ in range(cfg.num_layers))
        self.norm = T5LayerNorm(cfg.dim, cfg.eps)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        assert ids.dim() == 2 and ids.shape == mask.shape, "ids and mask must both be [B, L]"
        assert int(ids.max()) < self.cfg.vocab, f"token id {int(ids.max())} outside vocab {self.cfg.vocab}"
        x = self.token_embedding(ids)  # [B, L, dim]
        shared = self.pos_embedding(ids.shape[1], ids.shape[1]) if self.pos_embedding is not None else None
        for block in self.blocks:
            x = block(x, mask, shared)
        return self.norm(x)

    @torch.no_grad()
    def context(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """What the DiT receives for one prompt: the first ``L = sum(mask)`` rows, ``[L, dim]``."""
        assert ids.dim() == 1, "context() takes one prompt: ids [T]"
        length = int(mask.sum())
        return self.forward(ids[None], mask[None])[0, :length]
