"""vLLM 0.34: the interface the adapter is written against; nothing to bridge."""

from __future__ import annotations

from hisparse.vllm.compat.features import Features

FEATURES = Features(release="0.34", config_info=True, scheduler_takes_lock=True, reset_flushed=True,
                    sliding_window_in_chunks=True,
                    event_fields=frozenset({"metadata_only", "req_context"}), device_pointers=True,
                    failed_job_stops_engine=False)
