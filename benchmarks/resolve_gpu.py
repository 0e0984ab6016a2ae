"""The fused resolver on a GPU: correctness, CUDA-graph replay, and speed against two baselines.

    python benchmarks/resolve_gpu.py [--requests 64] [--topk 2048] [--hot 4096]
    python benchmarks/resolve_gpu.py --cpu --requests 2   # the harness alone, interpreted

64 requests x 2048 top-k over ~80K-token contexts, 656-byte rows, host rows
in pinned host memory read through UVA, at miss rates near 1%, 10% and 100%.
For each rate:

1. ``resolve`` (eager), ``resolve_unfused`` and a CUDA-graph replay of
   ``resolve`` are each checked against ``resolve_reference`` with
   ``equiv.compare`` (equal up to the victim choices the contract leaves
   free); a second replay after bumping the device ``step`` checks that a
   graph sees the new step;
2. the graph replay is timed (state restored before each replay, outside
   the timed span), so is the unfused baseline;
3. miss-copy bandwidth = loaded rows x 656 B / replay time, as a ratio of a
   pinned host-to-device ``copy_`` measured in the same run (target >= 0.7
   where copies dominate, i.e. at 100% misses); speed-up = unfused time /
   resolve time (target >= 3x).

Exits 1 when a correctness check fails (targets missed only print).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hisparse.kernels import resolve, resolve_reference  # noqa: E402
from hisparse.kernels.cases import CaseSpec, make_case  # noqa: E402
from hisparse.kernels.equiv import STATE, compare, snapshot  # noqa: E402
from hisparse.kernels.unfused import resolve_unfused  # noqa: E402

ROW_BYTES = 656
BLOCK_TOKENS = 64
CONTEXT_TOKENS = 80_000


class _DevicePointer:
    """A device address as a CUDA Array Interface v3 object, for ``torch.as_tensor``."""

    def __init__(self, address: int, shape: tuple[int, ...], owner: torch.Tensor) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}
        self._owner = owner  # the pinned host tensor must outlive the view


def _host_device_pointer(address: int) -> int:
    """cuMemHostGetDevicePointer through cuda-python, else libcuda through ctypes."""
    try:
        try:
            from cuda.bindings import driver
        except ImportError:
            from cuda import cuda as driver  # cuda-python < 12.6
        err, dptr = driver.cuMemHostGetDevicePointer(address, 0)
        if int(err) != 0:
            raise RuntimeError(f"cuMemHostGetDevicePointer failed: {err}")
        return int(dptr)
    except ImportError:
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        dptr = ctypes.c_uint64()
        rc = lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), ctypes.c_void_p(address), 0)
        if rc != 0:
            raise RuntimeError(f"cuMemHostGetDevicePointer_v2 returned {rc}")
        return dptr.value


def uva_view(host: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over pinned host memory: kernels read it over PCIe, no copy."""
    assert host.is_pinned() and host.is_contiguous() and host.dtype == torch.uint8
    dptr = _host_device_pointer(host.data_ptr())
    view = torch.as_tensor(_DevicePointer(dptr, tuple(host.shape), host))  # no device=: never a copy
    assert view.is_cuda and view.data_ptr() == dptr
    return view


def pinned_h2d_gbps(nbytes: int = 1 << 29, reps: int = 5) -> float:
    """Best pinned host-to-device ``copy_`` bandwidth, GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(reps + 1):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        dst.copy_(src, non_blocking=True)
        t1.record()
        t1.synchronize()
        best = min(best, t0.elapsed_time(t1) / 1e3)
    return nbytes / best / 1e9


def build(args: argparse.Namespace, miss: float, device: str) -> dict[str, Any]:
    """Resolve arguments at about ``miss`` misses among non-resident positions."""
    nb = -(-CONTEXT_TOKENS // BLOCK_TOKENS)
    spec = CaseSpec(batch=args.requests, num_real=args.requests, q_rows=1, topk=args.topk,
                    block_tokens=BLOCK_TOKENS, num_blocks=nb, hot=args.hot, row_bytes=ROW_BYTES,
                    resident_frac=0.02, host_frac=1.0, hot_frac=1.0 - miss, pad_frac=0.0,
                    host_pages=args.host_pages, step=1000, seed=int(miss * 1000))
    case = make_case(spec)
    if device == "cpu":
        return case
    pinned = torch.empty(case["host_rows"].shape, dtype=torch.uint8, pin_memory=True)
    pinned.copy_(case["host_rows"])
    gpu = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    gpu["host_rows"] = uva_view(pinned)
    return gpu


def run_checked(name: str, fn: Any, args: dict[str, Any], problems: list[str]) -> torch.Tensor:
    """Run ``fn`` on ``args`` (mutating its state) and compare with the reference; returns counters."""
    before = snapshot(args)
    ref_args = snapshot(args)
    ref_rows, ref_cnt = resolve_reference(**ref_args)
    rows, cnt = fn(args)
    if args["topk"].is_cuda:
        torch.cuda.synchronize()
    got = (rows, cnt, {k: args[k] for k in STATE})
    found = compare(before, (ref_rows, ref_cnt, {k: ref_args[k] for k in STATE}), got)
    problems += [f"{name}: {p}" for p in found]
    print(f"  {name:<16} {'ok' if not found else 'FAILED: ' + found[0]}", flush=True)
    return cnt.cpu()


def timed(fn: Any, restore: Any, reps: int) -> float:
    """Median seconds of ``fn()`` on the GPU, ``restore()`` run untimed before each."""
    times = []
    for _ in range(reps):
        restore()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        fn()
        t1.record()
        t1.synchronize()
        times.append(t0.elapsed_time(t1) / 1e3)
    return statistics.median(times)


def bench_rate(args: argparse.Namespace, miss: float, h2d: float, problems: list[str]) -> None:
    device = "cpu" if args.cpu else "cuda"
    case = build(args, miss, device)
    saved = {k: case[k].clone() for k in ("hot_tags", "hot_stamp")}

    def restore() -> None:
        for k, v in saved.items():
            case[k].copy_(v)

    restore()
    cnt = run_checked("resolve eager", lambda a: resolve(**a), case, problems)
    restore()
    run_checked("unfused torch", lambda a: resolve_unfused(**a), case, problems)
    total = cnt.sum(0).tolist()
    non_res = max(1, total[1] + total[2] + total[3])
    print(f"  miss rate {total[2] / non_res:.3f}: {total[2]} rows loaded, {total[3]} overflow, "
          f"{total[0]} resident, {total[1]} hot", flush=True)
    if args.cpu:
        return

    out = (torch.empty_like(case["topk"]), torch.empty((args.requests, 4), dtype=torch.int32, device="cuda"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside capture
        restore()
        resolve(**case, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        resolve(**case, out=out)
    restore()
    run_checked("graph replay", lambda a: (graph.replay(), out)[1], case, problems)
    case["step"].add_(1)  # the graph must read the new step on device
    run_checked("replay, step+1", lambda a: (graph.replay(), out)[1], case, problems)
    case["step"].sub_(1)

    t_fused = timed(graph.replay, restore, args.reps)
    t_unfused = timed(lambda: resolve_unfused(**case), restore, max(3, args.reps // 4))
    moved = total[2] * ROW_BYTES
    gbps = moved / t_fused / 1e9
    print(f"  resolve {t_fused * 1e6:9.1f} us   unfused {t_unfused * 1e6:9.1f} us   "
          f"speed-up {t_unfused / t_fused:5.1f}x (target >= 3)", flush=True)
    print(f"  miss copy {gbps:6.2f} GB/s = {gbps / h2d:.2f} of pinned memcpy {h2d:.1f} GB/s "
          f"(target >= 0.7 when copies dominate)", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--hot", type=int, default=4096, help="hot rows per request")
    ap.add_argument("--host-pages", type=int, default=4096, help="pages in the host slab")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.01, 0.10, 1.0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cpu", action="store_true", help="check the harness on CPU (interpreted, no timing)")
    args = ap.parse_args(argv)
    if args.cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        print("resolve_gpu: no CUDA device (use --cpu to check the harness)", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    h2d = 0.0 if args.cpu else pinned_h2d_gbps()
    if not args.cpu:
        print(f"{torch.cuda.get_device_name()}: pinned host-to-device copy {h2d:.1f} GB/s")
    problems: list[str] = []
    for miss in args.rates:
        print(f"miss rate ~{miss:.2f}: {args.requests} requests x {args.topk} top-k, H {args.hot}, "
              f"{ROW_BYTES} B rows", flush=True)
        bench_rate(args, miss, h2d, problems)
    print(f"took {time.monotonic() - t0:.1f} s; {'all checks passed' if not problems else 'CHECKS FAILED'}")
    for p in problems[:20]:
        print("  " + p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
