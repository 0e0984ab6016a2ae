"""TP ranks of one engine, simulated in one process: who writes each spilled page into the node pool.

Each rank is a started worker (``worker_side.start``) with its own vLLM
config, layers and connector, and vLLM's TP group replaced by a
``cpu_device.TpGroup`` of that rank; one engine step runs the scheduler
once and every rank's ``ModelLoop`` in turn (rank 0 first, as the IPC
events of vLLM's shared pool need), their outputs aggregated.

``one_writer=True`` is how the engine runs: vLLM's planner marks the pool
shared at TP > 1 (``hisparse_shared_host_pool``), and ``RegionHostPool``
presents the region as that shared pool. ``one_writer=False`` is the
baseline before it: no shared pool, every rank a writer.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from tests.vllm_hisparse import cpu_device, worker_side
from tests.vllm_hisparse.model_loop import ModelLoop, drive
from tests.vllm_hisparse.real_engine import Engine, make_configs

NAMESPACE = "vllm-hisparse/tp-sim"


def start_ranks(socket: str, model_dir: str, tp: int, log: Any, tokens_of: Any, *,
                one_writer: bool = True, namespace: str = NAMESPACE) -> list[ModelLoop]:
    from vllm.distributed import parallel_state

    shared: dict[str, Any] = {}
    loops = []
    for rank in range(tp):
        group = cpu_device.TpGroup(rank, tp, shared)
        parallel_state._TP = group
        vllm_config, kv_config = make_configs(socket, model_dir, extensible=True, extra={"namespace": namespace})
        vllm_config.parallel_config.tensor_parallel_size = tp
        kv_config.hisparse_shared_host_pool = one_writer and tp > 1  # vLLM's planner's decision
        log.rank = rank
        started = worker_side.start(vllm_config, kv_config, cudagraphs=True)
        loops.append(ModelLoop(started, tokens_of, log, rank=group))
    return loops


def region_writes(loops: list[ModelLoop], log: Any) -> dict[str, float]:
    """Rows written into the region per distinct row, and ranks writing each page, from the device log."""
    region = loops[0].region
    lay = region.geometry.layout
    base, size = region.address, region.geometry.size_bytes
    layer_bytes = region.geometry.layer_stride_bytes
    page_layer_bytes = lay.block_tokens * lay.row_bytes
    rows_written = 0
    distinct: set[int] = set()
    writers: dict[int, set[int]] = defaultdict(set)
    for rank, _, dst, n in log.copies:
        if not base <= dst < base + size:
            continue
        first = (dst - base) // lay.row_bytes
        rows = range(first, first + n // lay.row_bytes)
        rows_written += len(rows)
        distinct.update(rows)
        for row in (rows[0], rows[-1]):
            offset = row * lay.row_bytes
            writers[(offset % layer_bytes) // page_layer_bytes].add(rank)
    return {"copies_per_row": rows_written / max(1, len(distinct)),
            "writers_per_page": sum(len(w) for w in writers.values()) / max(1, len(writers)),
            "pages": len(writers)}


def run(socket: str, model_dir: str, tp: int, log: Any, prompts: list[list[int]], *,
        one_writer: bool = True, namespace: str = NAMESPACE) -> dict[str, Any]:
    """Serve ``prompts`` on one engine with ``tp`` simulated ranks; the region writes and what B reads."""
    engine = Engine(socket, model_dir, extra={"namespace": namespace})
    loops = start_ranks(socket, model_dir, tp, log, lambda r: engine.scheduler.requests[r].all_token_ids,
                        one_writer=one_writer, namespace=namespace)
    try:
        requests = [engine.add(f"r{i}", tokens, max_tokens=8) for i, tokens in enumerate(prompts)]
        drive(engine, loops)
        reader = Engine(socket, model_dir, extra={"namespace": namespace})
        try:
            ok = True
            for request in requests:
                tokens = list(request.all_token_ids)
                pages = reader.host_lookup(tokens)
                ok = ok and len(pages) == (len(tokens) - 1) // 64 and reader.bytes_ok(tokens, pages)
        finally:
            reader.close()
        return {**region_writes(loops, log), "bytes_ok": ok,
                "unfenced": sum(loop.unfenced_copies for loop in loops),
                "published": engine.pool.counters["published"]}
    finally:
        for loop in loops:
            loop.started.agent.shutdown()
        engine.close()
