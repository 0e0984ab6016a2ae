"""vLLM 0.33, read from its source (no engine of it runs in the tests: no CPU build).

Like 0.34 on the scheduler side (ConfigInfo, ``lock`` taken by the
scheduler, ``on_reset_flushed``, ``sliding_window_size_in_chunks``,
``OffloadingEvent.metadata_only``, but no ``req_context``); like 0.32 on the
worker side (block-id ``GPULoadStoreSpec``s; a failed job stops the engine).
"""

from __future__ import annotations

from hisparse.vllm.compat.features import Features

FEATURES = Features(release="0.33", config_info=True, scheduler_takes_lock=True, reset_flushed=True,
                    sliding_window_in_chunks=True, event_fields=frozenset({"metadata_only"}),
                    device_pointers=False, failed_job_stops_engine=True)
