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

from hisparse.errors import HisparseError, InvalidArgument
from hisparse.layout import format_size, parse_size
from hisparse.paths import SYSTEM_SOCKET, daemon_default_socket_path  # noqa: F401 (SYSTEM_SOCKET re-exported)

MIN_LEASE_TTL_S = 1.0
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class ConfigError(HisparseError):
    """A configuration value is missing, unknown or invalid."""


@dataclass(frozen=True)
class NamespaceConfig:
    capacity_bytes: int | None  # None: as an unlisted namespace (attach's capacity, else the default)
    group: str | None = None  # only members of this group may attach (and map its region)


@dataclass(frozen=True)
class Config:
    socket: str = field(default_factory=daemon_default_socket_path)
    shm_dir: str = "/dev/shm"
    meta_dir: str | None = None  # None: "meta" beside the socket (never shm_dir: others write there)
    capacity_bytes: int = 8 << 30  # all regions together, their tables and indexes included
    default_namespace_capacity_bytes: int = 1 << 30
    min_page_bytes: int = 64  # a layout with smaller pages is refused (hello: INVALID_ARGUMENT)
    max_namespaces: int = 64
    # Per session, as a share of its namespace's pages: a refusal is QUOTA_EXCEEDED.
    # Embedded default 1 (a single tenant may use its whole region, as before);
    # the shared-node config (systemd/hisparsed.toml) sets 0.5.
    session_pin_share: float = 1.0
    session_reserve_share: float = 1.0
    namespaces: dict[str, NamespaceConfig] = field(default_factory=dict)
    lease_ttl_s: float = 10.0
    log_level: str = "INFO"
    admin_token_file: str | None = None  # None: hisparsed.token beside the socket
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

    def summary(self) -> str:
        """One line for the start-up log: the config in force."""
        ns = ", ".join(f"{n}={format_size(c.capacity_bytes) if c.capacity_bytes else 'unsized'}"
                       + (f" group {c.group}" if c.group else "") for n, c in self.namespaces.items())
        return (f"socket={self.socket} shm_dir={self.shm_dir} meta_dir={self.metadata_dir} "
                f"capacity={format_size(self.capacity_bytes)} "
                f"default_namespace_capacity={format_size(self.default_namespace_capacity_bytes)} "
                f"min_page_bytes={self.min_page_bytes} max_namespaces={self.max_namespaces} "
                f"session_pin_share={self.session_pin_share} "
                f"session_reserve_share={self.session_reserve_share} "
                f"lease_ttl={self.lease_ttl_s}s log_level={self.log_level} fresh={self.fresh} "
                f"namespaces=[{ns}] config={self.config_file or '(embedded defaults)'}")


# TOML key -> (Config field, parser). The same names are used by env (upper
# case, HISPARSED_ prefix) and flags (--dashed-name).
def _size(key: str, value: Any) -> int:
    try:
        size = parse_size(value)
    except InvalidArgument as exc:
        raise ConfigError(f"{key}: {exc}") from None
    if size <= 0:
        raise ConfigError(f"{key}: must be positive")
    return size


def _path(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}: must be a non-empty path string, not {value!r}")
    return os.path.abspath(os.path.expanduser(value))


def _ttl(key: str, value: Any) -> float:
    try:
        ttl = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: must be a number of seconds, not {value!r}") from None
    if isinstance(value, bool) or not ttl >= MIN_LEASE_TTL_S or ttl > 86_400:
        raise ConfigError(f"{key}: must be between {MIN_LEASE_TTL_S} and 86400 seconds, not {value!r}")
    return ttl


def _count(key: str, value: Any) -> int:
    try:
        number = int(value) if not isinstance(value, (bool, float)) else None
    except (TypeError, ValueError):
        number = None
    if number is None or not 1 <= number <= 1 << 20:
        raise ConfigError(f"{key}: must be a whole number from 1 to {1 << 20}, not {value!r}")
    return number


def _share(key: str, value: Any) -> float:
    try:
        share = float(value) if not isinstance(value, bool) else -1.0
    except (TypeError, ValueError):
        share = -1.0
    if not 0.0 < share <= 1.0:
        raise ConfigError(f"{key}: must be a share above 0 and at most 1 (e.g. 0.5), not {value!r}")
    return share


def _level(key: str, value: Any) -> str:
    if not isinstance(value, str) or value.upper() not in LOG_LEVELS:
        raise ConfigError(f"{key}: must be one of {', '.join(LOG_LEVELS)}, not {value!r}")
    return value.upper()


_KEYS: dict[str, tuple[str, Any]] = {
    "socket": ("socket", _path),
    "shm_dir": ("shm_dir", _path),
    "meta_dir": ("meta_dir", _path),
    "capacity": ("capacity_bytes", _size),
    "default_namespace_capacity": ("default_namespace_capacity_bytes", _size),
    "min_page_bytes": ("min_page_bytes", _size),
    "max_namespaces": ("max_namespaces", _count),
    "session_pin_share": ("session_pin_share", _share),
    "session_reserve_share": ("session_reserve_share", _share),
    "lease_ttl": ("lease_ttl_s", _ttl),
    "log_level": ("log_level", _level),
    "admin_token_file": ("admin_token_file", _path),
}
RELOADABLE = ("lease_ttl_s", "log_level", "session_pin_share", "session_reserve_share")


def _group(key: str, value: Any) -> str:
    import grp

    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}: must be a group name, not {value!r}")
    try:
        grp.getgrnam(value)
    except KeyError:
        raise ConfigError(f"{key}: no group {value!r} on this machine (create it, or fix the name)") from None
    return value


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
        capacity = _size(f"{where}.capacity", table["capacity"]) if "capacity" in table else None
        group = _group(f"{where}.group", table["group"]) if "group" in table else None
        out[name] = NamespaceConfig(capacity, group)
    return out


def _apply(cfg: Config, values: dict[str, Any], source: str) -> Config:
    changes: dict[str, Any] = {}
    for key, value in values.items():
        if key == "namespaces":
            changes["namespaces"] = _namespaces(value)
            continue
        if key not in _KEYS:
            known = ", ".join(sorted([*_KEYS, "namespaces"]))
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


def field_names() -> list[str]:
    return [f.name for f in fields(Config)]
