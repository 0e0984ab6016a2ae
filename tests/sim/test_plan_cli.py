"""``hisparse plan``: the table, the JSON schema, the plot, the other scenarios."""

from __future__ import annotations

import json

import pytest

from hisparse import cli
from hisparse.sim import plan_cli


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert plan_cli.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def published() -> dict:
    from hisparse.sim.presets import SCENARIOS

    return plan_cli.run_published(SCENARIOS["glm53-8xh200"])


def test_json_schema_and_published_ranges(capsys):
    out = _json(capsys, "--scenario", "glm53-8xh200")
    assert out["concurrency"] == [1, 8, 16, 24, 32]
    assert len(out["baseline_running"]) == len(out["hisparse_running"]) == 5
    assert all(isinstance(x, float) for x in out["baseline_running"] + out["hisparse_running"])
    assert 5.0 <= out["baseline_running"][-1] <= 6.0
    assert 19.0 <= out["hisparse_running"][-1] <= 25.0
    i = out["inputs"]
    assert (i["engine"]["tp"], i["engine"]["mtp_depth"], i["engine"]["kv_format"]) == (8, 3, "fp8_ds_mla")
    assert i["engine"]["gpu_memory_utilization"] == 0.92 and i["engine"]["max_model_len"] == 142_000
    assert (i["workload"]["turns"], i["workload"]["first_turn_tokens"]) == (13, 74_160)
    assert (i["workload"]["turn_increment_tokens"], i["workload"]["output_tokens"]) == (753, 220)
    assert i["baseline_host"]["park_bytes"] == 512 << 30
    assert (i["hisparse_host"]["park_bytes"], i["hisparse_host"]["sparse_bytes"]) == (384 << 30, 128 << 30)
    assert i["model"] == {**i["model"], "name": "glm-5.3", "num_layers": 78, "indexer_layers": 22}


def test_cli_dispatch_prints_the_table_by_default(capsys):
    assert cli.main(["plan"]) == 0
    text = capsys.readouterr().out
    assert "glm53-8xh200" in text and "KV budget/GPU" in text
    rows = [line.split() for line in text.splitlines() if line.split()[:1] == ["32"]]
    assert len(rows) == 1 and 5.0 <= float(rows[0][1]) <= 6.0 and 19.0 <= float(rows[0][2]) <= 25.0


def test_plot_is_written(tmp_path, published):
    pytest.importorskip("matplotlib")

    path = tmp_path / "plan.png"
    plan_cli.plot(published, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_overrides_reach_the_model(capsys):
    # bf16 KV rows (1152 B) nearly halve what full residency holds
    out = _json(capsys, "--kv-format", "bf16", "--concurrency", "32")
    assert out["inputs"]["engine"]["kv_format"] == "bf16"
    assert out["capacity_at_mean_turn"]["full_running"] == 3
    assert out["baseline_running"][0] <= 3.0 + 1e-9


def test_bad_layout_is_an_error(capsys):
    assert plan_cli.main(["--tp", "4"]) == 2
    assert "tp*dp = 4*1 != 8 GPUs" in capsys.readouterr().err


def test_long_context_layouts(capsys):
    out = _json(capsys, "--scenario", "glm5-1m")
    assert out["tokens"] == 1 << 20
    by = {(r["model"], r["layout"]): r for r in out["summary"]}
    # 1M tokens x 62,252 B = 60.8 GiB: no layout holds one request fully resident
    assert all(r["full_running"] == 0 for r in out["summary"])
    # GLM-5 indexer keys: 1M x 79 x 132 B = 10.2 GiB per request; 25.9 GiB budget on TP8
    assert by[("glm-5", "TP8")]["hisparse_running"] == 2
    assert by[("glm-5", "DP8-attention")]["hisparse_running"] == 0
    # GLM-5.3: 3.2 GiB per request; DP-attention is then bound by 512 GiB of host
    assert by[("glm-5.3", "TP8")]["hisparse_running"] == 8
    assert by[("glm-5.3", "DP8-attention")]["hisparse_hbm_running"] == 16
    assert by[("glm-5.3", "DP8-attention")]["hisparse_running"] == 10
    assert any("refuses" in line for line in out["layouts"]["TP8"]["arithmetic"])


def test_shared_pool_scenario(capsys):
    out = _json(capsys, "--scenario", "glm53-8xh200-shared-pool", "--concurrency", "32")
    rows = {(r["pool"], r["move_prob"]): r for r in out["rows"]}
    assert rows[("shared", 0.25)]["host_hit_rate"] > rows[("per-replica", 0.25)]["host_hit_rate"]
    assert rows[("shared", 1.0)]["host_hit_rate"] > rows[("per-replica", 1.0)]["host_hit_rate"]
    assert rows[("shared", 1.0)]["turns_per_min"] > rows[("per-replica", 1.0)]["turns_per_min"]


def test_plot_into_a_missing_directory_fails_before_the_simulation(capsys, tmp_path):
    missing = tmp_path / "no-such-dir" / "x.png"
    assert plan_cli.main(["--plot", str(missing)]) == 2
    out = capsys.readouterr()
    assert out.out == ""  # nothing simulated, nothing printed
    assert f"no directory {missing.parent}" in out.err and "mkdir -p" in out.err
    assert plan_cli.main(["--plot", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_the_layer_count_names_the_mtp_layer(capsys):
    rc = plan_cli.main(["--concurrency", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "79 layers (78 + 1 MTP) x 656 B + 23 indexer layers (22 + 1 MTP) x 132 B" in out
    assert "host needed for 1 session: " in out


def test_long_context_host_needs_follow_what_runs(capsys):
    assert plan_cli.main(["--scenario", "glm5-1m"]) == 0
    blocks = capsys.readouterr().out.split("\nglm-5 ")
    tp8 = next(b for b in blocks if b.startswith("TP8:"))
    dp8 = next(b for b in blocks if b.startswith("DP8-attention:"))
    assert "-> 2 running" in tp8 and "host needed for 2 sessions: " in tp8
    assert "-> 0 running" in dp8 and "host needed: none, as no request runs" in dp8
    assert "host needed for 1 sessions" not in tp8 + dp8


def test_shared_pool_output_explains_move_and_restart(capsys):
    from hisparse.sim.presets import SCENARIOS

    plan_cli.print_shared_pool(SCENARIOS["glm53-8xh200-shared-pool"], {"rows": []})  # the table's head
    out = capsys.readouterr().out
    legend = next(line for line in out.splitlines() if line.strip().startswith("move:"))
    assert "another replica" in legend and "restart:" in legend and "- = never" in legend
