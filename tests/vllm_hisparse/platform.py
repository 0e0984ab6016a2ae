"""The CPU platform shim vLLM's HiSparse config needs on a machine without a GPU.

``VllmConfig`` refuses HiSparse on a platform without a HiSparse backend or
without the hybrid KV cache manager; the CPU-only ``UnspecifiedPlatform``
has neither. ``install`` gives it both (two classmethods), with a backend
whose ``pin_tensor``/``unpin_tensor`` record the ranges they are given
instead of calling ``cudaHostRegister``. Everything else is vLLM's own.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.hisparse.backend import HiSparseBackend


class RecordingBackend(HiSparseBackend):
    """A HiSparse backend for CPU tests: host registrations are recorded, not made."""

    supports_shared_host_pool = False
    pinned: list[tuple[int, int]] = []

    def check_available(self) -> None:
        return

    def pin_tensor(self, tensor: torch.Tensor) -> None:
        RecordingBackend.pinned.append((tensor.data_ptr(), tensor.nbytes))

    def unpin_tensor(self, tensor: torch.Tensor) -> None:
        RecordingBackend.pinned.remove((tensor.data_ptr(), tensor.nbytes))

    def create_cache_ops(self, runtime: Any) -> Any:
        raise NotImplementedError("HiSparse's kernels need CUDA")


def install() -> None:
    """Patch the current platform's two classmethods (idempotent)."""
    from vllm.platforms import current_platform

    cls = type(current_platform)
    cls.get_hisparse_backend_cls = classmethod(
        lambda c: "tests.vllm_hisparse.platform.RecordingBackend")
    cls.support_hybrid_kv_cache = classmethod(lambda c: True)
