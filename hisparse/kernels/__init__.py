"""The fused sparse-tier resolver: ``resolve`` (Triton) and ``resolve_reference`` (torch).

docs/design.md, "Sparse tier", is the contract; ``reference.py`` is its executable
definition, ``resolve.py`` the Triton kernel, ``unfused.py`` the torch
baseline that benchmarks compare against, ``equiv.py`` the equivalence check.

Importing this package needs no GPU and does not import Triton: ``resolve``
loads it on first call. Triton picks interpreter or compiler when it is first
imported, so on a machine without a GPU ``TRITON_INTERPRET=1`` must be set
before that.
"""

from __future__ import annotations

import importlib
from typing import Any

try:
    import torch
except ImportError as _exc:
    from hisparse.extras import missing

    raise missing("torch", "hisparse.kernels (the sparse resolver)") from _exc

from hisparse.kernels.reference import resolve_reference

__all__ = ["resolve", "resolve_reference"]


def resolve(**kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton resolver: same keyword arguments and results as ``resolve_reference``.

    Also takes ``out=(phys_rows, counters)``, preallocated contiguous outputs,
    so that a launch allocates nothing (CUDA-graph capture), and the tuning
    knobs ``copy_rows`` and ``num_warps``.
    """
    impl = importlib.import_module("hisparse.kernels.resolve")
    # Loading the submodule binds it to this package's attribute "resolve",
    # the name of this function: bind the function back.
    globals()["resolve"] = _entry
    return impl.resolve(**kwargs)


_entry = resolve
