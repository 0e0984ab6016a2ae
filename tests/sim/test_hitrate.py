"""The planner's miss rate, measured on traces with the reference resolver."""

from __future__ import annotations

import json

from hisparse.sim import plan_cli
from hisparse.sim.hitrate import measure_miss_rate
from hisparse.sim.presets import PerfModel

SMALL = dict(topk=256, context_tokens=8_000, requests=2, warmup_steps=20, steps=40)


def test_more_hot_rows_miss_less_and_never_overflow_at_2x():
    rates = [measure_miss_rate(hot_factor=h, **SMALL) for h in (1.0, 2.0, 3.0)]
    assert rates[0].miss_rate > rates[1].miss_rate > rates[2].miss_rate > 0
    assert rates[1].overflow_rate == 0.0
    assert 0.9 < rates[1].hot_hit_rate < 1.0


def test_higher_overlap_between_steps_misses_less():
    loose = measure_miss_rate(overlap=0.80, **SMALL).miss_rate
    tight = measure_miss_rate(overlap=0.97, **SMALL).miss_rate
    assert tight < loose


def test_the_assumed_default_is_conservative_against_the_measurement():
    measured = measure_miss_rate(hot_factor=2.0, mtp=3, **SMALL).miss_rate
    assert measured < PerfModel().miss_rate


def test_plan_can_measure_its_miss_rate(capsys):
    assert plan_cli.main(["--scenario", "glm53-8xh200", "--measure-miss-rate", "--json",
                          "--concurrency", "32"]) == 0
    out = json.loads(capsys.readouterr().out)
    rate = out["inputs"]["perf"]["miss_rate"]
    assert 0.005 < rate < PerfModel().miss_rate
    assert 19 <= out["hisparse_running"][-1] <= 25
