"""The model runner's step loop around vLLM's connector, for ``worker_side``'s started worker.

``ModelLoop.execute`` is ``GPUModelRunner.execute_model`` as far as the KV
connector sees it: the block tables and slot mappings from the scheduler's
output (vLLM computes them with a Triton kernel; here in Python from the
same block ids), the input batch, ``ActiveKVConnector.pre_forward`` inside
vLLM's forward context, the model's KV writes (``worker_side`` docstring),
``finish_forward``, ``post_forward``. ``engine_step`` / ``drive`` run it
with vLLM's real ``Scheduler`` (``real_engine.Engine``), one loop per
simulated TP rank, worker outputs aggregated as vLLM's executor does.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from tests.vllm_hisparse.worker_side import BLOCK, Started, rows_of


def fd_holds_flock(fd: int) -> bool:
    """Whether the open file behind ``fd`` holds a ``flock`` (the kernel's own word: /proc/self/fdinfo)."""
    with open(f"/proc/self/fdinfo/{fd}") as f:
        return any(line.startswith("lock:") and "FLOCK" in line for line in f)


class ModelLoop:
    """The model runner's step for the connector: block tables, input batch, KV writes, connector calls.

    ``execute(scheduler_output)`` does what ``GPUModelRunner.execute_model``
    does around the connector (``ActiveKVConnector.pre_forward`` with the
    input batch, the forward inside vLLM's forward context, ``finish_forward``,
    ``post_forward``) and returns the step's ``KVConnectorOutput``. Every copy
    into the region checks that the worker holds the step's fences.
    """

    def __init__(self, started: Started, tokens_of: Any, log: Any, rank: Any = None) -> None:
        from vllm.v1.kv_cache_interface import HiSparseResidentSpec

        self.started = started
        self.tokens_of = tokens_of  # request id -> its token ids so far
        self.config = started.runner.kv_cache_config
        groups = self.config.kv_cache_groups
        (self.source_gid,) = self.config.host_group_ids
        self.resident_gids = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiSparseResidentSpec)]
        self.rows: dict[str, int] = {}
        self.blocks: dict[str, list[list[int]]] = {}
        self.fence_paths: tuple[str, ...] = ()
        self.unfenced_copies = 0
        self.region_copies = 0
        self.scheduled: dict[str, int] = {}  # tokens each request had computed by the model
        self.restored: list[bool] = []  # per restore transfer: the resident page equals its host page
        pool = started.connector.worker_pool
        self.region = pool.client.session.region
        self.row_bytes = pool.geometry.layout.row_bytes
        self.log = log
        self.rank = rank  # cpu_device.TpGroup of a simulated TP rank, or None
        log.on_copy = self._check_fenced

    def execute_as_rank(self, out: Any) -> Any:
        """``execute`` with vLLM's TP group and this rank's connector current."""
        if self.rank is None:
            return self.execute(out)
        from vllm.distributed import parallel_state
        from vllm.distributed.kv_transfer import kv_transfer_state

        parallel_state._TP = self.rank
        kv_transfer_state._KV_CONNECTOR_AGENT = self.started.agent
        self.log.rank = self.rank.rank_in_group
        return self.execute(out)

    def _check_fenced(self, dst: int, size: int, rank: int) -> None:
        start = self.region.address
        if not (start <= dst < start + self.region.geometry.size_bytes):
            return
        self.region_copies += 1
        held = self.started.connector._worker_fences._open
        if not self.fence_paths or any(p not in held or not fd_holds_flock(held[p][0]) for p in self.fence_paths):
            self.unfenced_copies += 1

    def _track(self, out: Any) -> None:
        for req in out.scheduled_new_reqs:
            self.blocks[req.req_id] = [list(ids) for ids in req.block_ids]
            self.rows[req.req_id] = min(set(range(64)) - set(self.rows.values()))
        cached = out.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            new = cached.new_block_ids[index]
            if new is None:
                continue
            for have, ids in zip(self.blocks[req_id], new):
                have.extend(ids)

    def execute(self, out: Any) -> Any:
        from vllm.forward_context import set_forward_context

        self.log.on_copy = self._check_fenced
        self._track(out)
        runner = self.started.runner
        req_ids = list(out.num_scheduled_tokens)
        counts = [out.num_scheduled_tokens[r] for r in req_ids]
        num_tokens = sum(counts)
        for r, n in zip(req_ids, counts):
            self.scheduled[r] = self.scheduled.get(r, 0) + n
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        computed.update(zip(out.scheduled_cached_reqs.req_ids, out.scheduled_cached_reqs.num_computed_tokens))
        positions = [(b, r, computed[r] + i) for b, (r, n) in enumerate(zip(req_ids, counts)) for i in range(n)]
        slots = runner.block_tables.slot_mappings
        slots.fill_(-1)
        for gid in (self.source_gid, *self.resident_gids):
            for t, (_, r, pos) in enumerate(positions):
                slots[gid, t] = self.blocks[r][gid][pos // BLOCK] * BLOCK + pos % BLOCK
        req_id_per_token = torch.tensor([b for b, _, _ in positions], dtype=torch.int32)
        decode = bool(counts) and all(n == 1 for n in counts)
        meta = SimpleNamespace(num_actual_tokens=num_tokens, num_decode_tokens=num_tokens if decode else 0,
                               max_query_len=max(counts, default=0), num_reqs=len(req_ids),
                               req_id_per_token=req_id_per_token)
        attn_metadata = {name: meta for name in self.started.layers}
        batch = SimpleNamespace(idx_mapping=torch.tensor([self.rows[r] for r in req_ids], dtype=torch.int32),
                                req_ids=req_ids, num_tokens=num_tokens)
        connector = runner.kv_connector
        meta = out.kv_connector_metadata
        meta = meta.metadata[0] if hasattr(meta, "metadata") else meta  # MultiConnector: ours is first
        self.fence_paths = tuple(getattr(meta, "fence_paths", ()))
        with set_forward_context(attn_metadata, self.started.worker.vllm_config):
            connector.pre_forward(out, batch if num_tokens else None, attn_metadata if num_tokens else None)
            restores = [t for t in (meta.command.page_transfers if meta.command else ()) if t.restore]
            self.restored.extend(self._restored_ok(t) for t in restores)
            if num_tokens:
                self._forward(positions)
            connector.finish_forward()
        for req_id in out.finished_req_ids:
            self.rows.pop(req_id, None)
            self.blocks.pop(req_id, None)
        return connector.post_forward(out.finished_req_ids)

    def _forward(self, positions: list[tuple[int, str, int]]) -> None:
        """The model's KV writes: each layer's rows at the resident slots, then vLLM's ``finish_kv_update``."""
        for layer_index, (name, layer) in enumerate(self.started.layers.items()):
            handle = layer.hisparse_cache
            cache = handle.view.cache.view(torch.uint8)
            gid = self.resident_gids[handle.runtime.resident_source_index]
            for _, r, pos in positions:
                token = self.tokens_of(r)[pos]
                block = self.blocks[r][gid][pos // BLOCK]
                cache[block, pos % BLOCK] = torch.from_numpy(rows_of([token], layer_index, self.row_bytes)[0])
            handle.finish_kv_update()

    def _restored_ok(self, transfer: Any) -> bool:
        """Whether a restored page's resident rows, in every layer, are its region page's bytes."""
        pages = self.region.pages_view()
        for layer_index, layer in enumerate(self.started.layers.values()):
            handle = layer.hisparse_cache
            block = transfer.resident_block_ids[handle.runtime.resident_source_index]
            resident = handle.view.cache.view(torch.uint8)[block].numpy().reshape(-1)
            if not np.array_equal(resident, pages[layer_index, transfer.host_block_id, :resident.size]):
                return False
        return True

    def resident_rows(self, req_id: str, page: int, layer_index: int) -> np.ndarray:
        """The bytes of a request's page in one layer's resident (GPU) cache."""
        handle = list(self.started.layers.values())[layer_index].hisparse_cache
        gid = self.resident_gids[handle.runtime.resident_source_index]
        block = self.blocks[req_id][gid][page]
        return handle.view.cache.view(torch.uint8)[block].numpy().reshape(BLOCK, -1)


def engine_step(engine: Any, loops: list[ModelLoop]) -> dict[str, int]:
    """One engine step: vLLM's scheduler, then every (simulated TP) worker; their outputs aggregated."""
    from vllm.v1.outputs import ModelRunnerOutput

    out = engine.scheduler.schedule()
    outputs = [loop.execute_as_rank(out) for loop in loops]
    output = outputs[0]
    metas = [o.kv_connector_worker_meta for o in outputs if o is not None and o.kv_connector_worker_meta]
    if output is not None and metas:
        meta = metas[0]
        for other in metas[1:]:
            meta = meta.aggregate(other)
        output.kv_connector_worker_meta = meta
    requests = engine.scheduler.requests
    ids = list(out.num_scheduled_tokens)
    sampled = [[7] if requests[r].num_computed_tokens + out.num_scheduled_tokens[r]
               >= requests[r].num_tokens else [] for r in ids]
    engine.scheduler.update_from_output(out, ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled,
                                                               kv_connector_output=output))
    return dict(out.num_scheduled_tokens)


def drive(engine: Any, loops: ModelLoop | list[ModelLoop], max_steps: int = 200) -> int:
    """Scheduler and worker(s) until no request or spill is left, plus the step that publishes; steps taken."""
    from tests.waiting import wait_for

    loops = loops if isinstance(loops, list) else [loops]
    for steps in range(1, max_steps + 1):
        engine_step(engine, loops)
        if not engine.scheduler.requests and not engine.coordinator.has_pending_work():
            # Idle steps until the pool has sent its last publishes (build_connector_meta flushes;
            # a daemon request that timed out on a loaded machine leaves them for a later step).
            wait_for(lambda: engine_step(engine, loops) == {} and not engine.pool._to_publish,
                     "the pool's last publishes")
            return steps + 1
    raise AssertionError(f"requests still running after {max_steps} steps")
