"""Configuration: TOML files loaded into nested frozen structs, validated on load.

Every section is a frozen ``msgspec.Struct`` that rejects unknown keys; each component receives only its own
section. Errors name the file, the key and (for unknown keys) the valid ones. ``--section.key=value``
overrides are applied before validation, with the value parsed as TOML (``--server.port=6000``,
``--scheduler.mode="serial"``; a bare word is taken as a string).
"""

from __future__ import annotations

import json
import math
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

from ipc import auth
from ipc.protocol import intrinsics_problem
from models.controls import OFFICIAL_INTRINSICS, MotionSpeeds
from models.dit_config import MODEL_PRESETS
from models.dit_config import PRESETS as DIT_PRESETS
from runtime.sizes import check_sizes

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names the file and the key."""


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class LayoutConfig(_Section):
    """Which rank holds which role (the coordinator, and the stage each rank runs: condition, denoise, decode). Roles
    may share a rank; every rank must hold at least one role."""

    name: str = "cpu-tiny"  # a label, shown in stats, logs and to a router
    world_size: int = 7  # ranks in the job: what torchrun --nproc-per-node or srun --ntasks must start
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: NCCL when CUDA is available, else gloo
    coordinator: int = 0  # the ZeroMQ server, sessions and scheduler (rank 0 by convention)
    condition: int = 0  # text encode + VAE encode of the condition chunks
    decode: int = 1  # VAE decode
    # the denoise stage: the DiT ranks (its Ulysses group); the first is the leader
    dit: list[int] = msgspec.field(default_factory=lambda: [2, 3, 4, 5, 6])

    @property
    def dit_leader(self) -> int:
        return self.dit[0]

    def roles_of(self, rank: int) -> list[str]:
        roles = []
        if rank == self.coordinator:
            roles.append("coordinator")
        if rank == self.condition:
            roles.append("condition")
        if rank == self.decode:
            roles.append("decode")
        if rank in self.dit:
            roles.append("denoise")
        return roles


class ServerConfig(_Section):
    """The client-facing ZeroMQ server on the coordinator rank and its limits."""

    host: str = "127.0.0.1"  # loopback unless you mean to expose it
    port: int = 5555  # 0 picks a free port (written to the log and to WORLDSTREAM_PORT_FILE if set)
    max_sessions: int = 4  # a new session beyond this is refused with a retry hint
    max_message_bytes: int = 16 * 1024 * 1024  # larger client messages are rejected before decoding
    max_image_pixels: int = 2048 * 2048  # larger start images are rejected from their header, before decoding
    max_prompt_chars: int = 2000  # longer prompts are rejected (each DiT rank holds the session's context)
    max_chunks: int = 100_000  # maximum session length in chunks
    client_timeout_s: float = 10.0  # a session whose client sent nothing (not even a heartbeat) this long is closed
    send_hwm: int = 8  # messages queued per client (a 480x832 chunk is 14 MB); one that does not read is dropped
    # replies and notices waiting for one client beyond its send_hwm queue (a burst of requests is answered in full);
    # a client with more waiting has stopped reading: it is dropped and told (``not_reading``)
    max_waiting: int = 1024
    max_watchers: int = 8  # spectators per session (``watch``); one more is refused busy; 0: no spectators
    # chunks waiting for one watcher beyond its send_hwm queue: a slower watcher drops the oldest (never the player)
    watch_queue: int = 2
    # a file holding the client token every request must carry (its ``auth`` field); required beyond loopback
    auth_token_file: str = ""
    auth_token_env: str = ""  # an environment variable holding the client token (used when auth_token_file is "")
    insecure: bool = False  # true: bind beyond loopback without a client token (anyone who reaches it is a client)
    # on the first stop signal (or a ``drain`` request) this long is given to save every session and hand it off
    # before the server stops; 0: stop at once. Keep it under the signal's lead (Slurm ``--signal=B:TERM@60``: 50)
    drain_s: float = 50.0
    # a file holding the operator token a ``drain`` request must carry (its ``operator`` field); with none (nor
    # operator_token_env) the protocol's drain is refused and only a stop signal drains
    operator_token_file: str = ""
    operator_token_env: str = ""  # an environment variable holding the operator token (used when the file is "")


class StreamConfig(_Section):
    """Geometry of the video stream."""

    height: int = 160  # video frame height (size="fixed")
    width: int = 256  # video frame width (size="fixed")
    chunk_latent_frames: int = 3  # latent frames per chunk (v1: 3, v2: 4)
    fps: float = 16.0  # media frame rate, used for the real-time factor and the mp4
    # "fixed": every session is height x width (the start image is resized to it); "image": each session streams at
    # the allowed size (``sizes``) nearest to its start image's aspect ratio (``runtime.sizes``). Every allowed size
    # is warmed up on every rank before the server answers clients, so no unseen size reaches cuDNN mid-serving.
    size: Literal["fixed", "image"] = "fixed"
    # the allowed [height, width] sizes of size="image" (multiples of 16); empty: height x width, its transpose, then
    # 1:1, 3:4 and 4:3 at max_area pixels (480x832: 480x832, 832x480, 624x624, 544x720, 720x544)
    sizes: list[tuple[int, int]] = msgspec.field(default_factory=list)
    max_area: int = 0  # pixels of the default sizes' 1:1, 3:4 and 4:3 entries; 0: height * width

    @property
    def area(self) -> int:
        return self.max_area or self.height * self.width


class SchedulerConfig(_Section):
    """The coordinator's scheduler. The prefetch depth (2) is an internal constant, not a setting."""

    mode: Literal["prefetch", "serial"] = "prefetch"  # serial is the old design, kept for the A/B benchmark
    control_capacity: int = 2  # accepted controls per session whose denoise has not started
    latent_capacity: int = 1  # latents per session waiting for or in decode
    output_capacity: int = 2  # decoded chunks per session not yet emitted


class CapacityConfig(_Section):
    """Admission by real time and the degrade ladder (``runtime.capacity``). A session keeps real time when its
    predicted real-time factor (chunk media seconds / predicted chunk period) is at least ``1 + margin``."""

    admission: Literal["realtime", "count"] = "realtime"  # count: server.max_sessions only (the old rule)
    ladder: Literal["newest", "all", "off"] = "newest"  # who steps down first: the newest session, all alike, nobody
    margin: float = 0.1  # head room kept on the predicted real-time factor (0.1: >= 1.1 predicted)
    min_steps: Literal[1, 2, 4] = 1  # a session's floor when its open gives no min_steps
    alpha: float = 0.3  # weight of the newest measurement in each moving estimate of a stage time (0 < alpha <= 1)


class SyntheticConfig(_Section):
    """Stage costs of the synthetic backend (seconds per chunk)."""

    encode_s: float = 0.025  # the condition stage
    denoise_s: float = 0.06  # the denoise stage at 4 steps (fewer steps cost in proportion to the passes)
    decode_s: float = 0.03  # the decode stage
    # extra seconds of the first chunk each stage runs at a frame size it has not seen: a GPU's first use of a shape
    # (cuDNN autotuning, module loads), which the start-up warm-up absorbs; 0: none
    cold_s: float = 0.0


class ModelConfig(_Section):
    """Which backend runs the stages, where its weights come from, and the model's streaming settings."""

    # "synthetic", "lingbot-fast", or "package.module:function" naming a backend of your own (the tests' failure
    # injection is one): called as function(model, stream, synthetic, controls, roles, device, dit_group) -> Backend
    kind: str = "synthetic"
    preset: str = "tiny"  # v1, v2 (the released models: schedule, chunk, window) or tiny, small (random weights)
    checkpoint_dir: str = ""  # the download root; empty: seeded random weights
    dit_subdir: str = ""  # the DiT folder under checkpoint_dir; empty: lingbot_world_fast/, transformers/ or the one
    components_dir: str = ""  # where the VAE, umT5 and tokenizer are when checkpoint_dir does not hold them
    vae_file: str = "Wan2.1_VAE.pth"  # relative: looked up in checkpoint_dir, then components_dir
    t5_file: str = "models_t5_umt5-xxl-enc-bf16.pth"  # the umT5 text encoder, looked up as vae_file
    tokenizer_dir: str = "google/umt5-xxl"  # tokenizer.json (or spiece.model)
    # auto: on CUDA every fused SDPA kernel (and Sage, if installed) is timed at the DiT's shapes at start and the
    # fastest pinned for the process; sdpa: PyTorch's own kernel order; flash/cudnn/efficient: that kernel first
    attention: Literal["auto", "sdpa", "sage", "flash", "cudnn", "efficient"] = "auto"
    compile: Literal["off", "blocks", "graphs"] = "off"  # DiT: blocks = one compiled block; graphs = + CUDA graphs
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # DiT and umT5: auto is bf16 on CUDA, fp32 on CPU
    vae_dtype: Literal["tf32", "float32", "bfloat16"] = "tf32"  # VAE on CUDA: fp32 with TF32 convs, strict, or bf16
    kv_window: int | Literal["preset", "full"] = "preset"  # KV window in latent frames; full: official v1, no eviction
    kv_sink: int = -1  # sink latent frames of a rolling window; -1: the preset's
    kv_full_frames: int = 21  # latent frames a "full" cache holds: caps the session (21 = the official 81 frames)
    weights_seed: int = 0  # seed of random weights when no checkpoint is given
    # DiT self-attention: q, k and v as one [d, 3d] GEMM over weights concatenated once at load (same checkpoint)
    fused_qkv: bool = False
    # DiT on several ranks: Ulysses all-to-alls in head groups, exchanged while the other groups attend
    overlap_all_to_all: bool = False


class ControlsConfig(_Section):
    """Keys and mouse to camera motion per video frame (defaults: the official LingBot-World mapping)."""

    move: float = 0.05  # W/S, scene units per frame along the horizontal forward direction
    strafe: float = 0.05  # A/D, scene units per frame
    turn_deg: float = 2.0  # I/K pitch and J/L yaw, degrees per frame
    pitch_limit_deg: float = 85.0  # the camera never pitches beyond this
    translation_scale: float = 1.0  # DiT: the per-chunk normalised camera steps times this (TeleFuser uses 3)
    # the camera (fx, fy, cx, cy) in pixels of a 480x832 frame, scaled to each session's frame size, for sessions
    # whose open request gives none; default: the official fast examples' (about 90 degrees horizontal)
    intrinsics: tuple[float, float, float, float] = OFFICIAL_INTRINSICS


class TimeoutsConfig(_Section):
    """Deadlines: nothing blocks forever."""

    collective_s: float = 60.0  # every process group's timeout (tensor transfers, Ulysses all-to-all)
    heartbeat_s: float = 0.5  # rank -> coordinator heartbeat period
    rank_dead_s: float = 5.0  # a rank silent this long is dead: the job ends with a non-zero exit
    startup_s: float = 120.0  # every rank must have reported in by then
    stage_s: float = 120.0  # one stage task (encode, denoise, decode, init, release) must finish within this


class MetricsConfig(_Section):
    """Session statistics and rank 0's optional probe server (health, readiness, Prometheus metrics over HTTP)."""

    warmup_chunks: int = 2  # first chunks of a session excluded from compute FPS (reported separately)
    prometheus_port: int = 0  # >0: rank 0's probe server (/health, /ready, /metrics) on prometheus_host:PORT
    prometheus_host: str = "127.0.0.1"  # the probe server's address: loopback unless the scraper is elsewhere


class MemoryConfig(_Section):
    """Memory-aware admission: a session opens only if every rank has room for what it costs (``models.memory``)."""

    budget_gb: float = 0.0  # bytes each rank may give to sessions; CPU: 0 = unlimited; CUDA: >0 caps the measured room
    margin_gb: float = 2.0  # CUDA: kept free beside the model's working peaks (allocator rounding, NCCL, fragments)
    tolerance: float = 0.1  # a session that holds more than the model said by this fraction logs a warning


class ReplicaConfig(_Section):
    """Joining a router (``python -m ranks.router``) as one of its replicas. The job is unchanged: rank 0 only
    registers its client endpoint with the router and re-sends that registration as a heartbeat."""

    router: str = ""  # the router's registration endpoint (its router.register_bind as reached from here); "": none
    name: str = ""  # this replica's name at the router; "": "<advertised host>:<port>". A requeued job keeps it
    advertise_host: str = ""  # the host the router connects to; "": server.host, or this node's name for 0.0.0.0
    heartbeat_s: float = 1.0  # the registration is re-sent this often
    token: str = ""  # the router's register_token, when it requires one
    # a file holding the token (read at start, surrounding whitespace dropped): off the command line, where every
    # user of the node reads it in `ps` (the Slurm recipes pass the router job's token file)
    token_file: str = ""


MAX_SNAPSHOT_GB = 1e6  # a petabyte
MAX_SNAPSHOT_COUNT = 10**6


class SnapshotsConfig(_Section):
    """Saved sessions (``save`` / ``open(restore=...)``, ``runtime.snapshots``): one folder per snapshot."""

    dir: str = "out/snapshots"  # local disk, or a filesystem every replica that may restore a snapshot shares
    # the retention budget, kept after each save by deleting the oldest complete snapshots (never the one just
    # written, never one a restore here is loading); 0: no limit. Replicas sharing ``dir`` should set the same.
    # GiB of snapshot files in ``dir``: 4 snapshots at 480x832 (about 25 GiB each), so a server left with the
    # defaults never fills a disk; set it to what the disk can spare (0: no limit)
    max_gb: float = 100.0
    max_count: int = 0  # snapshots in ``dir``
    # how fast a session earns saves back (``runtime.save_rate``): after its burst, one more every
    # 60 / saves_per_minute seconds; a save beyond is refused busy with its retry_after_s. 0: no limit
    saves_per_minute: float = 10.0
    save_burst: int = 10  # saves one session may make at once before the rate applies (at least 1)


class Config(_Section):
    layout: LayoutConfig = msgspec.field(default_factory=LayoutConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    stream: StreamConfig = msgspec.field(default_factory=StreamConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    controls: ControlsConfig = msgspec.field(default_factory=ControlsConfig)
    synthetic: SyntheticConfig = msgspec.field(default_factory=SyntheticConfig)
    capacity: CapacityConfig = msgspec.field(default_factory=CapacityConfig)
    timeouts: TimeoutsConfig = msgspec.field(default_factory=TimeoutsConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    memory: MemoryConfig = msgspec.field(default_factory=MemoryConfig)
    replica: ReplicaConfig = msgspec.field(default_factory=ReplicaConfig)
    snapshots: SnapshotsConfig = msgspec.field(default_factory=SnapshotsConfig)


_SECTIONS: dict[str, type[_Section]] = {f: type(getattr(Config(), f)) for f in Config.__struct_fields__}


def _parse_override(text: str) -> tuple[list[str], Any]:
    if not text.startswith("--") or "=" not in text:
        raise ConfigError(f"override {text!r} must look like --section.key=value")
    path, raw = text[2:].split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return path.split("."), value


def _apply(tree: dict[str, Any], path: list[str], value: Any, where: str) -> None:
    node = tree
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{where}: {'.'.join(path)} does not name a section key")
    node[path[-1]] = value


def _explain(error: msgspec.ValidationError, where: str) -> ConfigError:
    text = str(error)
    message = f"{where}: {text}"
    if "unknown field" in text and "$." in text:
        section = text.rsplit("$.", 1)[1].strip("`").split(".")[0].split("[")[0]
        if section in _SECTIONS:
            message += f" (valid keys of [{section}]: {', '.join(_SECTIONS[section].__struct_fields__)})"
    elif "unknown field" in text:
        message += f" (valid sections: {', '.join(_SECTIONS)})"
    elif "Invalid enum value" in text and "$." in text:
        section, _, key = text.rsplit("$.", 1)[1].strip("`").partition(".")
        valid = _literal_values(_SECTIONS[section], key) if section in _SECTIONS else []
        if valid:
            message += f" (valid values of {section}.{key}: {', '.join(valid)})"
    return ConfigError(message)


def _literal_values(section: type[_Section], key: str) -> list[str]:
    """The values a ``Literal`` key accepts (an ``int | Literal[...]`` key also says it takes a number)."""
    hint = typing.get_type_hints(section).get(key)
    values: list[str] = []
    for part in typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,):
        if typing.get_origin(part) is Literal:
            values += [json.dumps(v) for v in typing.get_args(part)]
        elif part is int:
            values.append("a whole number")
    return values


def validate(config: Config, where: str) -> Config:
    """Cross-field checks that a struct's types cannot express."""
    lay = config.layout
    n = lay.world_size
    if n < 1:
        raise ConfigError(f"{where}: layout.world_size must be >= 1, got {n}")
    for key in ("coordinator", "condition", "decode"):
        rank = getattr(lay, key)
        if not 0 <= rank < n:
            raise ConfigError(f"{where}: layout.{key} = {rank} is not a rank of world_size {n}")
    if not lay.dit:
        raise ConfigError(f"{where}: layout.dit must list at least one rank")
    if len(set(lay.dit)) != len(lay.dit) or any(not 0 <= r < n for r in lay.dit):
        raise ConfigError(f"{where}: layout.dit = {lay.dit} must be distinct ranks of world_size {n}")
    idle = [r for r in range(n) if not lay.roles_of(r)]
    if idle:
        raise ConfigError(f"{where}: layout does not give ranks {idle} any role (world_size {n})")
    if lay.coordinator != 0:
        raise ConfigError(f"{where}: layout.coordinator must be rank 0 (got {lay.coordinator})")
    heads = model_heads(config.model)
    if heads is not None and heads % len(lay.dit) != 0:
        raise ConfigError(
            f"{where}: model preset {config.model.preset!r} has num_heads = {heads}, not divisible by the "
            f"{len(lay.dit)} DiT ranks of layout.dit = {lay.dit}"
        )
    kind = config.model.kind
    if kind not in BUILTIN_BACKENDS and (kind.count(":") != 1 or not all(kind.split(":"))):
        raise ConfigError(f"{where}: model.kind = {kind!r} is not one of {sorted(BUILTIN_BACKENDS)} nor "
                          "'package.module:function'")
    _validate_model(config, where)
    ctl = config.controls
    try:
        MotionSpeeds(move=ctl.move, strafe=ctl.strafe, turn_deg=ctl.turn_deg, pitch_limit_deg=ctl.pitch_limit_deg)
    except ValueError as error:
        raise ConfigError(f"{where}: [controls] {error}") from None
    if not 0 < ctl.translation_scale <= 100:
        raise ConfigError(f"{where}: controls.translation_scale must be in (0, 100], got {ctl.translation_scale}")
    why = intrinsics_problem(ctl.intrinsics)
    if why is not None:
        raise ConfigError(f"{where}: controls.intrinsics: {why}")
    st = config.stream
    if st.max_area < 0 or (st.size == "image" and st.area < 16 * 16):
        raise ConfigError(f"{where}: stream.max_area must hold at least one 16x16 block, got {st.max_area}")
    if st.height % 16 or st.width % 16:
        raise ConfigError(
            f"{where}: stream.height and stream.width must be multiples of 16, got {st.height}x{st.width}"
        )
    why = check_sizes(st.sizes)
    if why is not None:
        raise ConfigError(f"{where}: stream.sizes: {why}")
    if st.chunk_latent_frames < 1:
        raise ConfigError(f"{where}: stream.chunk_latent_frames must be >= 1")
    if config.server.max_waiting < 1:
        raise ConfigError(f"{where}: server.max_waiting must be >= 1, got {config.server.max_waiting}")
    if not (math.isfinite(config.server.drain_s) and 0 <= config.server.drain_s <= MAX_DRAIN_S):
        raise ConfigError(f"{where}: server.drain_s must be a finite number in [0, {MAX_DRAIN_S:g}] (0: stop at "
                          f"once), got {config.server.drain_s}")
    if config.server.max_watchers < 0 or config.server.watch_queue < 1:
        raise ConfigError(f"{where}: server.max_watchers must be >= 0 and server.watch_queue >= 1, got "
                          f"{config.server.max_watchers} and {config.server.watch_queue}")
    sch = config.scheduler
    for key in ("control_capacity", "latent_capacity", "output_capacity"):
        if getattr(sch, key) < 1:
            raise ConfigError(f"{where}: scheduler.{key} must be >= 1")
    mem = config.memory
    if mem.budget_gb < 0 or mem.margin_gb < 0 or mem.tolerance < 0:
        raise ConfigError(f"{where}: memory.budget_gb, memory.margin_gb and memory.tolerance must be >= 0")
    cap = config.capacity
    if not 0 <= cap.margin <= 10 or not 0 < cap.alpha <= 1:
        raise ConfigError(f"{where}: capacity.margin must be in [0, 10] and capacity.alpha in (0, 1], got "
                          f"{cap.margin}, {cap.alpha}")
    named = bool(config.server.auth_token_file or config.server.auth_token_env)
    if why := auth.bind_problem(config.server.host, "server.auth_token_file (or server.auth_token_env)", named,
                                config.server.insecure, "server.insecure"):
        raise ConfigError(f"{where}: {why}")
    rep = config.replica
    if rep.router and not rep.router.startswith(("tcp://", "ipc://")):
        raise ConfigError(f"{where}: replica.router must be a ZeroMQ endpoint (tcp://host:port), got {rep.router!r}")
    if rep.heartbeat_s <= 0:
        raise ConfigError(f"{where}: replica.heartbeat_s must be > 0, got {rep.heartbeat_s}")
    snap = config.snapshots
    # bounded so the stats that show them stay within the counts a router reads (``ipc.metrics_types.Count``)
    if not (math.isfinite(snap.max_gb) and 0 <= snap.max_gb <= MAX_SNAPSHOT_GB) or \
            not 0 <= snap.max_count <= MAX_SNAPSHOT_COUNT:
        raise ConfigError(f"{where}: snapshots.max_gb must be a finite number in [0, {MAX_SNAPSHOT_GB}] and "
                          f"snapshots.max_count in [0, {MAX_SNAPSHOT_COUNT}] (0: no limit), got {snap.max_gb}, "
                          f"{snap.max_count}")
    if not (math.isfinite(snap.saves_per_minute) and snap.saves_per_minute >= 0) or snap.save_burst < 1:
        raise ConfigError(f"{where}: snapshots.saves_per_minute must be a finite number >= 0 (0: no limit) and "
                          f"snapshots.save_burst >= 1, got {snap.saves_per_minute}, {snap.save_burst}")
    return config


MAX_DRAIN_S = 86_400.0  # a day: a drain longer than any job's stop signal lead is a typo

BUILTIN_BACKENDS = frozenset({"synthetic", "lingbot-fast"})

# The DiT of each model preset (``models.dit_config``: torch-free, so a config is checked without importing torch)
PRESET_DIT = {name: DIT_PRESETS[dit] for name, dit in MODEL_PRESETS.items()}
PRESET_HEADS = {name: dit.num_heads for name, dit in PRESET_DIT.items()}
RELEASED_CHUNK = {"v1": 3, "v2": 4}  # latent frames per chunk the released models were distilled for


def _validate_model(config: Config, where: str) -> None:
    model = config.model
    if model.kind != "lingbot-fast":
        return
    if model.preset not in PRESET_HEADS:
        raise ConfigError(f"{where}: model.preset = {model.preset!r}; valid presets: {sorted(PRESET_HEADS)}")
    chunk = RELEASED_CHUNK.get(model.preset)
    if chunk is not None and config.stream.chunk_latent_frames != chunk:
        raise ConfigError(f"{where}: model.preset = {model.preset!r} runs chunks of {chunk} latent frames; set "
                          f"stream.chunk_latent_frames = {chunk} (got {config.stream.chunk_latent_frames})")
    if model.kv_sink < -1:
        raise ConfigError(f"{where}: model.kv_sink must be -1 (the preset's) or a number of latent frames")
    try:  # the window/sink rule is the model's (models.dit_config, torch-free): checked there, once
        PRESET_DIT[model.preset].with_kv_window(model.kv_window, model.kv_sink, model.kv_full_frames,
                                                chunk_size=config.stream.chunk_latent_frames)  # fmt: skip
    except ValueError as error:
        raise ConfigError(f"{where}: {error}") from None


def model_heads(model: ModelConfig) -> int | None:
    if model.kind != "lingbot-fast":
        return None
    return PRESET_HEADS.get(model.preset)


def resolve_path(name: str | Path, directory: Path = CONFIG_DIR) -> Path:
    """A config given by path, or by bare name from ``directory`` (``cpu-tiny`` -> ``configs/cpu-tiny.toml``)."""
    path = Path(name)
    if path.is_file():  # (a folder of that name, e.g. the ``router/`` package at the repository root, is no config)
        return path
    candidate = directory / (path.name if path.suffix == ".toml" else f"{path.name}.toml")
    if candidate.exists():
        return candidate
    raise ConfigError(f"config {name!s} not found (looked in . and {directory})")


def read_tree(path: Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """A config file's TOML with ``--section.key=value`` overrides applied, not yet validated."""
    try:
        tree = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from None
    for text in overrides:
        keys, value = _parse_override(text)
        _apply(tree, keys, value, f"{path} (override {text})")
    return tree


def load(name: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Load, override and validate a config file."""
    path = resolve_path(name)
    where = str(path)
    tree = read_tree(path, overrides)
    try:
        config = msgspec.convert(tree, Config)
    except msgspec.ValidationError as error:
        raise _explain(error, where) from None
    replica = config.replica
    if replica.token_file:
        if replica.token:
            raise ConfigError(f"{where}: set replica.token or replica.token_file, not both")
        token = read_token(replica.token_file, f"{where}: replica.token_file")
        config = msgspec.structs.replace(config, replica=msgspec.structs.replace(replica, token=token))
    client_token(config.server, where)  # a token named but unreadable stops the start here, with exit 2
    operator_token(config.server, where)
    return validate(config, where)


def token_of(file: str, env: str, what: str) -> str | None:
    """``ipc.auth.read_token`` for a config: a token named but unreadable, empty or too long is a ``ConfigError``
    naming it (exit 2); None when neither a file nor a variable is named."""
    try:
        return auth.read_token(file, env, what)
    except auth.TokenError as error:
        raise ConfigError(str(error)) from None


def client_token(server: ServerConfig, where: str = "config") -> str | None:
    """The token every client request must carry (``server.auth_token_file`` or ``_env``); None: none required."""
    return token_of(server.auth_token_file, server.auth_token_env, f"{where}: server client token")


def operator_token(server: ServerConfig, where: str = "config") -> str | None:
    """The token a ``drain`` request must carry (``server.operator_token_file`` or ``_env``); None: none drains."""
    return token_of(server.operator_token_file, server.operator_token_env, f"{where}: server operator token")


def read_token(path: str, what: str) -> str:
    """A secret from a file (a token kept out of argv): ``token_of`` with a file that must be named."""
    token = token_of(path, "", what)
    assert token is not None, "read_token needs a path"
    return token


def to_dict(config: Config) -> dict[str, Any]:
    return msgspec.to_builtins(config)
