"""hisparsed as the tier of vLLM's ``OffloadingConnector`` (vLLM 0.34's ``vllm.v1.kv_offload``).

vLLM loads ``HiSparseOffloadingSpec`` from here by name::

    --kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",
      "kv_connector_extra_config":{"spec_name":"HiSparseOffloadingSpec",
      "spec_module_path":"hisparse.vllm"}}'

vLLM itself is imported on first use of an attribute, so ``import
hisparse.vllm`` works (and ``hisparse`` never pulls vLLM in) where vLLM is
not installed. See docs/vllm.md.
"""

from __future__ import annotations

from hisparse._lazy import lazy_exports

_EXPORTS = {
    "HiSparseOffloadingSpec": "hisparse.vllm.spec",
    "HiSparseOffloadingManager": "hisparse.vllm.manager",
    "HiSparseOffloadingWorker": "hisparse.vllm.worker",
    "AdapterConfig": "hisparse.vllm.config",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
