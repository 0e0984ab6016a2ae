"""Inputs of the capacity planner and the simulator: models, node, engine,
workload, performance model, and the named scenarios of ``hisparse plan``.

Every number that is not a published input carries its reasoning here, so
that one file answers "where does this come from". The published inputs
(GLM-5.3 on 8xH200, docs/planner.md) are used as given; the free parameters are ``workspace_bytes``
(EngineConfig) and ``gap_s`` (Workload); the performance numbers are
estimates from hardware rates, stated next to each field.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

MiB = 1 << 20
GiB = 1 << 30

KV_ROW_BYTES = {
    "fp8_ds_mla": 656,  # 512 fp8 latent + 4 fp32 scales + 64 bf16 rope
    "bf16": 1152,       # 576 bf16
}
INDEXER_ROW_BYTES = 132  # 128 fp8 + one fp32 scale per token per indexer layer


@dataclass(frozen=True)
class ModelPreset:
    name: str
    num_layers: int
    indexer_layers: int
    # Whole FP8 checkpoint. GLM-5: ~744B params at 1 B each, plus bf16
    # embeddings/lm_head (~2 GB extra) and block scales: ~750 GB.
    weight_bytes: int
    # The non-expert part (attention, indexer, shared experts, dense layers,
    # embeddings). TP splits it; DP-attention replicates it on every rank.
    # From active = dense + routed * 8/256: 40B = d + (744B - d)/32 -> d ~ 17B,
    # plus the bf16 embedding/lm_head surplus: ~20 GB.
    replicated_weight_bytes: int
    num_experts: int = 256
    experts_per_token: int = 8
    topk_rows: int = 2048
    # The MTP drafter is one extra decoder layer run mtp_depth times, so its
    # KV (and indexer keys) is one extra layer whatever the depth.
    mtp_layers: int = 1


# KV geometry from each model's config: every one is MLA with kv_lora_rank
# 512 and qk_rope_head_dim 64 (one 656-byte fp8_ds_mla row per token per
# layer), a DSA indexer with index_head_dim 128 (132-byte rows) and
# index_topk 2048, and one MTP layer. What differs is the layer count, the
# indexer layers and the weights.
_DSV32 = ModelPreset("deepseek-v3.2", 61, 61, 690 * 10**9, 18 * 10**9)
_GLM5 = ModelPreset("glm-5", 78, 78, 750 * 10**9, 20 * 10**9)
MODELS: dict[str, ModelPreset] = {
    # DeepSeek-V3.2: 61 layers (num_hidden_layers), an indexer on each;
    # 671B params (37B active), FP8 checkpoint ~690 GB.
    "deepseek-v3.2": _DSV32,
    # V3.2-Exp, the preview, has V3.2's architecture and geometry.
    "deepseek-v3.2-exp": replace(_DSV32, name="deepseek-v3.2-exp"),
    # GLM-5: 78 layers, an indexer on each; ~744B params, FP8 ~750 GB.
    "glm-5": _GLM5,
    # GLM-5.1 is GLM-5's architecture (GlmMoeDsa) retrained: same geometry.
    "glm-5.1": replace(_GLM5, name="glm-5.1"),
    # GLM-5.3 keeps 22 indexer layers; the other layers reuse their top-k.
    "glm-5.3": replace(_GLM5, name="glm-5.3", indexer_layers=22),
}


@dataclass(frozen=True)
class GpuPreset:
    name: str
    hbm_bytes: int  # what nvidia-smi reports as total
    hbm_bytes_per_s: float
    # Host-to-device over PCIe Gen5 x16, pinned. B200's own link is Gen6, but
    # the host CPUs of current HGX boards are Gen5, so the rate is Gen5's.
    h2d_bytes_per_s: float = 50e9


GPUS: dict[str, GpuPreset] = {
    "h100": GpuPreset("H100", 81_559 * MiB, 3.35e12),   # SXM5 80 GB
    "h200": GpuPreset("H200", 143_771 * MiB, 4.8e12),   # the "141 GB" label
    "b200": GpuPreset("B200", 183_359 * MiB, 8.0e12),   # the "180 GB" label
}


def gpu_named(hbm_bytes: int) -> str:
    """The preset's name for this much HBM, else the size in GiB."""
    for gpu in GPUS.values():
        if gpu.hbm_bytes == hbm_bytes:
            return gpu.name
    return f"{hbm_bytes / GiB:.0f} GiB GPU"


@dataclass(frozen=True)
class NodeSpec:
    gpus: int = 8
    # H200: nvidia-smi reports 143,771 MiB (140.4 GiB); the "141 GB" label.
    hbm_bytes: int = 143_771 * MiB
    host_bytes: int = 512 * GiB
    # PCIe Gen5 x16 pinned H2D, the low end of 50-55 GB/s: row gathers of
    # 656 B over UVA move whole 128 B lines, so they get close to bulk rate.
    h2d_bytes_per_s: float = 50e9
    hbm_bytes_per_s: float = 4.8e12


@dataclass(frozen=True)
class EngineConfig:
    tp: int = 8
    dp: int = 1  # dp > 1: DP-attention replicas, experts sharded over all GPUs
    kv_format: str = "fp8_ds_mla"
    gpu_memory_utilization: float = 0.92
    # Free parameter: what vLLM's profile run takes besides weights and KV.
    # Estimated, not fitted: DSA indexer prefill logits [8192 x 142,000]
    # fp32 = 4.3 GiB; MoE + attention activations at 8192 batched tokens
    # ~3 GiB; CUDA graphs for MTP3 decode batches ~2.5 GiB; NCCL buffers and
    # CUDA context ~2 GiB; sampler at max_num_seqs x 154,880 vocab ~1 GiB;
    # MTP drafter weights and fragmentation ~3 GiB. Total ~16 GiB.
    workspace_bytes: int = 16 * GiB
    mtp_depth: int = 3
    hot_rows: int = 4096  # about 2x top-k rows per layer per request
    # The running turn's own tokens (753 new + 220 out, rounded up to 64-token
    # blocks) stay resident until the turn ends; older blocks are spilled.
    tail_tokens: int = 1024
    max_model_len: int = 142_000
    max_num_batched_tokens: int = 8192  # vLLM's default chunked-prefill budget


@dataclass(frozen=True)
class Workload:
    turns: int = 13
    first_turn_tokens: int = 74_160
    turn_increment_tokens: int = 753  # prompt growth per turn, incl. the last reply
    output_tokens: int = 220
    shared_prefix_tokens: int = 0  # a system prompt every session starts with
    # Free parameter: mean tool/think gap between turns (exponential). An
    # agent turn ends in a tool call: file reads and greps take well under a
    # second, builds and test runs take tens of seconds; with the client's
    # own round trip, a mean of a few seconds. 3 s is the middle of that.
    gap_s: float = 3.0
    # Probability that a turn goes to another DP replica than the last one.
    move_prob: float = 0.0
    # Rolling engine restarts (upgrades, crashes): each DP replica restarts once
    # per this many seconds, staggered; 0 = never. A restarted engine loses a
    # private host pool (vLLM unlinks its HiSparse region at exit), not a
    # hisparsed namespace.
    restart_interval_s: float = 0.0


@dataclass(frozen=True)
class PerfModel:
    """Step-time model of one engine step (see docs/planner.md)."""

    # Per-step cost independent of batch: 2 all-reduces x 78 layers, reading
    # the non-expert weights, 3 MTP drafter passes, scheduling and sampling.
    step_fixed_s: float = 0.010
    hbm_efficiency: float = 0.7  # fraction of peak HBM bandwidth weight reads get
    # Per running request: sparse MLA over ~2.7K rows x 79 layers, the
    # indexer scan of its ~80K keys x 23 layers, top-k selection.
    step_per_request_s: float = 0.0004
    # Node prefill rate: ~117 GFLOP per token (80 GFLOP MoE at 40B active,
    # sparse attention and indexer) at ~22% of 8 x 989 TFLOPS FP8.
    prefill_tokens_per_s: float = 15_000.0
    # Of those ~117 GFLOP, sparse attention and the indexer (~37) run on the
    # rank that owns the request; under DP-attention only the MoE part (EP)
    # is spread over every GPU.
    prefill_attention_share: float = 0.3
    # MTP3: mean tokens emitted per decode step (1 + accepted drafts).
    accept_tokens_per_step: float = 2.8
    # Sparse tier miss rate: missing / distinct selected rows at 2x top-k hot
    # rows (benchmarks/hit_rate.py measures it on generated traces).
    miss_rate: float = 0.10
    # Each MTP draft row adds this fraction of new rows to the step's union.
    draft_novelty: float = 0.10


@dataclass(frozen=True)
class HostConfig:
    """Host memory as one mode uses it.

    ``park_bytes`` parks idle sessions (the offload tier: prefix cache).
    ``sparse_bytes`` holds running requests' cold rows (the sparse tier).
    ``one_pool``: both roles in one region (hisparsed: a running request's
    spilled pages are its pinned prefix pages, stored once).
    ``shared``: one pool for all DP replicas instead of one per replica.
    """

    park_bytes: int
    sparse_bytes: int = 0
    one_pool: bool = False
    shared: bool = True


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    model: ModelPreset
    node: NodeSpec = field(default_factory=NodeSpec)
    engine: EngineConfig = field(default_factory=EngineConfig)
    workload: Workload = field(default_factory=Workload)
    perf: PerfModel = field(default_factory=PerfModel)
    concurrency: tuple[int, ...] = (1, 8, 16, 24, 32)
    baseline_host: HostConfig = field(default_factory=lambda: HostConfig(park_bytes=512 * GiB))
    # Published split: 384 GiB offload tier for parked sessions + 128 GiB
    # sparse host pool for the cold rows of running requests.
    hisparse_host: HostConfig = field(
        default_factory=lambda: HostConfig(park_bytes=384 * GiB, sparse_bytes=128 * GiB))
    seed: int = 0
    # Long enough for ~100 sessions at c=32 after the start-up transient.
    warmup_s: float = 600.0
    horizon_s: float = 3600.0


_GLM53 = Scenario(
    name="glm53-8xh200",
    description="GLM-5.3 on 8xH200, TP8, MTP3, FP8 KV, ~80K-token 13-turn sessions",
    model=MODELS["glm-5.3"],
)

SCENARIOS: dict[str, Scenario] = {
    "glm53-8xh200": _GLM53,
    # The node as 8 DP-attention replicas running vLLM 0.34's
    # HiSparse; its host pools as hisparse.vllm.hisparse_connector gives them
    # (one hisparsed namespace of 512 GiB) against vLLM's own (8 private
    # pools of 64 GiB, host_pool_gib=64 each). A 16K-token system prompt
    # (tool schemas and instructions) opens every session; a quarter of the
    # turns land on another replica (a load-balancing router without strict
    # session affinity).
    "glm53-8xh200-shared-pool": replace(
        _GLM53,
        name="glm53-8xh200-shared-pool",
        description="GLM-5.3, 8 DP-attention replicas on vLLM HiSparse: one hisparsed namespace "
                    "(our HiSparseConnector) vs vLLM's per-replica host pools",
        engine=replace(_GLM53.engine, tp=1, dp=8),
        workload=replace(_GLM53.workload, shared_prefix_tokens=16_384, move_prob=0.25),
        concurrency=(32, 64),
        hisparse_host=HostConfig(park_bytes=512 * GiB, one_pool=True, shared=True),
    ),
    # 1M-token requests; closed form only.
    "glm5-1m": replace(
        _GLM53,
        name="glm5-1m",
        description="GLM-5 (indexer on every layer), 1M-token context: TP8 vs DP-attention",
        model=MODELS["glm-5"],
        engine=replace(_GLM53.engine, max_model_len=1 << 20),
        workload=replace(_GLM53.workload, turns=1, first_turn_tokens=(1 << 20) - 220,
                         turn_increment_tokens=0),
        concurrency=(),
    ),
}
