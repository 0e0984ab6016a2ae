"""The vLLM versions the HiSparse host-pool path was tested against, and the check that enforces them.

``hisparse.vllm.hisparse_connector`` and ``hisparse_pool`` reach into vLLM
internals (``HiSparseSourceManager.block_pool``, ``runtime._host_pools``,
``BlockPool``'s private helpers, the host pool's LBNHC layout) that change
between releases without notice, so an untested vLLM is refused at start
instead of corrupting KV later. The ``OffloadingConnector`` adapter
(``hisparse.vllm.spec``) uses vLLM's public offloading interface and is not
gated here.
"""

from __future__ import annotations

TESTED_VLLM_VERSIONS: tuple[str, ...] = ("0.34.0",)


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is not one the HiSparse host-pool path was tested with."""


def installed_vllm_version() -> str:
    """``vllm.__version__`` (raises ``ImportError`` without vLLM)."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def check_vllm_version(version: str | None = None) -> str:
    """Return the installed vLLM version, or raise ``UnsupportedVllmVersion`` naming the tested ones."""
    if version is None:
        version = installed_vllm_version()
    if version.split("+")[0] not in TESTED_VLLM_VERSIONS:
        raise UnsupportedVllmVersion(
            f"hisparse's HiSparseConnector (hisparse.vllm.hisparse_connector) supports vLLM "
            f"{', '.join(TESTED_VLLM_VERSIONS)} only; this is vLLM {version}. Install a tested vLLM "
            "(pip install 'vllm==" + TESTED_VLLM_VERSIONS[-1] + "') or drop "
            "kv_connector_module_path to run vLLM's own HiSparseConnector with a private host pool")
    return version
