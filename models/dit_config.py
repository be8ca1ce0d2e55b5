"""The DiT's sizes and streaming settings (``DiTConfig``) and its named presets, torch-free: the config checks
(``runtime.config``) read the presets' heads and KV windows without importing the network (``models.dit``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

CONTROL_CHANNELS = 6  # Plücker ray origin + direction per pixel
VAE_SPATIAL_STRIDE = 8  # pixels per latent pixel along each axis


@dataclass(frozen=True)
class DiTConfig:
    """Sizes of the DiT and the streaming settings it runs with (``ModelArgs`` of gpt-fast)."""

    dim: int = 5120  # model width d
    ffn_dim: int = 13824  # hidden width of the block MLP
    freq_dim: int = 256  # width of the sinusoidal timestep embedding
    text_dim: int = 4096  # width of the umT5 context
    text_len: int = 512  # context rows after zero padding (the padded rows are attended)
    in_dim: int = 36  # 16 noisy latent + 4 mask + 16 image latent channels
    out_dim: int = 16  # latent channels predicted
    num_heads: int = 40
    num_layers: int = 40
    patch_size: tuple[int, int, int] = (1, 2, 2)
    eps: float = 1e-6
    chunk_size: int = 3  # latent frames per chunk (cs)
    kv_window: int = 18  # KV window in latent frames (sinks included)
    kv_sink: int = 6  # first latent frames of the stream that are never evicted
    shift: float = 10.0  # flow-matching schedule shift
    num_train_timesteps: int = 1000
    timestep_indices: tuple[int, ...] = (0, 179, 358, 679)  # schedule indices of the denoising steps
    attention: str = "auto"  # "auto" | "sdpa" | "sage"
    rope_positions: int = 1024  # time positions of the reference RoPE table (see models/rope.py)
    kv_eviction: bool = True  # False: the official v1 "full" cache: nothing leaves, the window caps the session
    compile: str = "off"  # "off" | "blocks" | "graphs" (models/compiled.py)
    fused_qkv: bool = False  # self-attention q, k, v as one [d, 3d] GEMM (SelfAttention.set_fused_qkv)
    overlap_all_to_all: bool = False  # Ulysses exchanges in head groups, overlapped with attention (attend_overlapped)

    def __post_init__(self) -> None:
        assert self.dim % self.num_heads == 0, f"dim {self.dim} not divisible by num_heads {self.num_heads}"
        assert self.head_dim % 2 == 0, f"head_dim {self.head_dim} must be even for RoPE"
        assert tuple(self.patch_size) == (1, 2, 2), "only the released 1x2x2 patch is supported"
        assert 0 <= self.kv_sink < self.kv_window, "sink must be smaller than the window"
        assert self.chunk_size <= self.kv_window - self.kv_sink, "a chunk must fit the window beside the sink"
        assert self.compile in ("off", "blocks", "graphs"), f"compile is off, blocks or graphs, not {self.compile!r}"

    @property
    def max_chunks(self) -> int | None:
        """Chunks a session can run: unbounded with a rolling window, what the window holds without eviction."""
        return None if self.kv_eviction else self.kv_window // self.chunk_size

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def control_features(self) -> int:
        """Camera features per token: 6 ray channels x 8x8 pixels x 1x2x2 patch = 1536."""
        return CONTROL_CHANNELS * VAE_SPATIAL_STRIDE**2 * math.prod(self.patch_size)

    @classmethod
    def from_name(cls, name: str, **overrides: object) -> DiTConfig:
        if name not in PRESETS:
            raise KeyError(f"unknown DiT preset {name!r}; known: {sorted(PRESETS)}")
        return replace(PRESETS[name], **overrides)  # type: ignore[arg-type]


# The fields a checkpoint's config.json decides (the architecture). Everything else (chunk size, schedule, window,
# sink, attention kernel) is a streaming setting that comes from the preset and the config file.
ARCH_FIELDS = ("dim", "ffn_dim", "freq_dim", "text_dim", "text_len", "in_dim", "out_dim", "num_heads", "num_layers",
               "patch_size", "eps")

PRESETS: dict[str, DiTConfig] = {
    # Full size (Wan2.2-I2V-A14B expert + camera). v1: chunk 3, indices 0/179/358/679; v2: chunk 4, 0/250/500/750.
    # Window and sink: v2's official run-time values are 18 + 6. The official v1 keeps the whole clip (no eviction,
    # "full"); 18 + 6 for v1 is our streaming choice for unbounded sessions (``model.kv_window`` selects).
    "lingbot-world-fast-v1": DiTConfig(),
    "lingbot-world-fast-v2": DiTConfig(chunk_size=4, timestep_indices=(0, 250, 500, 750)),
    # Tiny presets for tests and CPU demos (heads divisible by 5 for the 5-rank DiT group).
    "tiny": DiTConfig(
        dim=60, ffn_dim=120, text_dim=32, text_len=16, num_heads=5, num_layers=2, kv_window=8, kv_sink=2
    ),
    "small": DiTConfig(
        dim=320, ffn_dim=640, text_dim=64, text_len=32, num_heads=10, num_layers=4, kv_window=8, kv_sink=2
    ),
}

# ``model.preset`` (``[model]``) -> the DiT preset it runs
MODEL_PRESETS = {"tiny": "tiny", "small": "small", "v1": "lingbot-world-fast-v1", "v2": "lingbot-world-fast-v2"}
