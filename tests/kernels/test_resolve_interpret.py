"""The Triton resolver against the reference, under Triton's interpreter on CPU.

conftest.py sets TRITON_INTERPRET=1 before Triton is imported. Every case is
judged by ``equiv.compare``, which allows the contract's free choices (which
missing position takes which victim, ties among equal stamps).
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hisparse.kernels
from hisparse.kernels import resolve, resolve_reference
from hisparse.kernels.cases import CaseSpec, make_case
from hisparse.kernels.equiv import STATE, assert_equivalent, compare, snapshot

pytestmark = pytest.mark.timeout(120)


def run_both(args):
    """Run reference and kernel on copies of ``args``; return (before, ref, got)."""
    before = snapshot(args)
    ref_args, got_args = snapshot(args), snapshot(args)
    ref_rows, ref_cnt = resolve_reference(**ref_args)
    got_rows, got_cnt = resolve(**got_args)
    return (before, (ref_rows, ref_cnt, {k: ref_args[k] for k in STATE}),
            (got_rows, got_cnt, {k: got_args[k] for k in STATE}))


def check(spec: CaseSpec):
    before, ref, got = run_both(make_case(spec))
    assert_equivalent(before, ref, got)
    return before, ref, got


def test_all_resident():
    _, ref, got = check(CaseSpec(resident_frac=1.0, pad_frac=0.0))
    assert got[1][:, 1:].sum() == 0 and torch.equal(ref[0], got[0])


def test_all_hot():
    _, _, got = check(CaseSpec(resident_frac=0.0, hot_frac=1.0, hot=16, pad_frac=0.0))
    assert got[1][:, 0].sum() == 0 and got[1][:, 2:].sum() == 0 and got[1][:, 1].min() > 0


def test_all_missing():
    _, _, got = check(CaseSpec(resident_frac=0.0, hot_frac=0.0, host_frac=1.0, hot=16, pad_frac=0.0))
    assert got[1][:, :2].sum() == 0 and got[1][:, 3].sum() == 0


def test_duplicates_within_and_across_query_rows():
    check(CaseSpec(q_rows=3, topk=8, num_blocks=3, row_overlap=0.7, hot=16, seed=3))


def test_minus_one_padding_and_padded_requests():
    _, _, got = check(CaseSpec(batch=4, num_real=2, pad_frac=0.5, seed=4))
    assert (got[0][2:] == -1).all() and (got[1][2:] == 0).all()


def test_no_real_request():
    _, _, got = check(CaseSpec(batch=2, num_real=0))
    assert (got[0] == -1).all()


def test_hot_rows_exactly_as_many_as_the_misses():
    args = make_case(CaseSpec(batch=1, num_real=1, resident_frac=0.0, hot_frac=0.0, host_frac=1.0,
                              pad_frac=0.0, topk=6, num_blocks=4, hot=6))
    args["hot_tags"].fill_(-1)
    before, ref, got = run_both(args)
    assert_equivalent(before, ref, got)
    assert got[1].tolist() == [[0, 0, 6, 0]]


def test_overflow_when_victims_run_out_and_pages_are_missing():
    _, _, got = check(CaseSpec(resident_frac=0.0, hot_frac=0.0, host_frac=0.5, hot=3, topk=12,
                               num_blocks=6, beyond_frac=0.1, seed=6))
    assert got[1][:, 3].min() > 0


def test_row_bytes_not_a_word_multiple_and_no_hot_rows():
    check(CaseSpec(row_bytes=3, seed=7))
    check(CaseSpec(hot=0, seed=8))


def test_row_bytes_of_a_glm_row():
    check(CaseSpec(row_bytes=656, topk=4, num_blocks=2, host_pages=2, seed=9))


def test_strided_topk_and_hot_state_views():
    # top-k as a strided view (every other column), hot state as column slices
    args = make_case(CaseSpec(q_rows=2, topk=10, hot=12, seed=15))
    def strided(t: torch.Tensor) -> torch.Tensor:  # same values, every other element of a wider buffer
        return torch.stack([t, torch.full_like(t, -7)], dim=-1).flatten(-2)[..., ::2]

    for k in ("topk", "hot_rows", "hot_tags", "hot_stamp"):
        args[k] = strided(args[k])
    assert not args["topk"].is_contiguous() and not args["hot_tags"].is_contiguous()
    before, ref_args = snapshot(args), snapshot(args)  # snapshots are contiguous copies
    ref_rows, ref_cnt = resolve_reference(**ref_args)
    rows, cnt = resolve(**args)  # the kernel works on the strided views themselves
    assert_equivalent(before, (ref_rows, ref_cnt, {k: ref_args[k] for k in STATE}),
                      (rows, cnt, {k: args[k] for k in STATE}))
    assert cnt[:, 2].sum() > 0


def test_preallocated_outputs_are_written_in_place():
    args = make_case(CaseSpec(seed=10))
    out = (torch.full(args["topk"].shape, 7, dtype=torch.int32), torch.full((2, 4), 7, dtype=torch.int32))
    ref_args = snapshot(args)
    ref_rows, ref_cnt = resolve_reference(**ref_args)
    rows, cnt = resolve(**args, out=out)
    assert rows is out[0] and cnt is out[1] and torch.equal(cnt, ref_cnt)


def test_package_attribute_stays_the_function_after_first_call():
    check(CaseSpec(seed=11))
    assert callable(hisparse.kernels.resolve)
    assert sys.modules["hisparse.kernels.resolve"].__name__ == "hisparse.kernels.resolve"


def test_multi_step_sequence_where_lru_order_decides():
    # Few hot rows, topk drawn from a small window that slides: every step
    # evicts, and which rows survive depends on the stamps of earlier steps.
    spec = CaseSpec(batch=2, num_real=2, q_rows=2, topk=6, num_blocks=4, hot=8, resident_frac=0.0,
                    host_frac=1.0, hot_frac=0.0, pad_frac=0.0, step=1, seed=12)
    args = make_case(spec)
    args["hot_tags"].fill_(-1)
    args["hot_stamp"].fill_(0)
    g = torch.Generator().manual_seed(12)
    for step in range(1, 7):
        lo = step
        args["topk"] = (lo + torch.randint(0, 8, args["topk"].shape, generator=g)).to(torch.int32)
        args["step"] = torch.tensor([step])
        before, ref, got = run_both(args)
        assert_equivalent(before, ref, got)
        for k in STATE:  # carry the kernel's own state into the next step
            args[k] = got[2][k]


def test_checker_catches_a_wrong_victim_and_wrong_bytes():
    # All stamps distinct so LRU fixes the victims; then spoil the result.
    spec = CaseSpec(batch=1, num_real=1, resident_frac=0.0, hot_frac=0.0, host_frac=1.0, pad_frac=0.0,
                    topk=2, hot=6, seed=13)
    args = make_case(spec)
    args["hot_stamp"] = torch.tensor([[5, 1, 9, 2, 7, 3]])
    before, ref, got = run_both(args)
    assert compare(before, ref, got) == []
    rows, cnt, state = got
    bad_bytes = dict(state, kv_rows=state["kv_rows"].clone())
    bad_bytes["kv_rows"][rows[0, 0, 0]] ^= 1
    assert compare(before, ref, (rows, cnt, bad_bytes))
    # move one loaded position onto the newest row (stamp 9, h 2) instead
    young_row = int(args["hot_rows"][0, 2])
    bad_rows = rows.clone()
    bad_rows[0, 0, 0] = young_row
    tags = state["hot_tags"].clone()
    tags[0, 2] = int(args["topk"][0, 0, 0])
    stamp = state["hot_stamp"].clone()
    stamp[0, 2] = 100
    kv = state["kv_rows"].clone()
    kv[young_row] = kv[rows[0, 0, 0]]
    assert any("more recent" in p for p in compare(before, ref, (bad_rows, cnt, dict(state, hot_tags=tags,
                                                                                        hot_stamp=stamp,
                                                                                        kv_rows=kv))))
    assert compare(before, ref, (rows, cnt + torch.tensor([[0, 0, 0, 1]], dtype=torch.int32), state))


def test_checker_accepts_another_assignment_of_victims():
    # Two loaded positions trade victims: still a valid result.
    spec = CaseSpec(batch=1, num_real=1, resident_frac=0.0, hot_frac=0.0, host_frac=1.0, pad_frac=0.0,
                    topk=2, hot=4, seed=14)
    before, ref, got = run_both(make_case(spec))
    rows, cnt, state = got
    assert cnt[0, 2] == 2
    r0, r1 = int(rows[0, 0, 0]), int(rows[0, 0, 1])
    swapped = rows.clone()
    swapped[0, 0, 0], swapped[0, 0, 1] = r1, r0
    h_of = {int(r): h for h, r in enumerate(before["hot_rows"][0].tolist())}
    tags = state["hot_tags"].clone()
    tags[0, h_of[r0]], tags[0, h_of[r1]] = tags[0, h_of[r1]].item(), tags[0, h_of[r0]].item()
    kv = state["kv_rows"].clone()
    kv[[r0, r1]] = kv[[r1, r0]]
    assert compare(before, ref, (swapped, cnt, dict(state, hot_tags=tags, kv_rows=kv))) == []


specs = st.builds(
    CaseSpec,
    batch=st.integers(1, 3), num_real=st.integers(0, 3), q_rows=st.integers(1, 3),
    topk=st.integers(1, 12), block_tokens=st.sampled_from([1, 2, 4]), num_blocks=st.integers(1, 6),
    hot=st.integers(0, 12), row_bytes=st.sampled_from([1, 4, 6, 12]),
    resident_frac=st.floats(0, 1), host_frac=st.floats(0, 1), hot_frac=st.floats(0, 1),
    pad_frac=st.floats(0, 0.5), row_overlap=st.floats(0, 1), beyond_frac=st.floats(0, 0.2),
    host_pages=st.integers(1, 8), step=st.integers(1, 6), seed=st.integers(0, 2**16),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs)
def test_random_cases_match_the_reference(spec):
    check(dataclasses.replace(spec, num_real=min(spec.num_real, spec.batch)))
