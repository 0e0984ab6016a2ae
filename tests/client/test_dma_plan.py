"""The copy engines' plans, checked without a GPU: each 2D copy replayed on host bytes."""

from __future__ import annotations

import numpy as np
import pytest

from hisparse.client.backends import dma

L, N, LPB = 5, 40, 24  # layers, region pages, bytes per page per layer
PAGE = L * LPB


def tiny_plan(*args, **kwargs) -> dma.Plan | None:
    """``dma.plan`` of this file's tiny pages, held to copies of a run of 4 pages or more."""
    return dma.plan(L, N, LPB, *args, **{"min_copy_bytes": 4 * LPB, **kwargs})


def replay(plan: dma.Plan, tensor: np.ndarray, region: np.ndarray, to_region: bool) -> None:
    """What cuMemcpy2DAsync does with each copy, on flat byte arrays."""
    for t_off, r_off, height in zip(plan.tensor_offsets, plan.region_offsets, plan.heights):
        for j in range(int(height)):
            t = int(t_off) + j * plan.tensor_pitch
            r = int(r_off) + j * plan.region_pitch
            if to_region:
                region[r:r + plan.width] = tensor[t:t + plan.width]
            else:
                tensor[t:t + plan.width] = region[r:r + plan.width]


def layer_major(region: np.ndarray) -> np.ndarray:
    return region.reshape(L, N, LPB)


def check_store_and_load(ids: np.ndarray, rows: np.ndarray, max_pitch: int) -> dma.Plan:
    rng = np.random.default_rng(len(ids))
    pages = rng.integers(0, 256, (int(rows.max()) + 1 if len(rows) else 0, PAGE), dtype=np.uint8)
    region = np.zeros(L * N * LPB, dtype=np.uint8)
    plan = tiny_plan(ids, rows, max_pitch)
    assert plan is not None
    assert plan.width <= min(plan.tensor_pitch, plan.region_pitch)
    assert max(plan.tensor_pitch, plan.region_pitch) <= max_pitch
    replay(plan, pages.reshape(-1), region, to_region=True)
    want = np.zeros((L, N, LPB), dtype=np.uint8)
    for i, p in zip(rows, ids):
        want[:, p] = pages[i].reshape(L, LPB)
    assert np.array_equal(layer_major(region), want)
    # and back: a load plan (rows 0..n-1) gathers the same pages
    out = np.zeros((len(ids), PAGE), dtype=np.uint8)
    back = tiny_plan(ids, np.arange(len(ids)), max_pitch)
    replay(back, out.reshape(-1), region, to_region=False)
    assert np.array_equal(out, pages[rows])
    return plan


def test_one_copy_per_page_when_the_layer_slab_fits_the_pitch():
    ids = np.array([7, 3, 39, 0, 21])
    rows = np.array([4, 0, 2, 1, 3])
    plan = check_store_and_load(ids, rows, max_pitch=N * LPB)
    assert len(plan) == len(ids) and set(plan.heights) == {L}


def test_per_layer_copies_of_runs_when_the_slab_is_over_the_pitch():
    ids = np.concatenate([np.arange(10, 22), np.arange(30, 38)])  # two runs of 12 and 8
    rows = np.arange(len(ids))
    plan = check_store_and_load(ids, rows, max_pitch=N * LPB - 1)
    assert len(plan) == 2 * L and sorted(set(plan.heights)) == [8, 12]
    assert plan.region_pitch == LPB  # a run is contiguous in each layer slab


def test_short_runs_over_the_pitch_are_left_to_the_kernel():
    ids = np.array([1, 5, 9, 13, 17, 20, 21])
    assert tiny_plan(ids, np.arange(len(ids)), max_pitch=N * LPB - 1) is None
    # a page wider than the pitch cannot be a row at all
    assert tiny_plan(np.arange(8), np.arange(8), max_pitch=PAGE - 1) is None


def test_small_pages_are_left_to_the_kernel():
    ids = np.arange(10, 20)  # one run of 10 pages
    per_page = tiny_plan(ids, np.arange(10), max_pitch=1 << 40, min_copy_bytes=PAGE)
    assert per_page is not None and per_page.region_pitch == N * LPB
    # pages too small for a copy each: one copy per layer of the run, while that is large enough
    by_run = tiny_plan(ids, np.arange(10), max_pitch=1 << 40, min_copy_bytes=PAGE + 1)
    assert by_run is not None and by_run.region_pitch == LPB and len(by_run) == L
    assert tiny_plan(ids, np.arange(10), max_pitch=1 << 40, min_copy_bytes=10 * LPB + 1) is None
    # GLM-5's pages (78 layers of 64 rows of 656 B) are one copy each; a page of 8 KiB is not
    glm = dma.plan(78, 1000, 64 * 656, ids, np.arange(10), max_pitch=1 << 31)
    assert glm is not None and len(glm) == 10
    assert dma.plan(4, 1000, 2048, ids, np.arange(10), max_pitch=1 << 31) is None


@pytest.mark.parametrize("max_pitch", [N * LPB, N * LPB - 1])
def test_nothing_to_copy_is_an_empty_plan(max_pitch):
    plan = tiny_plan(np.array([], dtype=np.int64), np.array([], dtype=np.int64), max_pitch)
    assert plan is not None and len(plan) == 0


def test_a_region_registered_in_pieces_gets_no_copy_across_a_piece():
    ids = np.arange(3, 33)  # one run of 30 pages
    rows = np.arange(len(ids))
    cuts = [7 * LPB, (N + 20) * LPB, 3 * N * LPB]  # in layer 0's run, layer 1's, at layer 3's start
    plan = tiny_plan(ids, rows, max_pitch=1 << 40, cuts=cuts)
    assert plan is not None and plan.region_pitch == LPB
    for start, height in zip(plan.region_offsets, plan.heights):
        end = int(start) + int(height) * LPB
        assert not any(int(start) < c < end for c in cuts)
    assert len(plan) == L + 2  # two runs cut in two
    # the bytes land as without cuts
    pages = np.random.default_rng(3).integers(0, 256, (len(ids), PAGE), dtype=np.uint8)
    region = np.zeros(L * N * LPB, dtype=np.uint8)
    replay(plan, pages.reshape(-1), region, to_region=True)
    want = np.zeros((L, N, LPB), dtype=np.uint8)
    want[:, ids] = pages.reshape(len(ids), L, LPB).transpose(1, 0, 2)
    assert np.array_equal(layer_major(region), want)


def test_a_cut_inside_a_row_is_left_to_the_kernel():
    ids = np.arange(3, 33)
    assert tiny_plan(ids, np.arange(len(ids)), max_pitch=1 << 40, cuts=[10 * LPB + 5]) is None
    # a cut outside every copied row changes nothing
    plan = tiny_plan(ids, np.arange(len(ids)), max_pitch=1 << 40, cuts=[35 * LPB + 5])
    assert plan is not None and len(plan) == L
