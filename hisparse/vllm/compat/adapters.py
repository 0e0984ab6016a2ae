"""The manager and worker classes the spec builds on this vLLM release.

0.34 gets the adapter's own classes; releases whose scheduler never takes
the manager's lock get ``locking.SelfLockingManager``, and releases that hand
the worker block-id specs get ``blockspecs.BlockSpecWorker``.
"""

from __future__ import annotations

from hisparse.vllm.compat import FEATURES
from hisparse.vllm.compat.blockspecs import BlockSpecWorker
from hisparse.vllm.compat.locking import SelfLockingManager
from hisparse.vllm.manager import HiSparseOffloadingManager
from hisparse.vllm.worker import HiSparseOffloadingWorker


def manager_class() -> type[HiSparseOffloadingManager]:
    if FEATURES.scheduler_takes_lock and FEATURES.reset_flushed:
        return HiSparseOffloadingManager
    return SelfLockingManager


def worker_class() -> type[HiSparseOffloadingWorker]:
    return HiSparseOffloadingWorker if FEATURES.device_pointers else BlockSpecWorker
