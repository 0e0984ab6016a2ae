"""``hisparse plan`` beyond the published setup: model and GPU presets, the header,
the refusal when weights do not fit, where the published figures appear, help texts."""

from __future__ import annotations

import json

import pytest

from hisparse import cli
from hisparse.sim import plan_cli
from hisparse.sim.presets import GPUS, MODELS, KV_ROW_BYTES, GiB


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = plan_cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_presets_state_the_kv_geometry_of_each_model():
    geometry = {name: (m.num_layers, m.indexer_layers, m.topk_rows, m.mtp_layers) for name, m in MODELS.items()}
    assert geometry["deepseek-v3.2"] == geometry["deepseek-v3.2-exp"] == (61, 61, 2048, 1)
    assert geometry["glm-5"] == geometry["glm-5.1"] == (78, 78, 2048, 1)
    assert geometry["glm-5.3"] == (78, 22, 2048, 1)
    assert KV_ROW_BYTES["fp8_ds_mla"] == 512 + 4 * 4 + 64 * 2  # fp8 latent, fp32 scales, bf16 rope
    assert {g.name for g in GPUS.values()} == {"H100", "H200", "B200"}
    assert GPUS["h100"].hbm_bytes < GPUS["h200"].hbm_bytes < GPUS["b200"].hbm_bytes


def test_weights_that_do_not_fit_are_refused_with_what_to_change(capsys):
    rc, out, err = run(capsys, "--model", "deepseek-v3.2", "--gpu", "h100")
    assert rc == 2 and out == ""
    assert "deepseek-v3.2 does not fit on 8 x H100" in err
    assert "--gpus" in err and "--gpu" in err and "Traceback" not in err


def test_the_header_names_the_chosen_presets_and_no_glm_figures(capsys):
    rc, out, _ = run(capsys, "--model", "deepseek-v3.2", "--gpu", "b200", "--concurrency", "8")
    assert rc == 0
    first = out.splitlines()[0]
    assert first.startswith("deepseek-v3.2 on 8 x B200 (179.1 GiB), TP8 x DP1, MTP3, fp8_ds_mla KV")
    assert "GLM" not in out and "published" not in out
    assert "61 layers x 656 B" not in out and "62 layers x 656 B" in out  # 61 + the MTP layer
    rc, out, _ = run(capsys, "--model", "deepseek-v3.2", "--gpu", "b200", "--concurrency", "8", "--json")
    data = json.loads(out)
    assert data["published_at_c32"] is None
    assert data["inputs"]["node"]["hbm_bytes"] == GPUS["b200"].hbm_bytes


def test_published_figures_only_for_the_published_setup(capsys):
    rc, out, _ = run(capsys, "--concurrency", "8")
    assert rc == 0 and out.startswith("glm53-8xh200: GLM-5.3 on 8xH200")
    assert "published at c=32" in out
    rc, out, _ = run(capsys, "--gpu", "h200", "--concurrency", "8", "--json")
    assert json.loads(out)["published_at_c32"] is not None  # H200 is the scenario's own GPU
    rc, out, _ = run(capsys, "--gpus", "16", "--tp", "16", "--concurrency", "8")
    assert rc == 0 and "published" not in out and out.startswith("glm-5.3 on 16 x H200")


def test_plot_prints_its_path(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "sweep.png"
    rc, out, _ = run(capsys, "--model", "glm-5.1", "--gpu", "b200", "--concurrency", "8,16", "--plot", str(path))
    assert rc == 0 and f"plot: {path}" in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc, out, err = run(capsys, "--scenario", "glm5-1m", "--plot", str(path))
    assert rc == 2 and "no" in err and "concurrency sweep" in err


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    from hisparse import ctl
    from hisparse.daemon import main as daemon_main

    entry = {"plan": cli.main, "demo": cli.main, "hisparsectl": ctl.main, "hisparsed": daemon_main.main}[argv[0]]
    with pytest.raises(SystemExit) as exit_:
        entry(argv if entry is cli.main else argv[1:])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_help_texts_have_no_markup_and_every_flag_is_explained(capsys):
    for argv in (["plan", "--help"], ["demo", "--help"], ["hisparsed", "--help"], ["hisparsectl", "--help"],
                 ["hisparsectl", "evict-session", "--help"], ["hisparsectl", "top", "--help"]):
        text = _help(argv, capsys)
        assert "``" not in text and "`" not in text
        options = text.split("options:", 1)[1]
        # every "--flag ARG" line carries its help on the same or the next line
        lines = options.splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            if stripped.startswith("--") and len(stripped.split("  ")) == 1:
                assert i + 1 < len(lines) and lines[i + 1].startswith(" " * 10), f"{argv}: {stripped}"
