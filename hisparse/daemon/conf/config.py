"""hisparsed's configuration: embedded defaults < TOML file < HISPARSED_* env < flags.

The embedded socket is ``$HISPARSE_SOCKET`` (the clients' variable) when set,
else ``$XDG_RUNTIME_DIR/hisparsed/hisparsed.sock`` or ``/tmp/hisparsed-$UID/``.

Every key is validated once, here, with a message that names it; the rest of
the daemon only sees the frozen ``Config``. ``systemd/hisparsed.toml`` is the
documented example of every key.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields, replace
from typing import Any

from hisparse.daemon.conf.values import (  # noqa: F401 (ConfigError, MIN_LEASE_TTL_S, LOG_LEVELS re-exported)
    LOG_LEVELS,
    MIN_LEASE_TTL_S,
    UNIX_PATH_MAX,
    ConfigError,
    choice_value,
    count_value,
    group_value,
    level_value,
    metrics_address_value,
    path_value,
    seconds_value,
    share_value,
    size_or_zero_value,
    size_value,
    text_value,
    ttl_value,
)
from hisparse.layout import format_size
from hisparse.paths import SYSTEM_SOCKET, daemon_default_socket_path  # noqa: F401 (SYSTEM_SOCKET re-exported)

METRICS_SOCKET_NAME = "hisparsed.metrics.sock"


@dataclass(frozen=True)
class NamespaceConfig:
    capacity_bytes: int | None  # None: as an unlisted namespace (attach's capacity, else the default)
    group: str | None = None  # only members of this group may attach (and map its region)


CLUSTER_BACKENDS = ("none", "mooncake")
CLUSTER_PROTOCOLS = ("tcp", "rdma")
WRITE_POLICIES = ("write-behind", "on-evict")


@dataclass(frozen=True)
class ClusterConfig:
    """``[cluster]``: the tier below this daemon (docs/cluster.md). Off unless backend is set."""

    backend: str = "none"  # "mooncake": Mooncake Store (pip install 'hisparse[cluster]')
    master: str = "127.0.0.1:50051"  # mooncake_master's RPC address, host:port
    metadata_server: str = "http://127.0.0.1:8080/metadata"  # or "P2PHANDSHAKE"
    protocol: str = "tcp"
    rdma_devices: str = ""  # e.g. "mlx5_0,mlx5_1" with protocol "rdma"
    local_hostname: str = "127.0.0.1"  # this node's address as the other nodes reach it
    segment_size_bytes: int = 0  # memory this daemon lends the cluster (0: none)
    buffer_size_bytes: int = 16 << 20  # Mooncake's client-side staging buffer
    replicas: int = 1
    write_policy: str = "write-behind"
    queue_pages: int = 4096  # write-behind backlog; beyond it pages are dropped, counted
    batch_pages: int = 64  # pages per Mooncake batch call
    timeout_s: float = 2.0  # a waited-for cluster call answers CLUSTER_UNAVAILABLE after this

    @property
    def enabled(self) -> bool:
        return self.backend != "none"

    def summary(self) -> str:
        if not self.enabled:
            return "cluster=off"
        return (f"cluster={self.backend} master={self.master} metadata={self.metadata_server} "
                f"protocol={self.protocol} segment={format_size(self.segment_size_bytes)} "
                f"replicas={self.replicas} write_policy={self.write_policy}")


@dataclass(frozen=True)
class Config:
    socket: str = field(default_factory=daemon_default_socket_path)
    shm_dir: str = "/dev/shm"
    meta_dir: str | None = None  # None: "meta" beside the socket (never shm_dir: others write there)
    capacity_bytes: int = 8 << 30  # all regions together, their tables and indexes included
    default_namespace_capacity_bytes: int = 1 << 30
    min_page_bytes: int = 64  # a layout with smaller pages is refused (hello: INVALID_ARGUMENT)
    max_namespaces: int = 64
    # Shares of a namespace's pages (quotas.py), per session and per peer (a uid; None: the session's);
    # they bind only while another session / another uid contends (contention.py): alone, all of it.
    session_pin_share: float = 0.5
    session_reserve_share: float = 0.5
    peer_pin_share: float | None = None
    peer_reserve_share: float | None = None
    # Namespaces one peer may create that the config does not name: half the slots, so a lone tenant
    # never meets it (TP 8 of a DSA model: 16, a cluster check: 9); while another uid has made one,
    # also at most half the unnamed slots (namespaces.py).
    peer_max_namespaces: int = 32
    namespaces: dict[str, NamespaceConfig] = field(default_factory=dict)
    # What the daemon admits (hisparse.daemon.policy.limits; a refusal is QUOTA_EXCEEDED naming the key).
    # A peer is a uid, as the kernel reports the connecting process.
    max_sessions: int = 2048
    max_sessions_per_connection: int = 16
    max_sessions_per_uid: int = 512
    max_connections: int = 512
    max_connections_per_uid: int = 128
    fd_headroom: int = 128  # descriptors of RLIMIT_NOFILE no session or connection may take
    max_request_bytes_in_flight: int = 256 << 20  # what connections sending large frames may hold
    lease_ttl_s: float = 10.0
    log_level: str = "INFO"
    admin_token_file: str | None = None  # None: hisparsed.token beside the socket
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    metrics_address: str | None = None  # None: hisparsed.metrics.sock beside the socket; "": off
    fresh: bool = False  # flag only: drop every region and table left by an earlier run
    config_file: str | None = None
    # What env and flags said at start: SIGHUP re-applies them over the file.
    env_values: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    flag_values: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def metadata_dir(self) -> str:
        return self.meta_dir or os.path.join(os.path.dirname(self.socket), "meta")

    @property
    def token_path(self) -> str:
        return self.admin_token_file or os.path.join(os.path.dirname(self.socket), "hisparsed.token")

    @property
    def metrics_endpoint(self) -> str:
        """Where the Prometheus endpoint listens: a unix socket path, HOST:PORT, or "" (off).

        The default sits beside the socket; where that path is too long for a
        unix socket, the default is off rather than a reason not to start.
        """
        if self.metrics_address is None:
            path = os.path.join(os.path.dirname(self.socket), METRICS_SOCKET_NAME)
            return path if len(os.fsencode(path)) <= UNIX_PATH_MAX else ""
        return self.metrics_address

    def summary(self) -> str:
        """One line for the start-up log: the config in force."""
        ns = ", ".join(f"{n}={format_size(c.capacity_bytes) if c.capacity_bytes else 'unsized'}"
                       + (f" group {c.group}" if c.group else "") for n, c in self.namespaces.items())
        return (f"socket={self.socket} shm_dir={self.shm_dir} meta_dir={self.metadata_dir} "
                f"capacity={format_size(self.capacity_bytes)} "
                f"default_namespace_capacity={format_size(self.default_namespace_capacity_bytes)} "
                f"min_page_bytes={self.min_page_bytes} max_namespaces={self.max_namespaces} "
                f"shares (session/peer): pin={self.session_pin_share}/{self.peer_pin_share or self.session_pin_share} "
                f"reserve={self.session_reserve_share}/{self.peer_reserve_share or self.session_reserve_share} "
                f"peer_max_namespaces={self.peer_max_namespaces} "
                f"max_sessions={self.max_sessions}/{self.max_sessions_per_uid} per uid/"
                f"{self.max_sessions_per_connection} per connection "
                f"max_connections={self.max_connections}/{self.max_connections_per_uid} per uid "
                f"fd_headroom={self.fd_headroom} "
                f"max_request_bytes_in_flight={format_size(self.max_request_bytes_in_flight)} "
                f"lease_ttl={self.lease_ttl_s}s log_level={self.log_level} fresh={self.fresh} "
                f"metrics={self.metrics_endpoint or 'off'}"
                f"{' (the default beside the socket is too long a path)' if self.metrics_address is None and not self.metrics_endpoint else ''} "
                f"namespaces=[{ns}] {self.cluster.summary()} "
                f"config={self.config_file or '(embedded defaults)'}")


# TOML key -> (Config field, parser). The same names are used by env (upper
# case, HISPARSED_ prefix) and flags (--dashed-name).


_KEYS: dict[str, tuple[str, Any]] = {
    "socket": ("socket", path_value),
    "shm_dir": ("shm_dir", path_value),
    "meta_dir": ("meta_dir", path_value),
    "capacity": ("capacity_bytes", size_value),
    "default_namespace_capacity": ("default_namespace_capacity_bytes", size_value),
    "min_page_bytes": ("min_page_bytes", size_value),
    "max_namespaces": ("max_namespaces", count_value(1, 1 << 20)),
    "session_pin_share": ("session_pin_share", share_value),
    "session_reserve_share": ("session_reserve_share", share_value),
    "peer_pin_share": ("peer_pin_share", share_value),
    "peer_reserve_share": ("peer_reserve_share", share_value),
    "peer_max_namespaces": ("peer_max_namespaces", count_value(1, 1 << 20)),
    **{key: (key, count_value(0 if key == "fd_headroom" else 1, 1 << 30))
       for key in ("max_sessions", "max_sessions_per_connection", "max_sessions_per_uid",
                   "max_connections", "max_connections_per_uid", "fd_headroom")},
    "max_request_bytes_in_flight": ("max_request_bytes_in_flight", size_value),
    "lease_ttl": ("lease_ttl_s", ttl_value),
    "log_level": ("log_level", level_value),
    "admin_token_file": ("admin_token_file", path_value),
    "metrics_address": ("metrics_address", metrics_address_value),
}
RELOADABLE = ("lease_ttl_s", "log_level", "session_pin_share", "session_reserve_share", "peer_pin_share",
              "peer_reserve_share", "peer_max_namespaces")


def _namespaces(value: Any) -> dict[str, NamespaceConfig]:
    if not isinstance(value, dict):
        raise ConfigError("namespaces: must be a table of [namespaces.\"NAME\"] tables")
    out = {}
    for name, table in value.items():
        where = f'namespaces."{name}"'
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: must be a table with a capacity and/or a group")
        unknown = set(table) - {"capacity", "group"}
        if unknown:
            raise ConfigError(f"{where}.{sorted(unknown)[0]}: unknown key (known: capacity, group)")
        if "capacity" not in table and "group" not in table:
            raise ConfigError(f"{where}.capacity: missing (give it a capacity, a group, or both)")
        capacity = size_value(f"{where}.capacity", table["capacity"]) if "capacity" in table else None
        group = group_value(f"{where}.group", table["group"]) if "group" in table else None
        out[name] = NamespaceConfig(capacity, group)
    return out


# [cluster] key -> (ClusterConfig field, parser); env: HISPARSED_CLUSTER_<KEY>.
_CLUSTER_KEYS: dict[str, tuple[str, Any]] = {
    "backend": ("backend", choice_value(CLUSTER_BACKENDS)),
    "master": ("master", text_value),
    "metadata_server": ("metadata_server", text_value),
    "protocol": ("protocol", choice_value(CLUSTER_PROTOCOLS)),
    "rdma_devices": ("rdma_devices", text_value),
    "local_hostname": ("local_hostname", text_value),
    "segment_size": ("segment_size_bytes", size_or_zero_value),
    "buffer_size": ("buffer_size_bytes", size_value),
    "replicas": ("replicas", count_value(1, 16)),
    "write_policy": ("write_policy", choice_value(WRITE_POLICIES)),
    "queue_pages": ("queue_pages", count_value(1, 1 << 24)),
    "batch_pages": ("batch_pages", count_value(1, 4096)),
    "timeout": ("timeout_s", seconds_value),
}


def _cluster(current: ClusterConfig, value: Any, source: str) -> ClusterConfig:
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: cluster must be a [cluster] table")
    changes = {}
    for key, raw in value.items():
        if key not in _CLUSTER_KEYS:
            raise ConfigError(f"{source}: unknown key cluster.{key} (known: {', '.join(_CLUSTER_KEYS)})")
        name, parse = _CLUSTER_KEYS[key]
        changes[name] = parse(f"{source}: cluster.{key}", raw)
    cfg = replace(current, **changes)
    if cfg.enabled and ":" not in cfg.master:
        raise ConfigError(f"{source}: cluster.master must be host:port, not {cfg.master!r}")
    if cfg.enabled and cfg.protocol == "rdma" and not cfg.rdma_devices:
        raise ConfigError(f"{source}: cluster.rdma_devices must name the NICs when protocol is rdma")
    return cfg


def _apply(cfg: Config, values: dict[str, Any], source: str) -> Config:
    changes: dict[str, Any] = {}
    for key, value in values.items():
        if key == "namespaces":
            changes["namespaces"] = _namespaces(value)
            continue
        if key == "cluster":
            changes["cluster"] = _cluster(changes.get("cluster", cfg.cluster), value, source)
            continue
        if key not in _KEYS:
            known = ", ".join(sorted([*_KEYS, "namespaces", "cluster"]))
            raise ConfigError(f"{source}: unknown key {key!r} (known: {known})")
        name, parse = _KEYS[key]
        changes[name] = parse(f"{source}: {key}", value)
    return replace(cfg, **changes)


def load_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None


def from_env(environ: dict[str, str] | os._Environ[str]) -> dict[str, Any]:
    out = {}
    for key in _KEYS:
        value = environ.get(f"HISPARSED_{key.upper()}")
        if value is not None:
            out[key] = value
    cluster = {key: environ[f"HISPARSED_CLUSTER_{key.upper()}"] for key in _CLUSTER_KEYS
               if f"HISPARSED_CLUSTER_{key.upper()}" in environ}
    if cluster:
        out["cluster"] = cluster
    return out


def build(config_file: str | None = None, env: dict[str, str] | None = None,
          flags: dict[str, Any] | None = None, fresh: bool = False) -> Config:
    """The config in force: defaults, then the file, then env, then flags."""
    environ = os.environ if env is None else env
    config_file = config_file or environ.get("HISPARSED_CONFIG") or None
    cfg = Config()
    if config_file:
        cfg = _apply(cfg, load_file(config_file), os.path.basename(config_file))
        cfg = replace(cfg, config_file=os.path.abspath(config_file))
    env_values = from_env(environ)
    flag_values = {k: v for k, v in (flags or {}).items() if v is not None}
    cfg = _apply(cfg, env_values, "environment")
    cfg = _apply(cfg, flag_values, "flag")
    return replace(cfg, fresh=fresh, env_values=env_values, flag_values=flag_values)


def reload(current: Config) -> Config:
    """What SIGHUP applies: the live-changeable keys of the file, under env and flags as at start.

    A key given by flag or environment keeps that value: the file only
    changes what nothing above it set.
    """
    if not current.config_file:
        return current
    fresh_cfg = _apply(Config(), load_file(current.config_file), os.path.basename(current.config_file))
    fresh_cfg = _apply(fresh_cfg, current.env_values, "environment")
    fresh_cfg = _apply(fresh_cfg, current.flag_values, "flag")
    return replace(current, **{name: getattr(fresh_cfg, name) for name in RELOADABLE})


def flag_keys() -> tuple[str, ...]:
    """The keys ``hisparsed`` takes as flags: every one, as ``--`` and its name dashed."""
    return tuple(_KEYS)


def field_names() -> list[str]:
    return [f.name for f in fields(Config)]
