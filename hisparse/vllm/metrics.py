"""The hisparse tier's Prometheus metrics, as vLLM's ``OffloadingConnector`` publishes them.

``metric_definitions`` is what the spec declares (``build_metric_definitions``);
``to_connector_stats`` turns the manager's counters into the
``OffloadingConnectorStats`` vLLM collects each step (``get_stats``).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
)


class HiSparseMetrics:
    USAGE_PERC = "vllm:kv_offload_hisparse_usage_perc"
    LOOKUP_HITS = "vllm:kv_offload_hisparse_lookup_hits"
    LOOKUP_MISSES = "vllm:kv_offload_hisparse_lookup_misses"
    PIN_FAILURES = "vllm:kv_offload_hisparse_pin_failures"
    ALLOCATION_FAILURES = "vllm:kv_offload_hisparse_allocation_failures"
    EVICTED_KEYS = "vllm:kv_offload_hisparse_evicted_keys"
    COUNTERS = ("LOOKUP_HITS", "LOOKUP_MISSES", "PIN_FAILURES", "ALLOCATION_FAILURES", "EVICTED_KEYS")


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    return {
        HiSparseMetrics.USAGE_PERC: OffloadingGaugeMetadata(
            documentation="Fraction of the hisparse namespace's pages holding committed KV, "
                          "as this engine's key mirror sees it (all engines of the namespace)."),
        HiSparseMetrics.LOOKUP_HITS: OffloadingCounterMetadata(
            documentation="Offload keys found committed in hisparsed."),
        HiSparseMetrics.LOOKUP_MISSES: OffloadingCounterMetadata(
            documentation="Offload keys not found in hisparsed."),
        HiSparseMetrics.PIN_FAILURES: OffloadingCounterMetadata(
            documentation="Keys vLLM loaded without holding them (a pin lost with a hisparsed "
                          "restart); their load failed and vLLM recomputed them."),
        HiSparseMetrics.ALLOCATION_FAILURES: OffloadingCounterMetadata(
            documentation="Stores refused: no evictable page left, or hisparsed unreachable."),
        HiSparseMetrics.EVICTED_KEYS: OffloadingCounterMetadata(
            documentation="Keys hisparsed evicted to make room for this engine's stores."),
    }


def to_connector_stats(snapshot: dict[str, Any]) -> Any:
    """vLLM's ``OffloadingConnectorStats`` of a manager snapshot; None where vLLM has no metrics stack."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )
    except ImportError:  # a vLLM installed without its dependencies
        return None
    stats = OffloadingConnectorStats()
    stats.set_gauge(HiSparseMetrics.USAGE_PERC, snapshot["usage_perc"])
    for name in HiSparseMetrics.COUNTERS:
        stats.increase_counter(getattr(HiSparseMetrics, name), snapshot[name.lower()])
    return stats
