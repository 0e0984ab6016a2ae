"""The compiled Triton resolver on a GPU against the reference (run by scripts/gpu-check).

Shapes up to the sizing targets (Q = 4 x K = 2048 entries, H = 8192 hot
rows, 656-byte rows), host rows in pinned memory read through UVA, and a
CUDA-graph capture whose replays see the device ``step``.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from hisparse.kernels import resolve, resolve_reference
from hisparse.kernels.cases import CaseSpec, make_case
from hisparse.kernels.equiv import STATE, assert_equivalent, snapshot

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))


def checked(args, run):
    """Run ``run(args)`` (mutating args' state) and assert it matches the reference."""
    before, ref_args = snapshot(args), snapshot(args)
    ref_rows, ref_cnt = resolve_reference(**ref_args)
    rows, cnt = run(args)
    torch.cuda.synchronize()
    assert_equivalent(before, (ref_rows, ref_cnt, {k: ref_args[k] for k in STATE}),
                      (rows, cnt, {k: args[k] for k in STATE}))
    return cnt.cpu()


@pytest.mark.parametrize("spec", [
    CaseSpec(seed=1),
    CaseSpec(batch=8, num_real=5, q_rows=2, topk=64, num_blocks=40, hot=96, row_bytes=656, seed=2),
    CaseSpec(batch=4, num_real=4, q_rows=1, topk=2048, block_tokens=64, num_blocks=1250, hot=4096,
             row_bytes=656, resident_frac=0.05, hot_frac=0.9, pad_frac=0.0, host_pages=512, seed=3),
    CaseSpec(batch=3, num_real=3, q_rows=4, topk=2048, block_tokens=64, num_blocks=1250, hot=8192,
             row_bytes=656, resident_frac=0.02, hot_frac=0.5, row_overlap=0.6, pad_frac=0.01,
             host_pages=512, seed=4),
    CaseSpec(batch=2, num_real=2, q_rows=1, topk=2048, block_tokens=64, num_blocks=100, hot=1000,
             row_bytes=656, resident_frac=0.0, hot_frac=0.0, host_frac=0.8, host_pages=64, seed=5),
], ids=["small", "mtp-odd-sizes", "k2048-h4096", "q4-k2048-h8192", "overflow"])
def test_compiled_kernel_matches_the_reference(spec):
    checked(make_case(spec, "cuda"), lambda a: resolve(**a))


def test_uva_host_rows_and_cuda_graph_replay():
    from resolve_gpu import uva_view

    spec = CaseSpec(batch=8, num_real=6, q_rows=1, topk=2048, block_tokens=64, num_blocks=1250, hot=4096,
                    row_bytes=656, resident_frac=0.02, hot_frac=0.7, pad_frac=0.0, host_pages=256, seed=6)
    args = make_case(spec, "cuda")
    pinned = torch.empty(args["host_rows"].shape, dtype=torch.uint8, pin_memory=True)
    pinned.copy_(args["host_rows"].cpu())
    args["host_rows"] = uva_view(pinned)
    out = (torch.empty_like(args["topk"]), torch.empty((spec.batch, 4), dtype=torch.int32, device="cuda"))
    saved = {k: args[k].clone() for k in ("hot_tags", "hot_stamp")}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        resolve(**args, out=out)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    for k, v in saved.items():
        args[k].copy_(v)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        resolve(**args, out=out)
    first = checked(args, lambda a: (graph.replay(), out)[1])
    assert first[:6, 2].sum() > 0 and (first[6:] == 0).all()
    # the next step: the same top-k is all hot now, stamped with the new step
    args["step"].add_(1)
    second = checked(args, lambda a: (graph.replay(), out)[1])
    assert second[:6, 2].sum() == 0
    args["step"].add_(1)
    args["num_real_reqs"].fill_(3)  # fewer real requests: the graph reads it on device
    third = checked(args, lambda a: (graph.replay(), out)[1])
    assert (third[3:] == 0).all()
