"""A session's stream geometry without torch: the shapes and frame sizes rank 0 plans with.

The coordinator core (``runtime.core``) announces every tensor from these numbers and never builds one, so it
imports no tensor library; the stages (``models.stages``) and the tensor plane turn the dtype name into a torch
dtype where tensors are made (``ranks.warmup``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ipc.protocol import INTRINSICS_HEIGHT, INTRINSICS_WIDTH


@dataclass(frozen=True)
class StreamGeometry:
    """Shapes and dtypes of everything that travels on the tensor plane for one session."""

    height: int  # video frame height in pixels
    width: int  # video frame width in pixels
    chunk_latent_frames: int  # latent frames per chunk (cs)
    context_shape: tuple[int, ...]  # prompt context handed to the DiT once per session (padded)
    condition_shape: tuple[int, ...]  # one condition chunk
    latent_shape: tuple[int, ...]  # one denoised latent chunk
    dtype: str = "float32"  # of context, condition and latent on the wire: a torch dtype's name
    temporal_stride: int = 4  # video frames per latent frame (the first latent frame gives 1)
    max_chunks: int | None = None  # the model's cap on a session's length (a "full" KV cache); None: unbounded

    def frames_in_chunk(self, index: int) -> int:
        """Video frames decoded from chunk ``index``: the first latent frame of a stream gives 1 frame."""
        cs, stride = self.chunk_latent_frames, self.temporal_stride
        return 1 + stride * (cs - 1) if index == 0 else stride * cs

    def frames_shape(self, index: int) -> tuple[int, int, int, int]:
        return (self.frames_in_chunk(index), self.height, self.width, 3)

    def with_size(self, height: int, width: int) -> StreamGeometry:
        """The same stream at another frame size: the last two dimensions of the condition and latent shapes are
        spatial and keep their stride to the frame (e.g. 8 for the VAE latent). ``ValueError`` when the size does
        not divide by a stride."""
        if (height, width) == (self.height, self.width):
            return self

        def scaled(shape: tuple[int, ...]) -> tuple[int, ...]:
            sh, sw = self.height // shape[-2], self.width // shape[-1]
            assert (shape[-2] * sh, shape[-1] * sw) == (self.height, self.width), f"{shape} is not spatial"
            if height % sh or width % sw:
                raise ValueError(f"frame size {height}x{width} is not a multiple of the stride {sh}x{sw}")
            return (*shape[:-2], height // sh, width // sw)

        return replace(self, height=height, width=width, condition_shape=scaled(self.condition_shape),
                       latent_shape=scaled(self.latent_shape))


def frame_size(image_height: int, image_width: int, max_area: int, stride: int = 8, patch: int = 2) -> tuple[int, int]:
    """The frame size the official pipeline picks for a start image: its aspect ratio at (at most) ``max_area``
    pixels, each latent side floored to a multiple of the patch, computed exactly as the reference does it, in
    floats: ``lat_h = sqrt(max_area * H / W) // stride // patch * patch``, ``h = lat_h * stride`` (``w`` likewise with
    ``W / H``). The float rounding is part of the rule: ``sqrt(399360 * 480 / 832)`` is 479.99999999999994, so a
    480x832 image becomes 464x832, as in the official examples. ``(0, w)`` or ``(h, 0)``: the image is too narrow."""
    if image_height < 1 or image_width < 1 or max_area < 1:
        raise ValueError(f"need a positive image size and area, got {image_height}x{image_width}, {max_area}")
    aspect = image_height / image_width
    lat_h = round(math.sqrt(max_area * aspect) // stride // patch * patch)
    lat_w = round(math.sqrt(max_area / aspect) // stride // patch * patch)
    return lat_h * stride, lat_w * stride


def intrinsics_at(intrinsics: tuple[float, ...], height: int, width: int) -> tuple[float, float, float, float]:
    """``(fx, fy, cx, cy)`` given for 480x832 at ``height x width``: the float32 numbers the rays are computed with
    (``models.camera.scale_intrinsics``, the same float32 products)."""
    row = np.asarray(intrinsics, dtype=np.float32).reshape(-1, 4)[0]
    sx, sy = width / INTRINSICS_WIDTH, height / INTRINSICS_HEIGHT
    fx, fy, cx, cy = (row * np.asarray([sx, sy, sx, sy], dtype=np.float32)).tolist()
    return fx, fy, cx, cy
