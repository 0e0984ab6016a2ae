"""How each configuration value is parsed and checked: one parser per kind, each naming its key."""

from __future__ import annotations

import os
from typing import Any

from hisparse.errors import HisparseError, InvalidArgument
from hisparse.layout import parse_size

MIN_LEASE_TTL_S = 1.0
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
UNIX_PATH_MAX = 107  # sun_path is 108 bytes with its NUL


class ConfigError(HisparseError):
    """A configuration value is missing, unknown or invalid."""


def size_value(key: str, value: Any) -> int:
    try:
        size = parse_size(value)
    except InvalidArgument as exc:
        raise ConfigError(f"{key}: {exc}") from None
    if size <= 0:
        raise ConfigError(f"{key}: must be positive")
    return size


def path_value(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}: must be a non-empty path string, not {value!r}")
    return os.path.abspath(os.path.expanduser(value))


def ttl_value(key: str, value: Any) -> float:
    try:
        ttl = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: must be a number of seconds, not {value!r}") from None
    if isinstance(value, bool) or not ttl >= MIN_LEASE_TTL_S or ttl > 86_400:
        raise ConfigError(f"{key}: must be between {MIN_LEASE_TTL_S} and 86400 seconds, not {value!r}")
    return ttl


def count_value(low: int, high: int) -> Any:
    def parse(key: str, value: Any) -> int:
        try:
            n = int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: must be an integer, not {value!r}") from None
        if isinstance(value, (bool, float)) or not low <= n <= high:
            raise ConfigError(f"{key}: must be an integer from {low} to {high}, not {value!r}")
        return n
    return parse


def share_value(key: str, value: Any) -> float:
    try:
        share = float(value) if not isinstance(value, bool) else -1.0
    except (TypeError, ValueError):
        share = -1.0
    if not 0.0 < share <= 1.0:
        raise ConfigError(f"{key}: must be a share above 0 and at most 1 (e.g. 0.5), not {value!r}")
    return share


def level_value(key: str, value: Any) -> str:
    if not isinstance(value, str) or value.upper() not in LOG_LEVELS:
        raise ConfigError(f"{key}: must be one of {', '.join(LOG_LEVELS)}, not {value!r}")
    return value.upper()


def metrics_address_value(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key}: must be a string (a unix socket path, HOST:PORT, or \"\" for off), "
                          f"not {value!r}")
    if value in ("", "off"):
        return ""
    if value.startswith("/") or value.startswith("~"):
        path = os.path.abspath(os.path.expanduser(value))
        if len(os.fsencode(path)) > UNIX_PATH_MAX:
            raise ConfigError(f"{key}: {path} is longer than a unix socket path may be "
                              f"({UNIX_PATH_MAX} bytes)")
        return path
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{key}: {value!r} is neither an absolute unix socket path nor HOST:PORT "
                          "(e.g. 127.0.0.1:9477); \"\" turns metrics off")
    return value


def group_value(key: str, value: Any) -> str:
    import grp

    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}: must be a group name, not {value!r}")
    try:
        grp.getgrnam(value)
    except KeyError:
        raise ConfigError(f"{key}: no group {value!r} on this machine (create it, or fix the name)") from None
    return value


def choice_value(choices: tuple[str, ...]) -> Any:
    def parse(key: str, value: Any) -> str:
        if not isinstance(value, str) or value.lower() not in choices:
            raise ConfigError(f"{key}: must be one of {', '.join(choices)}, not {value!r}")
        return value.lower()
    return parse


def text_value(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key}: must be a string, not {value!r}")
    return value


def size_or_zero_value(key: str, value: Any) -> int:
    return 0 if value in (0, "0") else size_value(key, value)


def seconds_value(key: str, value: Any) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: must be a number of seconds, not {value!r}") from None
    if isinstance(value, bool) or not 0.01 <= seconds <= 600:
        raise ConfigError(f"{key}: must be between 0.01 and 600 seconds, not {value!r}")
    return seconds
