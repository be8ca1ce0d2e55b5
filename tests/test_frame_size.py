"""Per-session frame sizes: the official pipeline's rule from the start image, and a geometry at another size."""

from __future__ import annotations

import pytest

from models.stages import frame_size
from models.synthetic import synthetic_geometry

AREA = 480 * 832


@pytest.mark.parametrize(
    ("image", "size"),
    [
        ((480, 832), (464, 832)),  # the reference's float rounding: sqrt gives 479.99999999999994, floored to 464
        ((960, 1664), (464, 832)),  # same aspect ratio, larger image: the same size
        ((720, 1280), (464, 832)),  # 16:9, as the official example
        ((1024, 1536), (512, 768)),  # 2:3, as the official example
        ((832, 480), (832, 480)),  # portrait (here the float rounding falls the other way)
        ((600, 800), (544, 720)),  # 3:4
    ],
)
def test_frame_size_is_the_official_rule_float_rounding_included(image: tuple[int, int],
                                                                            size: tuple[int, int]) -> None:
    assert frame_size(*image, AREA) == size


def test_an_image_too_narrow_for_the_area_gives_a_zero_side() -> None:
    assert frame_size(1, 4000, AREA)[0] == 0
    with pytest.raises(ValueError, match="positive image size"):
        frame_size(0, 10, AREA)


def test_geometry_at_another_size_scales_the_spatial_dimensions_by_their_stride() -> None:
    base = synthetic_geometry(160, 256, 3)
    other = base.with_size(144, 272)
    assert (other.height, other.width) == (144, 272)
    assert other.condition_shape == (3, 144, 272) and other.latent_shape == (12, 3, 72, 136)
    assert other.frames_shape(1) == (12, 144, 272, 3) and other.context_shape == base.context_shape
    assert base.with_size(160, 256) is base
    with pytest.raises(ValueError, match="not a multiple of the stride"):
        base.with_size(145, 272)
