"""Config loading: every shipped layout validates, and every kind of mistake names the key and the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime import config

SHIPPED = sorted(p.stem for p in config.CONFIG_DIR.glob("*.toml"))


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_loads_and_covers_every_rank(name: str) -> None:
    cfg = config.load(name)
    lay = cfg.layout
    assert all(lay.roles_of(r) for r in range(lay.world_size))
    assert lay.roles_of(0)[0] == "coordinator"


def test_split7_puts_condition_on_0_decode_on_1_and_dit_on_2_to_6() -> None:
    lay = config.load("split7-h100").layout
    assert (lay.world_size, lay.condition, lay.decode, lay.dit) == (7, 0, 1, [2, 3, 4, 5, 6])


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    return path


def test_unknown_key_names_the_key_the_file_and_the_valid_keys(tmp_path: Path) -> None:
    path = _write(tmp_path, "[layout]\nworld_sise = 7\n")
    with pytest.raises(config.ConfigError) as error:
        config.load(path)
    text = str(error.value)
    assert str(path) in text and "world_sise" in text and "world_size" in text


def test_unknown_section_lists_the_valid_sections(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError, match=r"unknown field `laytou`.*valid sections: layout"):
        config.load(_write(tmp_path, "[laytou]\nworld_size = 7\n"))


def test_wrong_type_names_the_key_and_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, '[server]\nport = "fast"\n')
    with pytest.raises(config.ConfigError, match=r"bad\.toml.*Expected `int`, got `str`.*server\.port"):
        config.load(path)


def test_layout_that_leaves_a_rank_without_a_role_is_rejected(tmp_path: Path) -> None:
    path = _write(tmp_path, "[layout]\nworld_size = 8\ndit = [2, 3, 4, 5, 6]\n")
    with pytest.raises(config.ConfigError, match=r"bad\.toml: layout does not give ranks \[7\] any role"):
        config.load(path)


def test_heads_not_divisible_by_dit_degree_is_rejected_with_the_numbers() -> None:
    with pytest.raises(config.ConfigError, match=r"split7-h100\.toml.*num_heads = 40.*3 DiT ranks"):
        config.load("split7-h100", ["--layout.world_size=5", "--layout.dit=[2,3,4]"])


def test_rank_outside_the_world_is_rejected() -> None:
    with pytest.raises(config.ConfigError, match=r"layout\.decode = 9 is not a rank of world_size 7"):
        config.load("cpu-tiny", ["--layout.decode=9"])


def test_overrides_are_parsed_as_toml_values() -> None:
    cfg = config.load("cpu-tiny", ["--server.port=6001", "--scheduler.mode=serial", "--synthetic.denoise_s=0.5"])
    assert (cfg.server.port, cfg.scheduler.mode, cfg.synthetic.denoise_s) == (6001, "serial", 0.5)


def test_bad_override_value_is_rejected_naming_the_key() -> None:
    with pytest.raises(config.ConfigError, match=r"scheduler\.mode"):
        config.load("cpu-tiny", ["--scheduler.mode=eager"])


def test_missing_config_says_where_it_looked() -> None:
    with pytest.raises(config.ConfigError, match="not found"):
        config.load("no-such-layout")


def test_model_kind_is_a_builtin_backend_or_a_module_function() -> None:
    plugin = "tests.faulty_backend:build"
    assert config.load("cpu-tiny", [f"--model.kind={plugin}"]).model.kind == plugin
    with pytest.raises(config.ConfigError, match=r"model\.kind = 'synthetc' is not one of"):
        config.load("cpu-tiny", ["--model.kind=synthetc"])


def test_stream_size_follows_the_image_at_max_area_or_height_times_width() -> None:
    fixed = config.load("cpu-tiny").stream
    assert (fixed.size, fixed.area) == ("fixed", 160 * 256)
    image = config.load("cpu-tiny", ["--stream.size=image", "--stream.max_area=399360"]).stream
    assert (image.size, image.area) == ("image", 480 * 832)
    with pytest.raises(config.ConfigError, match=r"stream\.size"):
        config.load("cpu-tiny", ["--stream.size=free"])
    with pytest.raises(config.ConfigError, match=r"stream\.max_area must hold at least one 16x16 block"):
        config.load("cpu-tiny", ["--stream.size=image", "--stream.max_area=100"])


def test_the_camera_intrinsics_are_a_setting_checked_at_load() -> None:
    assert config.load("cpu-tiny", ["--controls.intrinsics=[500.0, 500.0, 416, 240]"]).controls.intrinsics == (
        500.0, 500.0, 416.0, 240.0)
    with pytest.raises(config.ConfigError, match=r"controls\.intrinsics: focal lengths fx, fy must be positive"):
        config.load("cpu-tiny", ["--controls.intrinsics=[0.0, 500.0, 416, 240]"])
    with pytest.raises(config.ConfigError, match=r"controls\.intrinsics: the principal point"):
        config.load("cpu-tiny", ["--controls.intrinsics=[500.0, 500.0, 416, 481]"])


def test_a_drain_time_that_is_not_a_finite_duration_is_a_config_error() -> None:
    for bad in ("nan", "inf", "-5"):  # nan: a drain that never ends; a negative one: nothing handed off
        with pytest.raises(config.ConfigError, match=r"server\.drain_s must be a finite number"):
            config.load("cpu-mini", [f"--server.drain_s={bad}"])
    for good in ("0", "50"):
        assert config.load("cpu-mini", [f"--server.drain_s={good}"]).server.drain_s == float(good)
