"""Start images: PNG/JPEG bytes from a client -> raw uint8 RGB at the image's own size.

Pure CPU work with no state, run by rank 0's shell on a worker thread (decoding can take tens of milliseconds, and
no stream may wait for it). The size of the session's frames is chosen afterwards (``stream.size``), and the
condition stage resizes the image to it.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image


class BadImage(ValueError):
    """The start image cannot be used; the message says why (the client gets it with code ``bad_image``)."""


@dataclass(frozen=True)
class DecodedImage:
    pixels: bytes  # uint8 RGB, row-major [height, width, 3]
    height: int
    width: int


def decode_image(data: bytes, max_pixels: int) -> DecodedImage:
    """PNG/JPEG bytes -> uint8 RGB at the image's own size. The pixel count is checked from the header, before
    the image is decoded. Raises ``BadImage``."""
    try:
        with Image.open(io.BytesIO(data), formats=["PNG", "JPEG"]) as img:  # no other decoder is reachable
            if img.width * img.height > max_pixels:
                raise BadImage(f"image of {img.width}x{img.height} pixels exceeds the limit of {max_pixels} pixels")
            rgb = np.asarray(img.convert("RGB"), dtype=np.uint8)
    except BadImage:
        raise
    except Exception as error:  # the decoder's own text can echo internals (object reprs): name the kind only
        raise BadImage(f"the start image could not be decoded as PNG or JPEG ({type(error).__name__})") from None
    return DecodedImage(pixels=rgb.tobytes(), height=rgb.shape[0], width=rgb.shape[1])
