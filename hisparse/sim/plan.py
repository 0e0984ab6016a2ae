"""Capacity model: how many requests a node runs at once, with and without
the sparse tier, how much host memory that takes, and the PCIe time each
decode step pays for it. docs/planner.md derives every formula.

Two modes:

- ``full`` (full residency): a running request keeps all its KV rows and
  indexer keys in HBM; host memory only parks idle sessions.
- ``hisparse``: a running request keeps its indexer keys, ``hot_rows`` hot
  rows per layer and its active tail in HBM; its older rows live in host
  memory and the rows the indexer selects are pulled in when they miss.

MLA's KV is one latent per token, so tensor parallelism cannot split it:
every TP rank holds the whole KV of every request it serves. The KV budget
of one GPU is therefore the KV budget of its whole replica.

``main(argv)`` is ``hisparse plan``; the command line lives in plan_cli.
"""

from __future__ import annotations

from dataclasses import dataclass

from hisparse.sim.presets import (
    INDEXER_ROW_BYTES,
    KV_ROW_BYTES,
    EngineConfig,
    HostConfig,
    ModelPreset,
    NodeSpec,
    PerfModel,
    Workload,
)

MODES = ("full", "hisparse")


def kv_row_bytes(engine: EngineConfig) -> int:
    return KV_ROW_BYTES[engine.kv_format]


def mla_layers(model: ModelPreset, engine: EngineConfig) -> int:
    """Layers with a KV row per token: the model's plus the MTP drafter's."""
    return model.num_layers + (model.mtp_layers if engine.mtp_depth > 0 else 0)


def indexer_layers(model: ModelPreset, engine: EngineConfig) -> int:
    return model.indexer_layers + (model.mtp_layers if engine.mtp_depth > 0 else 0)


def mla_bytes_per_token(model: ModelPreset, engine: EngineConfig) -> int:
    return mla_layers(model, engine) * kv_row_bytes(engine)


def indexer_bytes_per_token(model: ModelPreset, engine: EngineConfig) -> int:
    return indexer_layers(model, engine) * INDEXER_ROW_BYTES


def full_bytes_per_token(model: ModelPreset, engine: EngineConfig) -> int:
    return mla_bytes_per_token(model, engine) + indexer_bytes_per_token(model, engine)


def weight_bytes_per_gpu(model: ModelPreset, node: NodeSpec, engine: EngineConfig) -> int:
    """TP splits the non-expert weights within a replica; experts are split
    over every GPU of the node (TP inside one replica, EP across replicas)."""
    if engine.tp * engine.dp != node.gpus:
        raise ValueError(f"tp*dp = {engine.tp}*{engine.dp} != {node.gpus} GPUs")
    expert_bytes = model.weight_bytes - model.replicated_weight_bytes
    return model.replicated_weight_bytes // engine.tp + expert_bytes // node.gpus


def kv_budget_bytes(model: ModelPreset, node: NodeSpec, engine: EngineConfig) -> int:
    """HBM left for KV on one GPU: vLLM's share minus weights and workspace."""
    budget = int(engine.gpu_memory_utilization * node.hbm_bytes)
    return budget - weight_bytes_per_gpu(model, node, engine) - engine.workspace_bytes


def prompt_tokens(workload: Workload, turn: int) -> int:
    """Prompt of turn ``turn`` (0-based): it holds every earlier turn and reply."""
    return workload.first_turn_tokens + turn * workload.turn_increment_tokens


def final_tokens(workload: Workload) -> int:
    """KV tokens of a session at the end of its last turn."""
    return prompt_tokens(workload, workload.turns - 1) + workload.output_tokens


def mean_turn_tokens(workload: Workload) -> float:
    """KV tokens of a running turn, averaged over turns (prompt + half the reply)."""
    total = sum(prompt_tokens(workload, k) for k in range(workload.turns))
    return total / workload.turns + workload.output_tokens / 2


def request_hbm_bytes(model: ModelPreset, engine: EngineConfig, tokens: int, mode: str) -> int:
    """HBM one running request of ``tokens`` KV tokens holds on each GPU."""
    if mode == "full":
        return tokens * full_bytes_per_token(model, engine)
    if mode == "hisparse":
        # Hot rows are rows of every layer, like any KV row.
        hot = engine.hot_rows * mla_bytes_per_token(model, engine)
        tail = min(tokens, engine.tail_tokens) * mla_bytes_per_token(model, engine)
        return tokens * indexer_bytes_per_token(model, engine) + hot + tail
    raise ValueError(f"unknown mode {mode!r}")


def request_cold_bytes(model: ModelPreset, engine: EngineConfig, tokens: int) -> int:
    """Host bytes of a running hisparse request: every row older than its tail."""
    return max(0, tokens - engine.tail_tokens) * mla_bytes_per_token(model, engine)


def h2d_bytes_per_step(model: ModelPreset, engine: EngineConfig, perf: PerfModel) -> float:
    """Bytes one running request pulls from host per decode step, per GPU.

    The step's query rows (1 + MTP drafts) select a union of about
    ``topk * (1 + mtp * novelty)`` distinct rows per layer; ``miss_rate`` of
    them are neither resident nor hot. Every TP rank pulls them over its own
    link, since each rank holds the whole latent.
    """
    distinct_rows = model.topk_rows * (1 + engine.mtp_depth * perf.draft_novelty)
    return perf.miss_rate * distinct_rows * mla_bytes_per_token(model, engine)


@dataclass(frozen=True)
class Capacity:
    """Closed-form answer for one layout at one request size (node-wide counts)."""

    tokens: int
    weight_bytes_per_gpu: int
    kv_budget_bytes: int                  # per GPU = per replica
    full_request_bytes: int               # HBM per request, full residency
    full_running: int
    hisparse_request_bytes: int           # HBM per request, hisparse
    hisparse_hbm_running: int             # bound by HBM
    cold_request_bytes: int               # host per running hisparse request
    hisparse_host_running: int            # bound by the sparse host pool
    hisparse_running: int
    full_host_bytes_needed: int           # every session parked
    hisparse_host_bytes_needed: int
    h2d_bytes_per_step: float             # per running request, per GPU
    h2d_s_per_step: float                 # per GPU, all its requests at hisparse_running


def capacity(model: ModelPreset, node: NodeSpec, engine: EngineConfig, perf: PerfModel,
             tokens: int, host: HostConfig, users: int) -> Capacity:
    """Running requests of ``tokens`` KV tokens each, ``users`` sessions in all."""
    budget = kv_budget_bytes(model, node, engine)
    full_req = request_hbm_bytes(model, engine, tokens, "full")
    hs_req = request_hbm_bytes(model, engine, tokens, "hisparse")
    cold = request_cold_bytes(model, engine, tokens)
    parked = tokens * full_bytes_per_token(model, engine)
    full_running = engine.dp * max(0, budget // full_req)
    hbm_running = engine.dp * max(0, budget // hs_req)
    # One pool holds running and parked sessions alike; a split host gives
    # the running requests only the sparse pool.
    pool = host.park_bytes if host.one_pool else host.sparse_bytes
    pools = 1 if host.shared else engine.dp
    host_running = pools * ((pool // pools) // cold) if cold else hbm_running
    running = min(hbm_running, host_running)
    if host.one_pool:
        hs_host_needed = users * parked
    else:
        hs_host_needed = min(running, users) * cold + users * parked
    per_gpu_requests = -(-min(running, users) // engine.dp)
    step_bytes = h2d_bytes_per_step(model, engine, perf)
    return Capacity(
        tokens=tokens, weight_bytes_per_gpu=weight_bytes_per_gpu(model, node, engine),
        kv_budget_bytes=budget, full_request_bytes=full_req, full_running=full_running,
        hisparse_request_bytes=hs_req, hisparse_hbm_running=hbm_running,
        cold_request_bytes=cold, hisparse_host_running=host_running,
        hisparse_running=running, full_host_bytes_needed=users * parked,
        hisparse_host_bytes_needed=hs_host_needed, h2d_bytes_per_step=step_bytes,
        h2d_s_per_step=per_gpu_requests * step_bytes / node.h2d_bytes_per_s)
