"""The capacity model's arithmetic against hand-computed cases."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hisparse.sim import plan
from hisparse.sim.presets import GiB, MiB, MODELS, SCENARIOS, EngineConfig, HostConfig, ModelPreset, NodeSpec

GLM53 = SCENARIOS["glm53-8xh200"]
M, N, E, P = GLM53.model, GLM53.node, GLM53.engine, GLM53.perf


def test_bytes_per_token_glm53_fp8_with_mtp():
    # 78 layers + 1 MTP layer of 656 B; 22 indexer layers + the MTP layer's, 132 B each
    assert plan.mla_bytes_per_token(M, E) == 79 * 656 == 51_824
    assert plan.indexer_bytes_per_token(M, E) == 23 * 132 == 3_036
    assert plan.full_bytes_per_token(M, E) == 54_860


def test_bytes_per_token_other_formats_and_models():
    no_mtp = replace(E, mtp_depth=0)
    assert plan.full_bytes_per_token(M, no_mtp) == 78 * 656 + 22 * 132 == 54_072
    assert plan.full_bytes_per_token(M, replace(E, kv_format="bf16")) == 79 * 1152 + 23 * 132 == 94_044
    assert plan.full_bytes_per_token(MODELS["deepseek-v3.2"], E) == 62 * 656 + 62 * 132 == 48_856
    assert plan.indexer_bytes_per_token(MODELS["glm-5"], E) == 79 * 132


def test_weights_and_kv_budget_per_gpu_tp8():
    assert plan.weight_bytes_per_gpu(M, N, E) == 750_000_000_000 // 8 == 93_750_000_000
    # 0.92 x 143,771 MiB = 138,694,434,488 B; minus weights, minus 16 GiB workspace
    assert N.hbm_bytes == 150_754_820_096
    assert plan.kv_budget_bytes(M, N, E) == 138_694_434_488 - 93_750_000_000 - 17_179_869_184
    assert plan.kv_budget_bytes(M, N, E) == 27_764_565_304


def test_dp_attention_replicates_non_expert_weights():
    dp8 = replace(E, tp=1, dp=8)
    assert plan.weight_bytes_per_gpu(M, N, dp8) == 20_000_000_000 + 730_000_000_000 // 8
    with pytest.raises(ValueError, match="tp\\*dp"):
        plan.weight_bytes_per_gpu(M, N, replace(E, tp=4, dp=1))


def test_toy_model_by_hand():
    # 2 layers (1 with an indexer), no MTP, bf16 rows: 2*1152 + 132 = 2436 B/token.
    toy = ModelPreset("toy", 2, 1, weight_bytes=8 * 10**9, replicated_weight_bytes=0, topk_rows=100)
    node = NodeSpec(gpus=2, hbm_bytes=10 * GiB, h2d_bytes_per_s=1e9)
    eng = EngineConfig(tp=2, kv_format="bf16", gpu_memory_utilization=1.0, workspace_bytes=1 * GiB,
                       mtp_depth=0, hot_rows=10, tail_tokens=100)
    assert plan.full_bytes_per_token(toy, eng) == 2436
    budget = 10 * GiB - 4 * 10**9 - GiB
    assert plan.kv_budget_bytes(toy, node, eng) == budget == 5_663_676_416
    cap = plan.capacity(toy, node, eng, replace(P, miss_rate=0.5), 1_000_000,
                        HostConfig(park_bytes=100 * GiB, sparse_bytes=10 * GiB), users=4)
    assert cap.full_request_bytes == 2_436_000_000 and cap.full_running == 2
    # indexer 1M x 132 + hot 10 x 2304 + tail 100 x 2304
    assert cap.hisparse_request_bytes == 132_000_000 + 23_040 + 230_400
    assert cap.hisparse_hbm_running == budget // 132_253_440 == 42
    assert cap.cold_request_bytes == 999_900 * 2304
    assert cap.hisparse_host_running == 10 * GiB // (999_900 * 2304) == 4
    assert cap.hisparse_running == 4
    # 4 running: their cold rows, plus all 4 sessions parked in the offload tier
    assert cap.hisparse_host_bytes_needed == 4 * 999_900 * 2304 + 4 * 2_436_000_000
    # 50% of 100 distinct rows x 2 layers x 1152 B, per request; 4 requests on 1 GB/s
    assert cap.h2d_bytes_per_step == 115_200
    assert cap.h2d_s_per_step == pytest.approx(4 * 115_200 / 1e9)


def test_glm53_capacity_at_80k_tokens():
    cap = plan.capacity(M, N, E, P, 80_000, GLM53.hisparse_host, users=32)
    assert cap.full_request_bytes == 80_000 * 54_860 == 4_388_800_000
    assert cap.full_running == 27_764_565_304 // 4_388_800_000 == 6
    assert cap.hisparse_request_bytes == 80_000 * 3_036 + 4096 * 51_824 + 1024 * 51_824 == 508_218_880
    assert cap.hisparse_hbm_running == 54
    assert cap.cold_request_bytes == (80_000 - 1024) * 51_824
    assert cap.hisparse_host_running == 128 * GiB // 4_092_852_224 == 33
    # 10% of 2048 x (1 + 3 drafts x 0.1) rows, 79 layers of 656 B
    assert cap.h2d_bytes_per_step == pytest.approx(0.1 * 2048 * 1.3 * 51_824)
    assert cap.h2d_s_per_step == pytest.approx(32 * 13_797_621.76 / 50e9)


def test_one_pool_counts_parked_and_running_once():
    one = HostConfig(park_bytes=512 * GiB, one_pool=True)
    cap = plan.capacity(M, N, E, P, 80_000, one, users=32)
    assert cap.hisparse_host_bytes_needed == 32 * 4_388_800_000
    assert cap.hisparse_host_running == 512 * GiB // 4_092_852_224


def test_workload_tokens():
    wl = GLM53.workload
    assert plan.prompt_tokens(wl, 0) == 74_160
    assert plan.prompt_tokens(wl, 12) == 74_160 + 12 * 753
    assert plan.final_tokens(wl) == 83_416
    assert plan.mean_turn_tokens(wl) == pytest.approx(74_160 + 6 * 753 + 110)


def test_h200_hbm_is_nvidia_smi_total():
    assert NodeSpec().hbm_bytes == 143_771 * MiB
    assert 140 * GiB < NodeSpec().hbm_bytes < 141 * GiB
