"""The top-k trace generator: determinism, shapes, overlap calibration, structure."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hisparse.sim.trace import TopkTrace, TraceParams, calibrate_rho, overlap

# Small but not degenerate: 512 of a 20K context, a pool of 2048 candidates.
SMALL = TraceParams(num_requests=2, context_tokens=20_000, topk=512, recent_window=32,
                    sink_tokens=4, shift_prob=0.0, seed=5)


def run(params: TraceParams, steps: int) -> list[np.ndarray]:
    trace = TopkTrace(params)
    return [trace.step() for _ in range(steps)]


def mean_overlap(steps: list[np.ndarray], group: int = 0, row: int = 0) -> float:
    return float(np.mean([overlap(a[:, group, row], b[:, group, row]) for a, b in zip(steps, steps[1:])]))


def test_same_seed_same_trace_other_seed_other_trace():
    a, b = run(SMALL, 4), run(SMALL, 4)
    c = run(dataclasses.replace(SMALL, seed=6), 4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[-1], c[-1])


def test_shape_dtype_and_distinct_positions_within_a_row():
    p = dataclasses.replace(SMALL, num_groups=3, mtp=2)
    steps = run(p, 3)
    assert steps[0].shape == (2, 3, 3, 512) and steps[0].dtype == np.int32
    for row in steps[-1].reshape(-1, 512):
        assert np.unique(row).size == 512 and row.min() >= 0


@pytest.mark.parametrize("target", [0.80, 0.90, 0.97])
def test_adjacent_step_overlap_near_the_target(target):
    got = mean_overlap(run(dataclasses.replace(SMALL, target_overlap=target), 12))
    assert abs(got - target) < 0.02, got


def test_sinks_and_recent_window_always_selected_and_nothing_from_the_future():
    p = dataclasses.replace(SMALL, mtp=1)
    trace = TopkTrace(p)
    for _ in range(3):
        ctx = trace.context_tokens
        sel = trace.step()
        for r in range(p.num_requests):
            for q in range(p.q_rows):
                row = set(sel[r, 0, q].tolist())
                end = int(ctx[r]) + q
                assert set(range(p.sink_tokens)) <= row
                assert set(range(end - p.recent_window, end)) <= row
                assert max(row) < end


def test_context_grows_by_one_plus_mtp_per_step():
    trace = TopkTrace(dataclasses.replace(SMALL, mtp=2))
    trace.step()
    start = trace.context_tokens.copy()
    trace.step()
    trace.step()
    assert (trace.context_tokens - start).tolist() == [6, 6]


def test_short_context_pads_with_minus_one():
    sel = run(dataclasses.replace(SMALL, context_tokens=300), 1)[0]
    assert (sel[:, :, :, 300:] == -1).all()
    assert sorted(sel[0, 0, 0, :300].tolist()) == list(range(300))


def test_mtp_rows_overlap_row_zero_heavily_but_not_fully():
    sel = run(dataclasses.replace(SMALL, mtp=1, mtp_noise=0.2), 2)[-1]
    ov = overlap(sel[:, 0, 0], sel[:, 0, 1])
    assert 0.7 < ov < 1.0


def test_groups_correlate_as_asked():
    def cross(c: float) -> float:
        sel = run(dataclasses.replace(SMALL, num_groups=2, group_correlation=c), 2)[-1]
        return overlap(sel[:, 0, 0], sel[:, 1, 0])
    low, high = cross(0.0), cross(0.95)
    assert high > low + 0.3


def test_shift_events_break_the_overlap():
    calm = mean_overlap(run(SMALL, 6))
    shifting = mean_overlap(run(dataclasses.replace(SMALL, shift_prob=1.0, shift_fraction=0.8), 6))
    assert shifting < calm - 0.2


def test_candidates_cluster_into_runs_of_adjacent_positions():
    sel = run(SMALL, 1)[0][0, 0, 0]
    pool = np.sort(sel[(sel >= SMALL.sink_tokens) & (sel < SMALL.context_tokens - SMALL.recent_window)])
    adjacent = np.mean(np.diff(pool) == 1)
    assert adjacent > 0.5  # a uniform choice of 476 in 20K would give about 0.02


def test_calibration_is_monotone_in_the_target():
    rhos = [calibrate_rho(1024, 256, t) for t in (0.8, 0.9, 0.97)]
    assert rhos == sorted(rhos) and 0.5 < rhos[0] < rhos[-1] < 1.0
