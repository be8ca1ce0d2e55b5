"""The DiT's sizes and streaming settings (``DiTConfig``) and its named presets, torch-free: the config checks
(``runtime.config``) read the presets' heads and KV windows without importing the network (``models.dit``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

CONTROL_CHANNELS = 6  # Plücker ray origin + direction per pixel
VAE_SPATIAL_STRIDE = 8  # pixels per latent pixel along each axis


@dataclass(frozen=True)
class KVPolicy:
    """What a session's KV window does when a new chunk does not fit, as far as the config checks and the session
    length need it (torch-free); the cache (``models.kv_cache.KVCache``) asks it the same questions."""

    name: str
    evicts: bool  # the oldest non-sink frames leave for a new chunk; False: nothing leaves, the window caps a session

    def check(self, window: int, sink: int, chunk: int) -> None:
        """The window/sink rule, the one place it is checked (``AssertionError`` like DiTConfig's other checks)."""
        assert 0 <= sink < window, "sink must be smaller than the window"
        assert chunk <= window - sink, "a chunk must fit the window beside the sink"

    def max_chunks(self, window: int, chunk: int) -> int | None:
        """Chunks a session can run: unbounded when frames leave, what the window holds when none does."""
        return None if self.evicts else window // chunk


# The selectable policies by name (``DiTConfig.kv_policy``): ``rolling`` evicts the oldest non-sink frames (the
# sink frames stay forever); ``full`` is the official v1 cache, where nothing leaves and the window caps the session.
KV_POLICIES: dict[str, KVPolicy] = {policy.name: policy for policy in (KVPolicy("rolling", evicts=True),
                                                                       KVPolicy("full", evicts=False))}  # fmt: skip


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
    kv_policy: str = "rolling"  # a name of KV_POLICIES: what the window does when a new chunk does not fit
    compile: str = "off"  # "off" | "blocks" | "graphs" (models/compiled.py)
    fused_qkv: bool = False  # self-attention q, k, v as one [d, 3d] GEMM (SelfAttention.set_fused_qkv)
    overlap_all_to_all: bool = False  # Ulysses exchanges in head groups, overlapped with attention (attend_overlapped)

    def __post_init__(self) -> None:
        assert self.dim % self.num_heads == 0, f"dim {self.dim} not divisible by num_heads {self.num_heads}"
        assert self.head_dim % 2 == 0, f"head_dim {self.head_dim} must be even for RoPE"
        assert tuple(self.patch_size) == (1, 2, 2), "only the released 1x2x2 patch is supported"
        assert self.kv_policy in KV_POLICIES, f"kv_policy is one of {sorted(KV_POLICIES)}, not {self.kv_policy!r}"
        self.policy.check(self.kv_window, self.kv_sink, self.chunk_size)
        assert self.compile in ("off", "blocks", "graphs"), f"compile is off, blocks or graphs, not {self.compile!r}"

    @property
    def policy(self) -> KVPolicy:
        return KV_POLICIES[self.kv_policy]

    @property
    def max_chunks(self) -> int | None:
        """Chunks a session can run (the policy decides)."""
        return self.policy.max_chunks(self.kv_window, self.chunk_size)

    def with_kv_window(self, kv_window: int | str, kv_sink: int, full_frames: int, **settings: object) -> DiTConfig:
        """This config with the window, sink and policy the ``[model]`` keys select, and the other ``settings``
        (the chunk size among them), checked once: ``kv_window`` "full" (the whole clip of ``full_frames`` latent
        frames stays, no sink), a number of latent frames or "preset" (both rolling); ``kv_sink`` -1: this config's
        sink. ``ValueError`` names the keys when the result breaks a rule."""
        policy, window, sink = "rolling", self.kv_window, self.kv_sink
        if kv_window == "full":
            if kv_sink != -1:
                raise ValueError("model.kv_window = 'full' keeps every frame and has no sink; drop kv_sink")
            policy, window, sink = "full", full_frames, 0
        elif isinstance(kv_window, int):
            window = kv_window
        if policy == "rolling" and kv_sink >= 0:
            sink = kv_sink
        try:
            return replace(self, kv_window=window, kv_sink=sink, kv_policy=policy, **settings)  # type: ignore[arg-type]
        except AssertionError as error:
            chunk = settings.get("chunk_size", self.chunk_size)
            keys = "model.kv_full_frames" if kv_window == "full" else "model.kv_sink"
            raise ValueError(f"a KV window of {window} latent frames with {sink} sink frames cannot hold a chunk of "
                             f"{chunk} beside the sink (model.kv_window, {keys}): {error}") from None

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
