"""The config presets (``--config cpu-tiny`` reads ``cpu-tiny.toml`` here): a package only so that an installed
worldstream carries them beside ``runtime`` (``runtime.config.CONFIG_DIR``), as a checkout does."""
