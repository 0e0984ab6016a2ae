"""hisparsed as SGLang's host tier: a HiCache storage backend and a unified-cache linker.

SGLang loads both by module path (see docs/sglang.md)::

    --hicache-storage-backend dynamic --hicache-host-memory-mode buffer_only
    --hicache-storage-backend-extra-config '{"backend_name":"hisparse",
      "module_path":"hisparse.sglang.store","class_name":"HisparseStore","interface_v1":1}'

SGLang itself is imported on first use of an attribute, so ``import
hisparse.sglang`` works where SGLang is not installed.
"""

from __future__ import annotations

from hisparse._lazy import lazy_exports

_EXPORTS = {
    "HisparseStore": "hisparse.sglang.store",
    "HisparseLinker": "hisparse.sglang.linker",
    "SglangConfig": "hisparse.sglang.config",
    "check_sglang_version": "hisparse.sglang.versions",
    "UnsupportedSglangVersion": "hisparse.sglang.versions",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
