"""Hot-row hit rate of the sparse tier on DSA-like traces: LRU against FIFO.

    python benchmarks/hit_rate.py [--quick]

Requests decode through a real ``SparseSession`` (hisparse/client/sparse.py)
on a ``hisparsed`` started here on a temporary socket: prefill, spill all but
the active tail to host pages, then each step feed the trace's top-k
(hisparse/sim/trace.py) to ``resolve_reference`` with hot-row state, as a
layer would. For ``H`` = 1x, 2x, 3x top-k hot rows per request and for both
eviction policies it reports, over the steps after a warm-up:

- hit rate: hot / (hot + missing + overflow), i.e. of the positions that
  were not resident on the device;
- misses per step per request (loaded rows) and overflow (rows not served);
- host bytes per step: loaded rows x 656 B (a GLM-5 fp8_ds_mla row), for one
  layer of all requests, and for 78 layers.

The headline is LRU miss bytes / FIFO miss bytes at H = 2x top-k (below 1:
LRU moves fewer bytes). Rows are simulated at 16 B; only their count matters.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hisparse  # noqa: E402
from hisparse import client  # noqa: E402
from hisparse.client.sparse import BlockAllocator, SparseRequest, SparseSession  # noqa: E402
from hisparse.kernels import resolve_reference  # noqa: E402
from hisparse.local import start_daemon  # noqa: E402
from hisparse.sim.trace import TopkTrace, TraceParams  # noqa: E402

GLM_ROW_BYTES = 656
GLM_LAYERS = 78
SIM_ROW_BYTES = 16
BLOCK_TOKENS = 64
TAIL_BLOCKS = 2


@dataclass(frozen=True)
class Bench:
    requests: int
    context_tokens: int
    topk: int
    warmup_steps: int
    steps: int
    overlaps: tuple[float, ...]
    hot_factors: tuple[int, ...] = (1, 2, 3)
    mtp: int = 0


QUICK = Bench(requests=4, context_tokens=80_000, topk=2048, warmup_steps=60, steps=240, overlaps=(0.90,))
FULL = Bench(requests=8, context_tokens=80_000, topk=2048, warmup_steps=200, steps=1000,
             overlaps=(0.80, 0.90, 0.97))


def ensure_blocks(session: SparseSession, alloc: BlockAllocator, req: SparseRequest, tokens: int) -> None:
    """Grow the request's table to hold ``tokens`` positions, spilling what left the tail."""
    while req.num_blocks * BLOCK_TOKENS < tokens:
        session.append_block(req, alloc.allocate(1)[0])
    if sum(1 for b in req.blocks if b >= 0) > TAIL_BLOCKS + 1:
        session.spill(req)


def make_trace(bench: Bench, overlap: float) -> tuple[TraceParams, list[np.ndarray], list[np.ndarray]]:
    """The trace of one overlap, made once and replayed for every (H, policy)."""
    params = TraceParams(num_requests=bench.requests, context_tokens=bench.context_tokens, topk=bench.topk,
                         mtp=bench.mtp, target_overlap=overlap, seed=7)
    trace = TopkTrace(params)
    contexts, selections = [], []
    for _ in range(bench.warmup_steps + bench.steps):
        contexts.append(trace.context_tokens)
        selections.append(trace.step()[:, 0])  # group 0: one layer's view
    return params, contexts, selections


def run_config(sock: str, bench: Bench, trace: tuple[TraceParams, list[np.ndarray], list[np.ndarray]],
               hot: int, policy: str) -> dict[str, float]:
    """One (trace, H, policy) run: returns per-step averages after the warm-up."""
    params, contexts, selections = trace
    total_steps = len(selections)
    max_tokens = bench.context_tokens + total_steps * params.growth + params.q_rows
    max_blocks = -(-max_tokens // BLOCK_TOKENS)
    layout = hisparse.KVLayout(num_layers=1, block_tokens=BLOCK_TOKENS, row_bytes=SIM_ROW_BYTES)
    capacity = layout.page_bytes * bench.requests * (max_blocks + 8)
    c = client.attach(f"bench/{policy}/{hot}/{params.target_overlap}", layout, socket=sock, capacity=capacity)
    engine_blocks = bench.requests * (max_blocks + -(-hot // BLOCK_TOKENS) + 1)
    kv = [torch.zeros((engine_blocks * BLOCK_TOKENS, SIM_ROW_BYTES), dtype=torch.uint8)]
    alloc = BlockAllocator(engine_blocks)
    session = SparseSession(c, kv, alloc, hot_rows=hot, active_tail_blocks=TAIL_BLOCKS, max_blocks=max_blocks,
                            resolver=functools.partial(resolve_reference, policy=policy))
    first = -(-(bench.context_tokens + params.q_rows) // BLOCK_TOKENS)
    reqs = [session.add_request(f"r{i}", alloc.allocate(first)) for i in range(bench.requests)]
    for req in reqs:
        session.spill(req)
    sums = np.zeros(4)
    try:
        for step in range(total_steps):
            for req, ctx in zip(reqs, contexts[step]):
                ensure_blocks(session, alloc, req, int(ctx) + params.q_rows)
            _, counters = session.resolve(reqs, 0, torch.from_numpy(selections[step]), step + 1)
            if step >= bench.warmup_steps:
                sums += counters.sum(0).numpy()
    finally:
        for req in reqs:
            session.release(req)
        c.close()
    resident, hit, missing, overflow = sums / bench.steps
    not_resident = hit + missing + overflow
    return dict(hit_rate=hit / not_resident if not_resident else 1.0,
                miss_per_req=missing / bench.requests, overflow_per_req=overflow / bench.requests,
                resident_per_req=resident / bench.requests,
                host_mb_layer=missing * GLM_ROW_BYTES / 1e6)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 requests, 300 steps, overlap 0.90 only")
    args = ap.parse_args(argv)
    bench = QUICK if args.quick else FULL
    t0 = time.monotonic()
    results: dict[tuple[float, int, str], dict[str, float]] = {}
    with start_daemon("1GiB") as daemon:
        sock = daemon.socket
        print(f"{bench.requests} requests, top-k {bench.topk} of ~{bench.context_tokens} tokens, "
              f"{bench.steps} steps after {bench.warmup_steps} warm-up; per layer unless said")
        print(f"{'overlap':>7} {'H/K':>3} {'policy':>6} {'hit %':>6} {'miss/req':>8} {'ovf/req':>7} "
              f"{'MB/step':>8} {'GB/step x78':>11}")
        for overlap in bench.overlaps:
            trace = make_trace(bench, overlap)
            for factor in bench.hot_factors:
                for policy in ("lru", "fifo"):
                    r = run_config(sock, bench, trace, factor * bench.topk, policy)
                    results[(overlap, factor, policy)] = r
                    print(f"{overlap:7.2f} {factor:3d} {policy:>6} {100 * r['hit_rate']:6.2f} "
                          f"{r['miss_per_req']:8.1f} {r['overflow_per_req']:7.1f} {r['host_mb_layer']:8.3f} "
                          f"{r['host_mb_layer'] * GLM_LAYERS / 1e3:11.3f}", flush=True)
    for overlap in bench.overlaps:
        lru, fifo = results[(overlap, 2, "lru")], results[(overlap, 2, "fifo")]
        ratio = lru["host_mb_layer"] / fifo["host_mb_layer"] if fifo["host_mb_layer"] else float("nan")
        print(f"headline (overlap {overlap:.2f}, H = 2x top-k): LRU miss bytes / FIFO miss bytes = {ratio:.3f}")
    print(f"took {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
