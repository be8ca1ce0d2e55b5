"""Per-session streaming encode (condition) and decode (frames) on top of ``models.vae``.

A stream is cut into chunks of ``cs`` latent frames. Chunk 0 covers ``1 + 4(cs-1)`` video frames, every later
chunk ``4cs``. Each session owns one ``TemporalCache``, so chunk-by-chunk processing equals processing the
whole clip at once (the per-layer causal state carries across chunks), and sessions never share state.

Condition encoding has a shortcut. The conditioning video is ``[image, black, black, ...]``: after chunk 0
every chunk's input is identical (all black), so the encoder is a fixed map ``state -> (state', latent)`` applied
to the same input. Once the state after a black chunk equals, bit for bit, the state after the previous black
chunk, the map has reached a fixed point: every later chunk would reproduce the same state and the same latent.
From then on the session returns the stored latent chunk and drops the cache, so an endless session costs
O(1) time and memory per chunk, and the result is identical to encoding on (not an approximation).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

import torch

from models.vae import TemporalCache, WanVAE

T = TypeVar("T")


def video_frames_in_chunk(index: int, chunk_latent_frames: int, temporal_stride: int = 4) -> int:
    """Video frames covered by latent chunk ``index`` (the stream's first latent frame covers one frame)."""
    cs = chunk_latent_frames
    return 1 + temporal_stride * (cs - 1) if index == 0 else temporal_stride * cs


def _split_latent(length: int, limit: int | None) -> Iterator[tuple[int, int]]:
    step = length if limit is None else max(1, limit)
    for start in range(0, length, step):
        yield start, min(length, start + step)


def _snapshot(obj: object) -> object:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_snapshot(v) for v in obj]
    if isinstance(obj, TemporalCache):
        return TemporalCache(slots=[_snapshot(s) for s in obj.slots])
    return obj


def _same_state(a: object, b: object) -> bool:
    """Bitwise equality of two cache states (tensors compared with ``torch.equal``)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    if isinstance(a, TemporalCache) and isinstance(b, TemporalCache):
        return _same_state(a.slots, b.slots)
    return a == b


class ConditionEncoder:
    """Streaming VAE encoding of ``[image, black frames ...]`` for one session, chunk by chunk.

    ``next_chunk()`` returns the normalised latent ``[z, cs, h, w]`` of the next chunk; the concatenation of all
    chunks equals ``vae.encode`` of the whole conditioning video.
    """

    def __init__(self, vae: WanVAE, image: torch.Tensor, chunk_latent_frames: int, *,
                 constant_tail: bool = True, max_latent_frames_per_call: int | None = None) -> None:  # fmt: skip
        assert image.dim() == 3 and image.shape[0] == 3, f"image must be [3, H, W] in [-1, 1], got {image.shape}"
        assert chunk_latent_frames >= 1
        self.vae = vae
        self.cs = chunk_latent_frames
        self.constant_tail = constant_tail
        self.max_latent_frames_per_call = max_latent_frames_per_call
        self.index = 0  # next chunk to encode
        self.encoder_calls = 0  # chunks actually run through the encoder (for tests and metrics)
        self._image: torch.Tensor | None = image  # dropped after chunk 0
        self._frame_shape = tuple(image.shape)
        self._cache: TemporalCache | None = TemporalCache()
        self._previous_state: TemporalCache | None = None  # state after the previous all-black chunk
        self._tail: torch.Tensor | None = None  # the repeating latent chunk once the fixed point is reached

    @property
    def frozen(self) -> bool:
        """True once the constant tail was detected; no further encoder work or cache is held."""
        return self._tail is not None

    @torch.no_grad()
    def next_chunk(self) -> torch.Tensor:
        if self._tail is not None:
            self.index += 1
            return self._tail.clone()
        assert self._cache is not None
        video = self._chunk_video(self.index)  # [1, 3, Tv, H, W]
        pieces = []
        # Split on latent-frame boundaries: video frames [0], [1..4], ... of this chunk.
        first = 1 if self.index == 0 else 0
        stride = self.vae.cfg.temporal_stride
        for a, b in _split_latent(self.cs, self.max_latent_frames_per_call):
            lo = 0 if a == 0 else first + stride * (a - first)
            hi = first + stride * (b - first)
            pieces.append(self.vae.encode(video[:, :, lo:hi], self._cache))
        latent = torch.cat(pieces, 2)[0]  # [z, cs, h, w]
        assert latent.shape[1] == self.cs, f"chunk {self.index} encoded to {latent.shape[1]} latent frames"
        self.encoder_calls += 1
        if self.index == 0:
            self._image = None
        elif self.constant_tail:
            self._check_fixed_point(latent)
        self.index += 1
        return latent

    def _chunk_video(self, index: int) -> torch.Tensor:
        c, h, w = self._frame_shape
        frames = video_frames_in_chunk(index, self.cs, self.vae.cfg.temporal_stride)
        p = next(self.vae.parameters())
        video = torch.zeros(1, c, frames, h, w, dtype=p.dtype, device=p.device)
        if index == 0:
            assert self._image is not None
            video[0, :, 0] = self._image.to(video)
        return video

    def _check_fixed_point(self, latent: torch.Tensor) -> None:
        assert self._cache is not None
        if self._previous_state is not None and _same_state(self._cache, self._previous_state):
            self._tail = latent.clone()
            self._cache = self._previous_state = None  # bounded memory from here on
            return
        self._previous_state = _snapshot(self._cache)  # type: ignore[assignment]

    def state(self) -> dict[str, object]:
        """Everything the next chunks depend on (``models.state_tree`` holds it as tensors)."""
        return {"index": self.index, "calls": self.encoder_calls, "image": self._image,
                "frame_shape": torch.tensor(self._frame_shape, dtype=torch.int64), "cache": self._cache,
                "previous": self._previous_state, "tail": self._tail}

    @classmethod
    def restored(cls, vae: WanVAE, chunk_latent_frames: int, state: dict[str, object], *, constant_tail: bool = True,
                 max_latent_frames_per_call: int | None = None) -> ConditionEncoder:  # fmt: skip
        """The encoder ``state()`` described, continuing at its next chunk."""
        shape = state["frame_shape"]
        assert isinstance(shape, torch.Tensor)
        enc = cls(vae, torch.zeros(tuple(int(v) for v in shape.tolist())), chunk_latent_frames,
                  constant_tail=constant_tail, max_latent_frames_per_call=max_latent_frames_per_call)
        enc.index, enc.encoder_calls = int(state["index"]), int(state["calls"])  # type: ignore[call-overload]
        enc._image, enc._cache = state["image"], state["cache"]  # type: ignore[assignment]
        enc._previous_state, enc._tail = state["previous"], state["tail"]  # type: ignore[assignment]
        return enc

    def nbytes(self) -> int:
        """Bytes held by this session (cache, snapshot, stored tail)."""
        total = sum(c.nbytes() for c in (self._cache, self._previous_state) if c is not None)
        for t in (self._tail, self._image):
            if t is not None:
                total += t.numel() * t.element_size()
        return total


class FrameDecoder:
    """Streaming VAE decoding for one session: chunk latents in order -> frames in [-1, 1]."""

    def __init__(self, vae: WanVAE, *, max_latent_frames_per_call: int | None = None) -> None:
        self.vae = vae
        self.max_latent_frames_per_call = max_latent_frames_per_call
        self.cache = TemporalCache()
        self.index = 0  # next chunk expected

    @torch.no_grad()
    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        """``latent [z, cs, h, w]`` -> frames ``[3, n, H, W]`` with n = 1+4(cs-1) for chunk 0, 4cs after."""
        z_dim = self.vae.cfg.z_dim
        assert latent.dim() == 4 and latent.shape[0] == z_dim, f"latent must be [{z_dim}, cs, h, w]: {latent.shape}"
        p = next(self.vae.parameters())
        z = latent.to(device=p.device, dtype=p.dtype)[None]  # [1, z, cs, h, w]
        spans = _split_latent(z.shape[2], self.max_latent_frames_per_call)
        pieces = [self.vae.decode(z[:, :, a:b], self.cache) for a, b in spans]
        self.index += 1
        return torch.cat(pieces, 2)[0]

    def state(self) -> dict[str, object]:
        return {"index": self.index, "cache": self.cache}

    def load(self, state: dict[str, object]) -> None:
        """Continue the stream ``state()`` described."""
        cache = state["cache"]
        assert isinstance(cache, TemporalCache), "the decoder state holds no cache"
        self.index, self.cache = int(state["index"]), cache  # type: ignore[call-overload]

    def nbytes(self) -> int:
        return self.cache.nbytes()


def frames_to_uint8(frames: torch.Tensor) -> torch.Tensor:
    """``[3, n, H, W]`` in [-1, 1] -> uint8 ``[n, H, W, 3]`` on the frames' device (the tensor plane sends it
    from there; only the receiving side copies to the host): ``round((clamp(x) + 1) / 2 * 255)``."""
    assert frames.dim() == 4 and frames.shape[0] == 3, f"frames must be [3, n, H, W], got {tuple(frames.shape)}"
    x = (frames.float().clamp(-1.0, 1.0) + 1.0) / 2.0 * 255.0
    return x.round().to(torch.uint8).permute(1, 2, 3, 0).contiguous()


def image_from_uint8(image: torch.Tensor) -> torch.Tensor:
    """uint8 ``[H, W, 3]`` -> float32 ``[3, H, W]`` in [-1, 1] (``(u8/255 - 0.5)/0.5``)."""
    assert image.dtype == torch.uint8 and image.dim() == 3 and image.shape[2] == 3, "image must be uint8 [H, W, 3]"
    return (image.permute(2, 0, 1).float() / 255.0 - 0.5) / 0.5


class SessionTable(Generic[T]):
    """Per-session state keyed by session id; ``release`` is idempotent and drops every reference."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def open(self, session: str, make: Callable[[], T]) -> T:
        if session in self._items:
            raise KeyError(f"{self.kind} session {session!r} is already open")
        self._items[session] = item = make()
        return item

    def get(self, session: str) -> T:
        try:
            return self._items[session]
        except KeyError:
            raise KeyError(f"{self.kind} session {session!r} is not open (open: {sorted(self._items)})") from None

    def release(self, session: str) -> None:
        self._items.pop(session, None)

    def __contains__(self, session: object) -> bool:
        return session in self._items

    def values(self) -> list[T]:
        return list(self._items.values())

    def __len__(self) -> int:
        return len(self._items)
