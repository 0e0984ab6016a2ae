"""hisparse: a per-node KV-cache tier for sparse-attention LLM serving.

``hisparsed`` owns the node's host memory for KV pages; engines attach with
``hisparse.client.attach()``. See docs/design.md for the contract.
"""

from __future__ import annotations

import importlib
from typing import Any

from hisparse.errors import (
    CapacityError,
    ClusterUnavailable,
    DaemonUnavailable,
    HisparseError,
    InvalidArgument,
    LayoutMismatch,
    LeaseExpired,
    MissingExtra,
    PermissionDenied,
    ProtocolError,
    QuotaExceeded,
    Timeout,
)
from hisparse.layout import KVLayout, format_size, parse_size

__version__ = "0.1.0"

# Submodules that pull in torch (client, kernels) load on first use, so that
# `import hisparse` stays cheap for the daemon and the CLI.
_LAZY = ("client", "kernels", "sim", "vllm")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return importlib.import_module(f"hisparse.{name}")
    raise AttributeError(f"module 'hisparse' has no attribute {name!r}")


__all__ = [
    "CapacityError",
    "ClusterUnavailable",
    "DaemonUnavailable",
    "HisparseError",
    "InvalidArgument",
    "KVLayout",
    "LayoutMismatch",
    "LeaseExpired",
    "MissingExtra",
    "PermissionDenied",
    "ProtocolError",
    "QuotaExceeded",
    "Timeout",
    "format_size",
    "parse_size",
]
