"""Wan2.1 causal video VAE (stride 4x8x8, 16 latent channels) with a per-layer temporal cache.

Module and parameter names follow the official ``WanVAE_`` state dict (``encoder.conv1.weight``,
``decoder.upsamples.N.time_conv.weight``, ``conv1.weight``, ``conv2.weight``, ...), so checkpoints load
without renaming.

Causality is expressed through a ``TemporalCache``: every layer that mixes frames in time owns one slot, and
the slots are visited in a fixed order on every call. Feeding a clip in pieces with one persistent cache
computes the same function as feeding it at once (up to float evaluation order):

- ``CausalConv3d`` (temporal kernel 3): the slot keeps the last two input frames (zeros before the stream).
- ``downsample3d``: the first frame of the stream passes through; later frames are paired with the previous
  frame and reduced by a stride-2 temporal convolution (frames ``2j-2, 2j-1, 2j`` give output ``j``).
- ``upsample3d``: the first frame of the stream passes through; every later frame becomes two frames via a
  causal temporal convolution over the later frames only (two zero frames before the second frame).

Per-frame layers (RMS norm, SiLU, attention, 2-D resampling) need no state.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

WAN21_LATENT_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                     0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)  # fmt: skip
WAN21_LATENT_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)  # fmt: skip


@dataclass(frozen=True)
class VAEConfig:
    """Constructor arguments of ``WanVAE_`` plus the latent normalisation constants."""

    dim: int = 96  # base width of encoder and decoder
    z_dim: int = 16  # latent channels
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)  # width multipliers per stage
    num_res_blocks: int = 2  # residual blocks per encoder stage (decoder: one more)
    attn_scales: tuple[float, ...] = ()  # spatial scales with an attention block inside the stages
    temperal_downsample: tuple[bool, ...] = (False, True, True)  # (sic, official spelling) per stage
    latent_mean: tuple[float, ...] = WAN21_LATENT_MEAN
    latent_std: tuple[float, ...] = WAN21_LATENT_STD

    def __post_init__(self) -> None:
        assert len(self.temperal_downsample) == len(self.dim_mult) - 1, "one temporal flag per downsample"
        assert len(self.latent_mean) == len(self.latent_std) == self.z_dim, "one mean/std per latent channel"

    @property
    def temporal_stride(self) -> int:
        return 2 ** sum(self.temperal_downsample)

    @property
    def spatial_stride(self) -> int:
        return 2 ** (len(self.dim_mult) - 1)

    @classmethod
    def preset(cls, name: str) -> VAEConfig:
        """``wan2.1`` (the real model, Wan2.1_VAE.pth), ``small`` and ``tiny`` (random-weight tests)."""
        presets = {
            "wan2.1": cls(),
            "small": cls(dim=32),
            "tiny": cls(dim=4),
        }
        if name not in presets:
            raise KeyError(f"unknown VAE preset {name!r}; valid: {sorted(presets)}")
        return presets[name]

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor]) -> VAEConfig:
        """The constructor arguments of an official ``WanVAE_`` state dict, read from its encoder's structure:
        residual blocks, attention blocks and resamples in order (a resample closes a stage, ``time_conv`` marks a
        temporal one). The normalisation constants are Wan2.1's (they are not in the file)."""
        try:
            dim = int(state["encoder.conv1.weight"].shape[0])
            z_dim = int(state["conv2.weight"].shape[0])
            count = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("encoder.downsamples."))
            stages: list[list[str]] = [[]]
            mult, temporal, attn = [], [], []
            for i in range(count):
                prefix = f"encoder.downsamples.{i}."
                if prefix + "resample.1.weight" in state:
                    temporal.append(prefix + "time_conv.weight" in state)
                    stages.append([])
                elif prefix + "to_qkv.weight" in state:
                    attn.append(1.0 / 2 ** (len(stages) - 1))
                else:
                    stages[-1].append(prefix)
            for blocks in stages:
                mult.append(int(state[blocks[0] + "residual.2.weight"].shape[0]) // dim)
            return cls(dim=dim, z_dim=z_dim, dim_mult=tuple(mult), num_res_blocks=len(stages[0]),
                       attn_scales=tuple(sorted(set(attn))), temperal_downsample=tuple(temporal))  # fmt: skip
        except (KeyError, ValueError, IndexError, AssertionError) as error:
            raise ValueError(f"not a Wan2.1 VAE state dict (missing or odd {error})") from None

    @classmethod
    def from_fixture(cls, vae_section: dict[str, Any]) -> VAEConfig:
        """Build from the ``vae`` section of a golden fixture ``config.json``."""
        c = vae_section["constructor"]
        return cls(
            dim=int(c["dim"]),
            z_dim=int(c["z_dim"]),
            dim_mult=tuple(int(m) for m in c["dim_mult"]),
            num_res_blocks=int(c["num_res_blocks"]),
            attn_scales=tuple(float(s) for s in c["attn_scales"]),
            temperal_downsample=tuple(bool(t) for t in c["temperal_downsample"]),
            latent_mean=tuple(float(m) for m in vae_section["latent_mean"]),
            latent_std=tuple(float(s) for s in vae_section["latent_std"]),
        )


@dataclass
class TemporalCache:
    """Causal state of one stream through an encoder or a decoder: one slot per temporal layer.

    ``begin()`` rewinds the cursor before each call; layers ``claim()`` their slot in a fixed order.
    """

    slots: list[Any] = field(default_factory=list)
    cursor: int = 0

    def begin(self) -> None:
        self.cursor = 0

    def claim(self) -> int:
        if self.cursor == len(self.slots):
            self.slots.append(None)
        idx = self.cursor
        self.cursor += 1
        return idx

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in _tensors(self.slots))


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


class CausalConv3d(nn.Conv3d):
    """Conv3d with spatial zero padding p and temporal padding 2p in front only (from the cache if given)."""

    def __init__(self, in_dim: int, out_dim: int, kernel: int | tuple[int, int, int], padding: int | tuple = 0,
                 stride: int | tuple[int, int, int] = 1) -> None:  # fmt: skip
        super().__init__(in_dim, out_dim, kernel, stride=stride, padding=0)
        pt, ph, pw = (padding,) * 3 if isinstance(padding, int) else padding
        self.spatial_pad = (pw, pw, ph, ph)
        self.history = 2 * pt  # frames of history the temporal kernel needs

    def forward(self, x: torch.Tensor, cache: TemporalCache | None = None) -> torch.Tensor:
        # x: [B, C, T, H, W]
        if self.history == 0:
            return super().forward(F.pad(x, self.spatial_pad))
        if cache is None:
            past = x.new_zeros(*x.shape[:2], self.history, *x.shape[3:])
            return super().forward(F.pad(torch.cat([past, x], 2), self.spatial_pad))
        idx = cache.claim()
        past = cache.slots[idx]
        if past is None:
            past = x.new_zeros(*x.shape[:2], self.history, *x.shape[3:])
        full = torch.cat([past, x], 2)  # [B, C, history + T, H, W]
        cache.slots[idx] = full[:, :, -self.history :].clone()
        return super().forward(F.pad(full, self.spatial_pad))


class RMS_norm(nn.Module):  # official name
    """L2 normalisation over channels times sqrt(C) times a per-channel gain."""

    def __init__(self, dim: int, images: bool = True) -> None:
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones((dim, 1, 1) if images else (dim, 1, 1, 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=1) * self.scale * self.gamma


class ResidualBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.residual = nn.Sequential(
            RMS_norm(in_dim, images=False), nn.SiLU(), CausalConv3d(in_dim, out_dim, 3, padding=1),
            RMS_norm(out_dim, images=False), nn.SiLU(), nn.Identity(), CausalConv3d(out_dim, out_dim, 3, padding=1),
        )  # fmt: skip  (index 5 is the official dropout slot)
        self.shortcut = CausalConv3d(in_dim, out_dim, 1) if in_dim != out_dim else nn.Identity()

    def forward(self, x: torch.Tensor, cache: TemporalCache | None = None) -> torch.Tensor:
        h = self.shortcut(x)
        for layer in self.residual:
            x = layer(x, cache) if isinstance(layer, CausalConv3d) else layer(x)
        return x + h


class AttentionBlock(nn.Module):
    """Single-head self-attention over the h*w positions of each frame."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMS_norm(dim)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor, cache: TemporalCache | None = None) -> torch.Tensor:
        b, c, t, h, w = x.shape
        frames = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
        qkv = self.to_qkv(self.norm(frames))  # [bt, 3c, h, w]
        # contiguous before the split (as the reference does): q/k/v then have a unit last stride, which every fused
        # SDPA kernel requires; a transposed view sends the call to the float32-accumulating math path.
        q, k, v = qkv.reshape(b * t, 1, 3 * c, h * w).transpose(-1, -2).contiguous().chunk(3, dim=-1)  # [bt, 1, hw, c]
        out = F.scaled_dot_product_attention(q, k, v)  # [bt, 1, hw, c]
        out = self.proj(out.squeeze(1).transpose(1, 2).reshape(b * t, c, h, w))
        return out.reshape(b, t, c, h, w).permute(0, 2, 1, 3, 4) + x


class Resample(nn.Module):
    """Spatial (and optionally temporal) down/upsampling: ``{up,down}sample{2d,3d}``."""

    def __init__(self, dim: int, mode: str) -> None:
        super().__init__()
        self.mode = mode
        if mode.startswith("upsample"):
            self.resample = nn.Sequential(nn.Upsample(scale_factor=(2.0, 2.0), mode="nearest-exact"),
                                          nn.Conv2d(dim, dim // 2, 3, padding=1))  # fmt: skip
            if mode == "upsample3d":
                self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1), padding=(1, 0, 0))
        elif mode.startswith("downsample"):
            self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(dim, dim, 3, stride=(2, 2)))
            if mode == "downsample3d":
                self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1))
        else:
            raise ValueError(f"unknown resample mode {mode!r}")

    def _spatial(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        y = self.resample(x.transpose(1, 2).reshape(b * t, c, h, w))  # [bt, c', h', w']
        return y.reshape(b, t, *y.shape[1:]).transpose(1, 2)

    def forward(self, x: torch.Tensor, cache: TemporalCache | None = None) -> torch.Tensor:
        if self.mode == "upsample3d":
            x = self._upsample_time(x, cache)
        x = self._spatial(x)
        if self.mode == "downsample3d":
            x = self._downsample_time(x, cache)
        return x

    def _upsample_time(self, x: torch.Tensor, cache: TemporalCache | None) -> torch.Tensor:
        # slot: {"started": bool, "conv": TemporalCache of the time conv}
        state = _state_slot(cache, lambda: {"started": False, "conv": TemporalCache()})
        head = x[:, :, :0]
        if not state["started"]:
            head, x = x[:, :, :1], x[:, :, 1:]  # the stream's first frame stays one frame
            state["started"] = True
        if x.shape[2] == 0:
            return head
        b, c, t, h, w = x.shape
        state["conv"].begin()
        y = self.time_conv(x, state["conv"])  # [B, 2C, T, H, W]
        y = y.reshape(b, 2, c, t, h, w).permute(0, 2, 3, 1, 4, 5).reshape(b, c, 2 * t, h, w)
        return torch.cat([head, y], 2)

    def _downsample_time(self, x: torch.Tensor, cache: TemporalCache | None) -> torch.Tensor:
        # slot: {"last": last frame seen (after the spatial downsample) or None before the stream starts}
        state = _state_slot(cache, lambda: {"last": None})
        head = x[:, :, :0]
        if state["last"] is None:
            head, state["last"] = x[:, :, :1], x[:, :, :1]  # the stream's first frame passes
            x = x[:, :, 1:]
        if x.shape[2] == 0:
            return head
        assert x.shape[2] % 2 == 0, f"downsample3d needs an even number of frames after the first, got {x.shape[2]}"
        y = self.time_conv(torch.cat([state["last"], x], 2))  # frames 2j-2, 2j-1, 2j -> j
        state["last"] = x[:, :, -1:].clone()
        return torch.cat([head, y], 2)


def _state_slot(cache: TemporalCache | None, make: Any) -> dict[str, Any]:
    if cache is None:
        return make()  # a whole clip in one call: a fresh state that is dropped afterwards
    idx = cache.claim()
    if cache.slots[idx] is None:
        cache.slots[idx] = make()
    return cache.slots[idx]


def _run(layers: nn.Sequential, x: torch.Tensor, cache: TemporalCache | None) -> torch.Tensor:
    for layer in layers:
        if isinstance(layer, (CausalConv3d, ResidualBlock, AttentionBlock, Resample)):
            x = layer(x, cache)
        else:
            x = layer(x)
    return x


class Encoder3d(nn.Module):
    def __init__(self, cfg: VAEConfig, out_dim: int) -> None:
        super().__init__()
        dims = [cfg.dim * u for u in (1, *cfg.dim_mult)]
        scale = 1.0
        self.conv1 = CausalConv3d(3, dims[0], 3, padding=1)
        blocks: list[nn.Module] = []
        for i, (din, dout) in enumerate(itertools.pairwise(dims)):
            for _ in range(cfg.num_res_blocks):
                blocks.append(ResidualBlock(din, dout))
                if scale in cfg.attn_scales:
                    blocks.append(AttentionBlock(dout))
                din = dout
            if i != len(cfg.dim_mult) - 1:
                blocks.append(Resample(dout, "downsample3d" if cfg.temperal_downsample[i] else "downsample2d"))
                scale /= 2.0
        self.downsamples = nn.Sequential(*blocks)
        d = dims[-1]
        self.middle = nn.Sequential(ResidualBlock(d, d), AttentionBlock(d), ResidualBlock(d, d))
        self.head = nn.Sequential(RMS_norm(d, images=False), nn.SiLU(), CausalConv3d(d, out_dim, 3, padding=1))

    def forward(self, x: torch.Tensor, cache: TemporalCache | None = None) -> torch.Tensor:
        x = self.conv1(x, cache)
        for part in (self.downsamples, self.middle, self.head):
            x = _run(part, x, cache)
        return x


class Decoder3d(nn.Module):
    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        dims = [cfg.dim * u for u in (cfg.dim_mult[-1], *reversed(cfg.dim_mult))]
        temperal_upsample = tuple(reversed(cfg.temperal_downsample))
        scale = 1.0 / 2 ** (len(cfg.dim_mult) - 2)
        self.conv1 = CausalConv3d(cfg.z_dim, dims[0], 3, padding=1)
        self.middle = nn.Sequential(ResidualBlock(dims[0], dims[0]), AttentionBlock(dims[0]),
                                    ResidualBlock(dims[0], dims[0]))  # fmt: skip
        blocks: list[nn.Module] = []
        for i, (din, dout) in enumerate(itertools.pairwise(dims)):
            if i > 0:
                din = din // 2  # the previous stage's upsample conv halved the channels
            for _ in range(cfg.num_res_blocks + 1):
                blocks.append(ResidualBlock(din, dout))
                if scale in cfg.attn_scales:
                    blocks.append(AttentionBlock(dout))
                din = dout
            if i != len(cfg.dim_mult) - 1:
                blocks.append(Resample(dout, "upsample3d" if temperal_upsample[i] else "upsample2d"))
                scale *= 2.0
        self.upsamples = nn.Sequential(*blocks)
        d = dims[-1]
        self.head = nn.Sequential(RMS_norm(d, images=False), nn.SiLU(), CausalConv3d(d, 3, 3, padding=1))

    def forward(self, x: torch.Tensor, cache: TemporalCache | None = None) -> torch.Tensor:
        x = self.conv1(x, cache)
        for part in (self.middle, self.upsamples, self.head):
            x = _run(part, x, cache)
        return x


class WanVAE(nn.Module):
    """The Wan2.1 VAE (official name ``WanVAE_``): encoder, decoder and the two latent 1x1x1 convs.

    ``encode``/``decode`` work on normalised latents. Without a cache they process a whole clip starting at
    frame 0; with a ``TemporalCache`` they continue the stream that cache belongs to.
    """

    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder3d(cfg, cfg.z_dim * 2)
        self.conv1 = CausalConv3d(cfg.z_dim * 2, cfg.z_dim * 2, 1)
        self.conv2 = CausalConv3d(cfg.z_dim, cfg.z_dim, 1)
        self.decoder = Decoder3d(cfg)
        self.latent_mean: torch.Tensor
        self.latent_inv_std: torch.Tensor
        self.reset_latent_stats()

    def reset_latent_stats(self) -> None:
        """(Re)build the fixed normalisation buffers from the config, next to the weights (after meta loading)."""
        device = self.conv2.weight.device
        mean = torch.tensor(self.cfg.latent_mean, dtype=torch.float32, device=device)
        inv_std = 1.0 / torch.tensor(self.cfg.latent_std, dtype=torch.float32, device=device)  # float32 reciprocal
        self.register_buffer("latent_mean", mean, persistent=False)
        self.register_buffer("latent_inv_std", inv_std, persistent=False)

    def encode(self, video: torch.Tensor, cache: TemporalCache | None = None) -> torch.Tensor:
        """Normalised latent mean ``[B, z, t, h, w]`` of ``video [B, 3, T, H, W]`` in [-1, 1]."""
        assert video.dim() == 5 and video.shape[1] == 3, f"video must be [B, 3, T, H, W], got {tuple(video.shape)}"
        s = self.cfg.spatial_stride
        assert video.shape[3] % s == 0 and video.shape[4] % s == 0, f"H, W must be multiples of {s}"
        if cache is not None:
            cache.begin()
        mu = self.conv1(self.encoder(video, cache))[:, : self.cfg.z_dim]  # [B, z, t, h, w]
        return (mu - _per_channel(self.latent_mean)) * _per_channel(self.latent_inv_std)

    def decode(self, z: torch.Tensor, cache: TemporalCache | None = None) -> torch.Tensor:
        """Frames ``[B, 3, T, H, W]`` clamped to [-1, 1] from normalised latents ``z [B, z, t, h, w]``."""
        assert z.dim() == 5 and z.shape[1] == self.cfg.z_dim, f"latent must be [B, {self.cfg.z_dim}, t, h, w]"
        if cache is not None:
            cache.begin()
        # un-normalise in float32 (the constants are float32), then back to the weights' dtype (bf16 VAE policy)
        z = (z.float() / _per_channel(self.latent_inv_std) + _per_channel(self.latent_mean)).to(self.conv2.weight.dtype)
        return self.decoder(self.conv2(z), cache).clamp(-1.0, 1.0)


def _per_channel(v: torch.Tensor) -> torch.Tensor:
    return v.view(1, -1, 1, 1, 1)


def decode_flops(cfg: VAEConfig, latent_frames: int, height: int, width: int, first: bool = True) -> float:
    """FLOPs (2 per multiply-accumulate) of decoding ``latent_frames`` latent frames to H x W frames, as the
    first piece of a stream or as a continuation (counted on the meta device: no memory, no compute)."""
    vae = _meta_model(cfg)
    h, w = height // cfg.spatial_stride, width // cfg.spatial_stride
    cache = TemporalCache()
    if not first:  # prime the per-layer state so the layers take their steady-state path
        vae.decode(torch.empty(1, cfg.z_dim, 1, h, w, device="meta"), cache)
    return _count_flops(lambda: vae.decode(torch.empty(1, cfg.z_dim, latent_frames, h, w, device="meta"), cache))


def encode_flops(cfg: VAEConfig, video_frames: int, height: int, width: int, first: bool) -> float:
    """FLOPs of encoding ``video_frames`` frames, as the first piece of a stream or as a continuation."""
    vae = _meta_model(cfg)
    cache = TemporalCache()
    if not first:  # prime the per-layer state so the layers take their steady-state path
        vae.encode(torch.empty(1, 3, 1, height, width, device="meta"), cache)
    return _count_flops(lambda: vae.encode(torch.empty(1, 3, video_frames, height, width, device="meta"), cache))


def _meta_model(cfg: VAEConfig) -> WanVAE:
    with torch.device("meta"):
        return WanVAE(cfg)


def _count_flops(fn: Any) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return float(counter.get_total_flops())



