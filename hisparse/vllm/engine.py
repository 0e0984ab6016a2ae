"""What the adapter checks on, and sets in, the engine's ``VllmConfig`` at start.

vLLM hands an offloading spec only its ``OffloadingConfig``. Two engine
settings still matter, and both are checked while the spec is built, before
the engine serves a request:

- ``--prefix-caching-hash-algo`` must be the ``hash_algo`` the namespace was
  derived with (``config.check_hash_algorithm``), or no key would ever match.
- ``kv_load_failure_policy``: a load from hisparsed can still fail after its
  HIT (the daemon restarted mid-copy and the pages' fence was lost). vLLM's
  default policy, ``"fail"``, ends such a request with an error; with
  ``"recompute"`` the scheduler recomputes the blocks instead. The spec sets
  ``"recompute"`` on the scheduler's config (that is where vLLM reads it,
  right after the connector is built) and logs that it did.

Where the config is: on the workers vLLM sets its "current" config around
their start-up (``get_current_vllm_config_or_none``). The scheduler builds
its connector without one, so there the spec takes the ``vllm_config`` the
calling ``OffloadingConnector.__init__`` holds (a few frames up the stack).
When neither is found (a spec built by hand, as in unit tests), the checks
fall back to the first key the scheduler shows the manager
(``config.check_key``).

``sync_load_budget_bytes`` is refused at start: vLLM runs a sync load's
request in the same step, so a sync load that fails cannot be recomputed
and vLLM 0.34 raises in the worker, which stops the engine.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any

from hisparse.errors import InvalidArgument
from hisparse.vllm.config import AdapterConfig, check_hash_algorithm

log = logging.getLogger(__name__)

CALLER_FRAMES = 8  # OffloadingConnector.__init__ -> create_spec -> spec.__init__ -> here


def find_vllm_config() -> Any | None:
    """The engine's ``VllmConfig``: vLLM's current one, else the calling connector's; None if neither."""
    try:
        from vllm.config import VllmConfig, get_current_vllm_config_or_none
    except ImportError:  # vLLM installed without its dependencies: nothing to check against
        return None
    current = get_current_vllm_config_or_none()
    if current is not None:
        return current
    frame = sys._getframe(1)
    for _ in range(CALLER_FRAMES):
        if frame is None:
            break
        candidate = frame.f_locals.get("vllm_config")
        if isinstance(candidate, VllmConfig):
            return candidate
        frame = frame.f_back
    return None


def check_extra_config(extra: Mapping[str, Any]) -> None:
    """vLLM's own keys of ``kv_connector_extra_config`` that this tier cannot honour safely."""
    budget = extra.get("sync_load_budget_bytes", 0)
    if budget:
        raise InvalidArgument(
            f"kv_connector_extra_config.sync_load_budget_bytes is {budget!r}: remove it (or set 0) "
            "for HiSparseOffloadingSpec. A sync load runs its request in the same step, so vLLM "
            "cannot recompute one that fails; a hisparsed restart during the copy would stop the engine")


def prepare_engine(adapter: AdapterConfig, vllm_config: Any | None) -> None:
    """Check the hash algorithm and make load failures recompute, when the engine's config is known."""
    if vllm_config is None:
        check_hash_algorithm(adapter)  # the environment part; the key length is checked at the first lookup
        return
    check_hash_algorithm(adapter, engine_algo=str(vllm_config.cache_config.prefix_caching_hash_algo))
    transfer = vllm_config.kv_transfer_config
    if transfer is not None and transfer.kv_load_failure_policy != "recompute":
        log.warning("hisparse: setting kv_load_failure_policy %r -> 'recompute': a KV load that "
                    "cannot be served (hisparsed restarted mid-copy) is recomputed instead of ending "
                    "its request with an error", transfer.kv_load_failure_policy)
        transfer.kv_load_failure_policy = "recompute"
