"""Per-session frame sizes: the official pipeline's rule from the start image, the allowed sizes a server streams at
(``runtime.sizes``), and a geometry at another size."""

from __future__ import annotations

import pytest

from models.stages import frame_size
from models.synthetic import synthetic_geometry
from runtime import config
from runtime.sizes import served_sizes, snap

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


def test_the_default_allowed_sizes_are_the_official_two_then_square_and_4_3_at_the_same_area() -> None:
    gpu = config.load("single-gpu").stream
    assert served_sizes(gpu) == ((480, 832), (832, 480), (624, 624), (544, 720), (720, 544))
    assert all(h % 16 == 0 and w % 16 == 0 and h * w <= AREA for h, w in served_sizes(gpu))
    cpu = config.load("cpu-tiny", ["--stream.size=image"]).stream  # a CPU config's set is tiny too
    assert served_sizes(cpu) == ((160, 256), (256, 160), (192, 192), (160, 224), (224, 160))
    assert served_sizes(config.load("cpu-tiny").stream) == ((160, 256),)  # fixed: its one size


@pytest.mark.parametrize(("image", "size"), [((480, 832), (480, 832)), ((720, 1280), (480, 832)),
                                             ((1, 4000), (480, 832)), ((832, 480), (832, 480)),
                                             ((1000, 1000), (624, 624)), ((600, 800), (544, 720)),
                                             ((1024, 1536), (544, 720)), ((1536, 1024), (720, 544))])
def test_an_image_snaps_to_the_allowed_size_nearest_its_aspect_ratio(image: tuple[int, int],
                                                                     size: tuple[int, int]) -> None:
    assert snap(*image, served_sizes(config.load("single-gpu").stream)) == size


def test_a_tie_goes_to_the_earlier_allowed_size_and_bad_sizes_are_refused() -> None:
    assert snap(100, 100, ((160, 240), (240, 160))) == (160, 240)
    assert snap(100, 100, ((240, 160), (160, 240))) == (240, 160)
    sizes = config.load("cpu-tiny", ["--stream.size=image", "--stream.sizes=[[64, 96], [96, 64]]"]).stream
    assert served_sizes(sizes) == ((64, 96), (96, 64))
    for bad, why in (("[[64, 90]]", "multiples of 16"), ("[[64, 96], [64, 96]]", "repeat"), ("[[64]]", "")):
        with pytest.raises(config.ConfigError, match=rf"stream\.sizes.*{why}"):
            config.load("cpu-tiny", ["--stream.size=image", f"--stream.sizes={bad}"])
