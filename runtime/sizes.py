"""The frame sizes a server streams at, known at start-up, and the snapping of a start image to one of them.

Every size a session can have is warmed up on every rank before the port opens (``ranks.warmup``): cuDNN autotunes
the VAE's convolutions once per shape, with device-wide syncs (first decodes at a new size measured at 4.9 s and
2.2 s against 0.29 s steady on an H200), so a size first seen mid-serving would stall every stream of that GPU.

- ``stream.size = "fixed"``: the one size ``height x width``; every start image is resized to it.
- ``stream.size = "image"``: the allowed sizes ``stream.sizes`` ([height, width] pairs, multiples of 16), and each
  start image streams at the allowed size nearest to its aspect ratio (distance of ``log(h / w)``; a tie goes to the
  earlier size). An empty ``sizes`` means the default set: ``height x width`` and its transpose (the official 480x832
  and 832x480 in the GPU configs), then 1:1, 3:4 and 4:3 at ``stream.area`` pixels, each side floored to a multiple
  of 16 (the DiT's latent patch is 2x2 on an 8x VAE stride). At 480x832: 480x832, 832x480, 624x624, 544x720, 720x544.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

Size = tuple[int, int]  # (height, width) in pixels

SIDE_MULTIPLE = 16
EXTRA_ASPECTS: tuple[Size, ...] = ((1, 1), (3, 4), (4, 3))  # height:width ratios after the configured size's two


def at_area(aspect: Size, area: int) -> Size:
    """The size of ``aspect`` (height:width) at about ``area`` pixels, each side floored to a multiple of 16. Integer
    arithmetic: 480:832 at 480*832 pixels is exactly 480x832 (the official pipeline's float sqrt gives 464x832)."""
    ah, aw = aspect

    def side(a: int, b: int) -> int:
        return math.isqrt(area * a // b) // SIDE_MULTIPLE * SIDE_MULTIPLE

    return side(ah, aw), side(aw, ah)


def default_sizes(height: int, width: int, area: int) -> tuple[Size, ...]:
    """The default allowed set of ``size = "image"`` (see the module docstring), without repeats, in order."""
    sizes: list[Size] = []
    for aspect in ((height, width), (width, height), *EXTRA_ASPECTS):
        size = at_area(aspect, area)
        if min(size) >= SIDE_MULTIPLE and size not in sizes:
            sizes.append(size)
    return tuple(sizes)


class SizedStream(Protocol):
    """What of ``runtime.config.StreamConfig`` the served sizes follow from (stated here: the config imports this
    module to check ``sizes``, so this module does not import the config)."""

    @property
    def size(self) -> str: ...  # "fixed" or "image"
    @property
    def sizes(self) -> Sequence[tuple[int, int]]: ...
    @property
    def height(self) -> int: ...
    @property
    def width(self) -> int: ...
    @property
    def area(self) -> int: ...


def served_sizes(stream: SizedStream) -> tuple[Size, ...]:
    """Every frame size a server with this ``[stream]`` section can stream at, the configured one first."""
    if stream.size == "fixed":
        return ((stream.height, stream.width),)
    if stream.sizes:
        return tuple((int(h), int(w)) for h, w in stream.sizes)
    return default_sizes(stream.height, stream.width, stream.area)


def snap(height: int, width: int, sizes: tuple[Size, ...]) -> Size:
    """The allowed size nearest to the aspect ratio of a ``height x width`` image (the first one on a tie)."""
    if height < 1 or width < 1 or not sizes:
        raise ValueError(f"need a positive image size and at least one allowed size, got {height}x{width}, {sizes}")
    aspect = math.log(height / width)
    # rounded, so that mirrored sizes tie exactly (log(2/3) and log(3/2) differ in the last bit); min keeps the first
    return min(sizes, key=lambda s: round(abs(math.log(s[0] / s[1]) - aspect), 9))


def check_sizes(sizes: list[tuple[int, int]]) -> str | None:
    """Why a configured ``stream.sizes`` is unusable, or None."""
    for size in sizes:
        if len(size) != 2 or min(size) < SIDE_MULTIPLE or any(side % SIDE_MULTIPLE for side in size):
            return f"every entry must be [height, width], multiples of {SIDE_MULTIPLE}, got {list(size)}"
    if len(set(map(tuple, sizes))) != len(sizes):
        return f"entries repeat: {[list(s) for s in sizes]}"
    return None
