"""hisparse's vLLM plugin: installs the node pool hook before vLLM builds a worker.

Registered in ``pyproject.toml`` as the ``vllm.general_plugins`` entry point
``hisparse``; vLLM calls ``register`` in every process it starts (engine
core and each worker, ``load_general_plugins``), before any KV cache is
initialised. It only wraps vLLM's HiSparse host-pool lookup
(``worker_pool.install_hook``): engines not configured with
``hisparse.vllm.hisparse_connector.HiSparseConnector`` get vLLM's own pool,
unchanged. Without vLLM installed it does nothing.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def register() -> None:
    """vLLM's plugin entry point (idempotent)."""
    try:
        from hisparse.vllm.worker_pool import install_hook

        install_hook()
    except ImportError as exc:  # vLLM without its HiSparse runtime: nothing to hook
        log.debug("hisparse vLLM plugin: not installing the host pool hook (%s)", exc)
