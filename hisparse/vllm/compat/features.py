"""What one vLLM release's offloading interface has: the facts the adapter branches on.

Each supported release has a module beside this one (``v0_32``, ``v0_33``,
``v0_34``) that fills one ``Features``; nothing else in ``hisparse.vllm``
asks which vLLM it runs on. Each flag names the first release that has it,
read from that release's ``vllm/v1/kv_offload/base.py`` and its
``OffloadingConnector`` (``distributed/kv_transfer/kv_connector/v1/offloading``).
"""

from __future__ import annotations

from dataclasses import dataclass


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is outside the range the OffloadingConnector adapter supports."""


@dataclass(frozen=True)
class Features:
    # The release, as "major.minor".
    release: str
    # ConfigInfo / ConfigInfoMapping and the spec's config_info_keys (0.33): the info metric.
    config_info: bool
    # The scheduler enters OffloadingManager.lock around every call (0.33). Before that it
    # never does, so the manager takes its own lock in each call (compat.locking).
    scheduler_takes_lock: bool
    # OffloadingManager.on_reset_flushed (0.33). Before that the manager runs it itself
    # once the steps that flush the reset's jobs have gone by (compat.locking).
    reset_flushed: bool
    # OffloadingGroupConfig.sliding_window_size_in_chunks (0.33).
    sliding_window_in_chunks: bool
    # OffloadingEvent fields beyond keys / medium / removed / removal_expected.
    event_fields: frozenset[str]
    # The worker gets DevicePointers (0.34); before, block-id GPULoadStoreSpecs that it
    # resolves itself against the KV caches it was built with (compat.worker).
    device_pointers: bool
    # A failed transfer job stops the engine (an assert in vLLM's connector worker, before
    # 0.34) instead of failing one request's load into a recompute.
    failed_job_stops_engine: bool
