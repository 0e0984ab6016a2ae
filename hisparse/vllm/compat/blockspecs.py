"""The worker for releases that hand it block-id ``GPULoadStoreSpec``s (0.32, 0.33).

0.34's connector resolves a job's device blocks into ``DevicePointers``
before calling the worker; before 0.34 the worker gets the spec and resolves
it here, against the KV caches it was built with, with 0.34's own code
(``backports.resolve_device_pointers``). Then the job runs as on 0.34.

A failed job stops such an engine (0.32 and 0.33 assert that every job
succeeded), so a job is reported failed only when succeeding would be wrong:

- a store whose fence was lost (the daemon restarted, or the session's lease
  ran out, before or during its copy) is reported done: its session is gone,
  so the daemon refuses its commit and nobody ever reads those pages;
- a load that cannot be served (a page the scheduler no longer holds, or a
  fence lost before the copy finished) and a copy that failed on a live
  session are reported failed: vLLM would otherwise run the request on KV
  nobody wrote. These are the faults that stop the engine (docs/vllm.md).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.kv_offload.base import LoadStoreSpec, TransferResult

from hisparse.errors import LeaseExpired
from hisparse.vllm.compat.backports import resolve_device_pointers
from hisparse.vllm.transfer import check_fence
from hisparse.vllm.worker import HiSparseOffloadingWorker

log = logging.getLogger(__name__)


class BlockSpecWorker(HiSparseOffloadingWorker):
    """``HiSparseOffloadingWorker`` behind the block-id worker interface of 0.32 and 0.33."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._store_fences: dict[int, str | None] = {}  # store job id -> its fence, until finished

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: LoadStoreSpec) -> bool:  # type: ignore[override]
        self._store_fences[job_id] = getattr(dst_spec, "fence_path", None)
        return super().submit_store(job_id, resolve_device_pointers(src_spec, self.kv_caches), dst_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: Any,  # type: ignore[override]
                    expedited: bool = False) -> bool:
        return super().submit_load(job_id, src_spec, resolve_device_pointers(dst_spec, self.kv_caches),
                                   expedited)

    def get_finished(self) -> list[TransferResult]:
        results = super().get_finished()
        for i, result in enumerate(results):
            fence = self._store_fences.pop(result.job_id, None)
            if not result.success and fence is not None and _lost(fence):
                log.warning("hisparse store job %d lost its fence: nothing stored, its commit is "
                            "refused; reported done because this vLLM stops on a failed job", result.job_id)
                results[i] = TransferResult(job_id=result.job_id, success=True)
        return results


def _lost(fence_path: str) -> bool:
    try:
        check_fence(fence_path, "store result")
    except LeaseExpired:
        return True
    return False
