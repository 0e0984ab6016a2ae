"""The adapter's configuration: ``kv_connector_extra_config`` parsed once, at the boundary.

vLLM hands every offloading spec the same untyped ``extra_config`` mapping
(``spec_name``, ``spec_module_path``, ``block_size``, ... sit in it too).
``AdapterConfig.from_extra_config`` reads the keys this adapter owns, checks
their types and ranges, and returns a frozen dataclass; nothing past this
module looks at the mapping again.

Keys (all optional):

=====================  =========================================================
``socket``             hisparsed's socket path; default ``$HISPARSE_SOCKET``, then
                       the system daemon's, then the per-user default
``namespace``          use this namespace instead of the derived one
``capacity``           region size if this engine creates the namespace
                       (``"64GiB"`` or bytes); else the daemon's config decides
``timeout_s``          deadline of one request of the adapter's background thread
                       and the workers (default 1.0)
``deadline_s``         deadline of the one request the scheduler's thread makes
                       itself (``reserve`` in ``prepare_store``; default 0.02)
``hold_s``             how long a key looked up but not loaded stays pinned
                       (default 5.0)
``hash_algo``          the engine's ``--prefix-caching-hash-algo`` (default
                       ``sha256``, vLLM's default); part of the namespace
``mirror_refresh_s``   how often the background thread refreshes the key mirror
                       and pins the keys lookups asked for (default 0.005)
=====================  =========================================================

The hash check lives here too: prefix sharing across processes needs block
hashes that every process computes alike, which ``xxhash`` only does with a
shared ``PYTHONHASHSEED``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hisparse.errors import InvalidArgument
from hisparse.layout import parse_size

log = logging.getLogger(__name__)

# Digest bytes of each vLLM prefix-caching hash (vllm.utils.hashing); an
# OffloadKey is that digest plus a 4-byte group index.
HASH_DIGEST_BYTES: dict[str, int] = {"sha256": 32, "sha256_cbor": 32, "xxhash": 16, "xxhash_cbor": 16}
# Hashes whose seed vLLM draws at random per process unless PYTHONHASHSEED is set.
SEEDED_HASHES = frozenset({"xxhash", "xxhash_cbor"})
GROUP_INDEX_BYTES = 4

DEFAULT_TIMEOUT_S = 1.0  # background thread and workers: per request
DEFAULT_DEADLINE_S = 0.02  # the scheduler's thread: well under a decode step
DEFAULT_HOLD_S = 5.0
DEFAULT_MIRROR_REFRESH_S = 0.005


class HashAlgorithmError(InvalidArgument):
    """The engine's block hashes cannot match those of other processes."""


@dataclass(frozen=True)
class AdapterConfig:
    """What this adapter reads from ``kv_connector_extra_config``."""

    socket: str | None = None  # None: hisparse.client's default socket
    namespace: str | None = None  # None: derived from the OffloadingConfig
    capacity_bytes: int | None = None  # None: the daemon's config decides
    timeout_s: float = DEFAULT_TIMEOUT_S
    deadline_s: float = DEFAULT_DEADLINE_S
    hold_s: float = DEFAULT_HOLD_S
    hash_algo: str = "sha256"
    mirror_refresh_s: float = DEFAULT_MIRROR_REFRESH_S

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> AdapterConfig:
        socket = _optional_str(extra, "socket")
        namespace = _optional_str(extra, "namespace")
        capacity = extra.get("capacity")
        capacity_bytes = None
        if capacity is not None:
            capacity_bytes = parse_size(capacity)
            if capacity_bytes <= 0:
                raise InvalidArgument(f"kv_connector_extra_config.capacity must be positive: {capacity!r}")
        hash_algo = _optional_str(extra, "hash_algo") or "sha256"
        if hash_algo not in HASH_DIGEST_BYTES:
            raise InvalidArgument(f"kv_connector_extra_config.hash_algo must be one of "
                                  f"{sorted(HASH_DIGEST_BYTES)}, not {hash_algo!r}")
        return cls(
            socket=socket,
            namespace=namespace,
            capacity_bytes=capacity_bytes,
            timeout_s=_positive_float(extra, "timeout_s", DEFAULT_TIMEOUT_S),
            deadline_s=_positive_float(extra, "deadline_s", DEFAULT_DEADLINE_S),
            hold_s=_positive_float(extra, "hold_s", DEFAULT_HOLD_S),
            hash_algo=hash_algo,
            mirror_refresh_s=_positive_float(extra, "mirror_refresh_s", DEFAULT_MIRROR_REFRESH_S,
                                             allow_zero=True),
        )

    @property
    def key_bytes(self) -> int:
        """Length of every OffloadKey this engine produces."""
        return HASH_DIGEST_BYTES[self.hash_algo] + GROUP_INDEX_BYTES


def _optional_str(extra: Mapping[str, Any], name: str) -> str | None:
    value = extra.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"kv_connector_extra_config.{name} must be a non-empty string, not {value!r}")
    return value


def _positive_float(extra: Mapping[str, Any], name: str, default: float, *,
                    allow_zero: bool = False) -> float:
    value = extra.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"kv_connector_extra_config.{name} must be a number, not {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise InvalidArgument(f"kv_connector_extra_config.{name} must be positive, not {value!r}")
    return float(value)


def check_hash_algorithm(config: AdapterConfig, environ: Mapping[str, str] | None = None,
                         engine_algo: str | None = None) -> None:
    """Raise ``HashAlgorithmError`` when this engine's keys could never match another process's."""
    env = os.environ if environ is None else environ
    if engine_algo is not None and engine_algo != config.hash_algo:
        raise HashAlgorithmError(
            f"vLLM hashes prefix blocks with {engine_algo!r} but kv_connector_extra_config.hash_algo "
            f"is {config.hash_algo!r}; add \"hash_algo\": \"{engine_algo}\" to "
            "kv_connector_extra_config so the namespace names the hash its keys use")
    if config.hash_algo in SEEDED_HASHES and env.get("PYTHONHASHSEED") is None:
        raise HashAlgorithmError(
            f"--prefix-caching-hash-algo {config.hash_algo} draws a random seed per process unless "
            "PYTHONHASHSEED is set, so no other engine (and no restart of this one) could ever "
            "hit the blocks it stores in hisparsed. Fix: start every engine sharing this node "
            "with the same PYTHONHASHSEED (e.g. PYTHONHASHSEED=0), or use "
            "--prefix-caching-hash-algo sha256 (vLLM's default)")


def check_key(key: bytes, config: AdapterConfig) -> None:
    """Catch a hash algorithm the config does not name, from the first key the scheduler shows us."""
    if len(key) != config.key_bytes:
        family = {16 + GROUP_INDEX_BYTES: "xxhash or xxhash_cbor",
                  32 + GROUP_INDEX_BYTES: "sha256 or sha256_cbor"}.get(len(key), "an unknown hash")
        raise HashAlgorithmError(
            f"vLLM's offload keys are {len(key)} bytes ({family}), but "
            f"kv_connector_extra_config.hash_algo is {config.hash_algo!r} ({config.key_bytes}-byte "
            "keys); set hash_algo to the engine's --prefix-caching-hash-algo")
