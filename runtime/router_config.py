"""Configuration of the router (``python -m ranks.router --config configs/router/router.toml``): TOML in frozen structs.

Two parts: ``[router]`` (its client endpoint, limits and deadlines: what the core and the shell receive) and any
number of ``[[replicas]]`` (the worldstream jobs it serves, by name and client endpoint). Replicas may also register
themselves (``replica.router`` in their own config) on ``router.register_bind``; the list may then be empty. The
same rules as the server's config: unknown keys are rejected with the valid ones listed, ``--router.key=value``
overrides are applied before validation.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import msgspec

from ipc import auth
from runtime.config import CONFIG_DIR, ConfigError, read_token, read_tree, resolve_path, token_of

ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")
MAX_NAME_CHARS = 128
MAX_ENDPOINT_CHARS = 256
MAX_REPLICAS = 1024  # a sum of replicas' counters (each below 2^53) must fit a msgpack uint64
MIB = 1 << 20
CHUNK_FACTS_BYTES = 1 << 20  # a chunk's message beyond its frames (facts, spans): far less


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class RouterSection(_Section):
    """The router's client endpoint (the same client protocol as one server), its limits and its deadlines."""

    host: str = "127.0.0.1"  # client endpoint; loopback unless you mean to expose it
    port: int = 5560  # 0 picks a free port (written to WORLDSTREAM_PORT_FILE if set)
    max_message_bytes: int = 16 * 1024 * 1024  # larger client messages are rejected before decoding (as a server)
    send_hwm: int = 8  # chunks queued per client (a 480x832 chunk is 14 MB, as on a server); a non-reader is dropped
    client_timeout_s: float = 10.0  # sessions of a client silent this long are closed on their replica
    max_watchers: int = 8  # spectators per session, fed by the router itself (one more: busy; 0: none)
    watch_queue: int = 2  # chunks waiting for one watcher beyond its send_hwm queue (a slower one drops the oldest)
    # where replicas register themselves (a ZeroMQ bind address, e.g. "tcp://0.0.0.0:5561"); empty: only the list
    register_bind: str = ""
    # a registration must carry it (replica.token); required when register_bind is beyond loopback
    register_token: str = ""
    # a file holding register_token (read at start, surrounding whitespace dropped): keeps the secret off the
    # command line, where every user of the node reads it in `ps`
    register_token_file: str = ""
    heartbeat_s: float = 0.5  # each replica is pinged (a client heartbeat) this often, up or down
    replica_dead_s: float = 5.0  # an up replica silent this long is down: its sessions end with rank_failed
    stats_interval_s: float = 1.0  # each up replica's stats are read this often (load, chunk period, totals)
    open_timeout_s: float = 120.0  # an open the replica has not answered by then fails (the real model loads caches)
    busy_retry_s: float = 5.0  # retry hint of the busy answer when every replica is full or down
    forget_after_s: float = 600.0  # a registered replica down this long is forgotten (listed ones stay)
    max_replicas: int = 64  # registrations beyond this many replicas are refused
    # the connection to one replica queues at most this much each way (the ZeroMQ high-water marks follow from it)
    replica_queue_mb: int = 512
    max_chunk_mb: int = 64  # the largest chunk forwarded (a 480x832 one is 14 MiB); a session with larger is refused
    # each session is saved on its replica every this many chunks; when the replica goes down the session is restored
    # from its latest snapshot on another one (replicas must share snapshots.dir). 0: never (sessions end with it)
    snapshot_every: int = 0
    # the replicas' snapshots.dir as the router's host sees it: when set, a snapshot the router asked for is deleted
    # once a newer one of its session is written or the session ends (a client's own never are). Empty: kept
    snapshots_dir: str = ""
    metrics_port: int = 0  # >0: the router's probe server (/health, /ready, /metrics) on metrics_host:PORT; 0: off
    metrics_host: str = "127.0.0.1"  # the probe server's address: loopback unless the scraper is elsewhere
    # a file holding the token every client request to the router must carry (``auth``); required beyond loopback
    auth_token_file: str = ""
    auth_token_env: str = ""  # an environment variable holding the clients' token (used when auth_token_file is "")
    insecure: bool = False  # true: bind beyond loopback without a client token (anyone who reaches it is a client)
    # a file holding the token the router presents to its replicas (their server.auth_token_file's); "": none
    replica_token_file: str = ""
    replica_token_env: str = ""  # an environment variable holding the replicas' token (when replica_token_file is "")


class ReplicaEntry(_Section):
    """One replica the router knows from the start."""

    name: str  # how stats, logs and errors name it
    endpoint: str  # the replica's client endpoint, e.g. "tcp://node17:5555"
    max_sessions: int = 4  # its server.max_sessions (a replica that registers says so itself)


class RouterConfig(_Section):
    router: RouterSection = msgspec.field(default_factory=RouterSection)
    replicas: list[ReplicaEntry] = msgspec.field(default_factory=list)


def check_endpoint(endpoint: str) -> str | None:
    """Why ``endpoint`` is not one the router can connect to, or None."""
    if not endpoint.startswith(ENDPOINT_SCHEMES) or len(endpoint) > MAX_ENDPOINT_CHARS:
        return f"endpoint {endpoint[:MAX_ENDPOINT_CHARS]!r} must start with one of {', '.join(ENDPOINT_SCHEMES)} " \
               f"and be at most {MAX_ENDPOINT_CHARS} characters"
    return None


def is_local(endpoint: str) -> bool:
    """Whether only this host reaches ``endpoint``: a loopback TCP address, or ipc:// and inproc://."""
    if not endpoint.startswith("tcp://"):
        return True
    return auth.is_loopback(endpoint[len("tcp://"):].rsplit(":", 1)[0])


def chunk_limit(section: RouterSection) -> int:
    """The largest chunk (frame bytes) the router forwards."""
    return section.max_chunk_mb * MIB


def replica_queue(section: RouterSection) -> tuple[int, int, int]:
    """(receive high-water mark, send high-water mark, largest message) of the connection to one replica. ZeroMQ
    counts messages, so each mark is ``replica_queue_mb`` over the largest message that way: a chunk (plus its
    facts) coming in, a client message going out. A larger message from a replica drops the connection."""
    largest = chunk_limit(section) + CHUNK_FACTS_BYTES
    budget = section.replica_queue_mb * MIB
    return max(1, budget // largest), max(1, budget // section.max_message_bytes), largest


def check_name(name: str) -> str | None:
    if not name or len(name) > MAX_NAME_CHARS or not name.isprintable():
        return f"a replica name must be 1..{MAX_NAME_CHARS} printable characters, got {name[:MAX_NAME_CHARS]!r}"
    return None


def validate(config: RouterConfig, where: str) -> RouterConfig:
    r = config.router
    if not 0 < r.heartbeat_s < r.replica_dead_s:
        raise ConfigError(f"{where}: router.heartbeat_s must be > 0 and below router.replica_dead_s, got "
                          f"{r.heartbeat_s} and {r.replica_dead_s}")
    for key in ("client_timeout_s", "stats_interval_s", "open_timeout_s", "forget_after_s"):
        if getattr(r, key) <= 0:
            raise ConfigError(f"{where}: router.{key} must be > 0")
    if r.snapshot_every < 0:
        raise ConfigError(f"{where}: router.snapshot_every must be >= 0 (chunks between saves; 0: off)")
    if r.busy_retry_s < 0:
        raise ConfigError(f"{where}: router.busy_retry_s must be >= 0")
    if r.max_watchers < 0 or r.watch_queue < 1:
        raise ConfigError(f"{where}: router.max_watchers must be >= 0 and router.watch_queue >= 1")
    for key in ("max_message_bytes", "send_hwm", "max_replicas", "replica_queue_mb", "max_chunk_mb"):
        if getattr(r, key) < 1:
            raise ConfigError(f"{where}: router.{key} must be >= 1")
    if r.max_replicas > MAX_REPLICAS:
        raise ConfigError(f"{where}: router.max_replicas must be at most {MAX_REPLICAS}")
    if r.max_chunk_mb > r.replica_queue_mb or r.max_message_bytes > r.replica_queue_mb * MIB:
        raise ConfigError(f"{where}: router.replica_queue_mb ({r.replica_queue_mb}) must hold one chunk "
                          f"(router.max_chunk_mb = {r.max_chunk_mb}) and one client message (router.max_message_bytes)")
    if r.register_bind and (why := check_endpoint(r.register_bind)):
        raise ConfigError(f"{where}: router.register_bind: {why}")
    if r.register_bind and not r.register_token and not is_local(r.register_bind):
        raise ConfigError(f"{where}: router.register_bind {r.register_bind} is beyond loopback: set "
                          "router.register_token (a random secret, e.g. `openssl rand -hex 16`; replicas pass it as "
                          "replica.token), or anyone who reaches the port can register a replica and receive sessions")
    named = bool(r.auth_token_file or r.auth_token_env)
    if why := auth.bind_problem(r.host, "router.auth_token_file (or router.auth_token_env)", named, r.insecure,
                                "router.insecure"):
        raise ConfigError(f"{where}: {why}")
    names = [e.name for e in config.replicas]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: replica names must be unique, got {names}")
    if len(names) > r.max_replicas:
        raise ConfigError(f"{where}: {len(names)} replicas listed but router.max_replicas is {r.max_replicas}")
    for entry in config.replicas:
        why = check_name(entry.name) or check_endpoint(entry.endpoint)
        if why:
            raise ConfigError(f"{where}: [[replicas]] {entry.name!r}: {why}")
        if entry.max_sessions < 1:
            raise ConfigError(f"{where}: [[replicas]] {entry.name!r}: max_sessions must be >= 1")
    if not config.replicas and not r.register_bind:
        raise ConfigError(f"{where}: no [[replicas]] listed and no router.register_bind: the router has nothing "
                          "to route to")
    return config


ROUTER_CONFIG_DIR = CONFIG_DIR / "router"  # apart from the layouts: a router config is not a server config


def load(name: str | Path, overrides: Sequence[str] = ()) -> RouterConfig:
    """Load a router config by path (or by bare name from ``configs/router/``), apply overrides, validate."""
    path = resolve_path(name, ROUTER_CONFIG_DIR)
    where = str(path)
    tree = read_tree(path, overrides)
    try:
        config = msgspec.convert(tree, RouterConfig)
    except msgspec.ValidationError as error:
        message = f"{where}: {error}"
        if "unknown field" in str(error):
            message += (f" (valid keys of [router]: {', '.join(RouterSection.__struct_fields__)}; of [[replicas]]: "
                        f"{', '.join(ReplicaEntry.__struct_fields__)})")
        raise ConfigError(message) from None
    section = config.router
    if section.register_token_file:
        if section.register_token:
            raise ConfigError(f"{where}: set router.register_token or router.register_token_file, not both")
        token = read_token(section.register_token_file, f"{where}: router.register_token_file")
        config = msgspec.structs.replace(config, router=msgspec.structs.replace(section, register_token=token))
    tokens(config.router, where)  # a token named but unreadable stops the start here, with exit 2
    return validate(config, where)


def tokens(section: RouterSection, where: str = "config") -> tuple[str | None, str | None]:
    """The token the router's clients must present, and the one it presents to its replicas (None: none)."""
    return (token_of(section.auth_token_file, section.auth_token_env, f"{where}: router client token"),
            token_of(section.replica_token_file, section.replica_token_env, f"{where}: router replica token"))
