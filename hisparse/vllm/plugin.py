"""hisparse's vLLM plugin: installs the node pool hook before vLLM builds a worker.

Registered in ``pyproject.toml`` as the ``vllm.general_plugins`` entry point
``hisparse``; vLLM calls ``register`` in every process it starts (engine
core and each worker, ``load_general_plugins``), before any KV cache is
initialised, whether or not the engine uses hisparse. So ``register`` never
raises and never changes an engine that does not use hisparse, on any vLLM:
it only wraps vLLM's HiSparse host-pool lookup (``worker_pool.install_hook``),
and only on the vLLM that path was tested with (``versions``); engines not
configured with ``hisparse.vllm.hisparse_connector.HiSparseConnector`` get
vLLM's own pool, unchanged. Elsewhere (another vLLM, no vLLM) it does nothing.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def register() -> None:
    """vLLM's plugin entry point (idempotent; never raises)."""
    try:
        from hisparse.vllm.versions import TESTED_VLLM_VERSIONS, installed_vllm_version

        version = installed_vllm_version()
        if version.split("+")[0] not in TESTED_VLLM_VERSIONS:
            # vLLM's HiSparse runtime differs there (0.32 has no get_hisparse_host_pool):
            # nothing to hook, and HiSparseConnector refuses this vLLM by name at start.
            log.debug("hisparse vLLM plugin: vLLM %s, no host pool hook", version)
            return
        from hisparse.vllm.worker_pool import install_hook

        install_hook()
    except Exception as exc:  # an error here would stop every engine, hisparse or not
        log.warning("hisparse vLLM plugin: host pool hook not installed (%s: %s); engines without "
                    "hisparse's HiSparseConnector are unaffected", type(exc).__name__, exc)
