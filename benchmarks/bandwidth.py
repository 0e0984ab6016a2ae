"""bandwidth: store and load through the client against torch ``copy_`` of the same bytes.

Both sides run in this one run, interleaved rep by rep, on the same pages:

- hisparse ``store``: reserve -> strided copy into the region's layer-major
  layout -> commit, fresh keys every rep (so the region evicts as it fills);
  ``load``: pin -> copy out -> unpin of one stored chain;
- the baseline: ``copy_`` of the same bytes between two plain tensors (CPU),
  or between the GPU and a pinned host tensor (``--device cuda``: D2H for
  store, H2D for load), which is what a private pinned pool would do.

Page size is GLM-5's: 78 layers x 64 tokens x 656 B = 3,274,752 B.

    python benchmarks/bandwidth.py [--device cpu|cuda] [--size 256MiB] [--reps 15] [--copy kernel]
        [--whole] [--shm-dir DIR]
    # target: ratio >= 0.8 each way

On CUDA the client copies on the GPU's copy engines (one 2D copy per page);
``--copy kernel`` measures the gather/scatter kernel it falls back to instead.
There a call of 32 MiB or more goes in pieces, its daemon requests overlapping
the copies (``hisparse.client.pipeline``); ``--whole`` measures it in one
piece instead, which is what the pieces gain over.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hisparse import KVLayout, client, format_size, parse_size  # noqa: E402
from hisparse.local import start_daemon  # noqa: E402

TARGET = 0.8


def keys_for(rep: int, n: int) -> list[bytes]:
    return [hashlib.sha256(f"bandwidth/{rep}/{i}".encode()).digest() for i in range(n)]


def timed(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def run(device: str, size_bytes: int, reps: int, layout: KVLayout,
        shm_dir: str | None = None) -> dict[str, float]:
    import torch

    n = max(1, size_bytes // layout.page_bytes)
    nbytes = n * layout.page_bytes
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    pages = torch.randint(0, 256, (n, layout.page_bytes), dtype=torch.uint8, device=device)
    out = torch.empty_like(pages).fill_(1)  # touched, as an engine's buffers are
    # the baseline's other end: a plain host tensor, pinned when the pages are on a GPU
    host = torch.empty((n, layout.page_bytes), dtype=torch.uint8, pin_memory=cuda).fill_(1)
    region_pages = 3 * n  # a few reps fit, then every store evicts as much as it writes
    capacity = region_pages * layout.page_bytes
    samples: dict[str, list[float]] = {k: [] for k in ("store", "load", "copy_store", "copy_load")}
    extra = ("--shm-dir", shm_dir) if shm_dir else ()
    with start_daemon(str(capacity + (64 << 20)), extra=extra) as daemon:
        with client.attach("bench/bandwidth", layout, socket=daemon.socket, capacity=capacity,
                           populate=not cuda, timeout_s=30) as c:
            print(f"bandwidth: {n} pages of {layout.page_bytes:,} B ({format_size(nbytes)}) per rep, "
                  f"device {device}, {reps} reps, hisparsed pid {daemon.pid}", flush=True)
            loaded_keys = keys_for(-1, n)
            assert c.store(loaded_keys, pages) == n  # warm-up: registration, first touch
            assert c.load(loaded_keys, out) == n and torch.equal(out, pages), "round trip not exact"
            host.copy_(pages)
            pages.copy_(host)
            sync()
            for rep in range(reps):
                keys = keys_for(rep, n)
                samples["store"].append(timed(lambda: c.store(keys, pages), sync))
                samples["copy_store"].append(timed(lambda: host.copy_(pages, non_blocking=cuda), sync))
                samples["load"].append(timed(lambda: c.load(loaded_keys, out), sync))
                samples["copy_load"].append(timed(lambda: out.copy_(host, non_blocking=cuda), sync))
            out.zero_()
            assert c.load(loaded_keys, out) == n and torch.equal(out, pages), "round trip not exact"
    return {k: nbytes / statistics.median(v) / 1e9 for k, v in samples.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--size", default="256MiB", help="bytes per rep (whole pages)")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--layout", default="78,64,656", help="layers,block_tokens,row_bytes")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (both sides)")
    p.add_argument("--copy", choices=["engines", "kernel"], default="engines",
                   help="CUDA only: the copy engines (the default path) or the fall-back kernel")
    p.add_argument("--whole", action="store_true",
                   help="CUDA: every call in one piece (no overlap of its daemon requests with its copies)")
    p.add_argument("--shm-dir", default=None,
                   help="the daemon's region directory (default: a private one in /dev/shm); "
                        "a hugetlbfs mount gives the region huge pages")
    args = p.parse_args(argv)
    import torch

    if args.device == "cuda":
        from hisparse.client.backends import cuda

        cuda.backend_for(torch.cuda.current_device()).copy_engines = args.copy == "engines"
    if args.whole:
        from hisparse.client import pipeline

        pipeline.PIECE_BYTES = 1 << 62

    if args.threads:
        torch.set_num_threads(args.threads)
    layout = KVLayout(*(int(x) for x in args.layout.split(",")))
    gbps = run(args.device, parse_size(args.size), args.reps, layout, args.shm_dir)
    base = "pinned torch copy_" if args.device == "cuda" else "torch copy_"
    if args.device == "cuda":
        print(f"client copies on: {'the copy engines' if args.copy == 'engines' else 'the kernel'}, "
              f"{'whole calls' if args.whole else 'large calls in pieces'}")
    ratios = {"store": gbps["store"] / gbps["copy_store"], "load": gbps["load"] / gbps["copy_load"]}
    for way in ("store", "load"):
        print(f"{way:<5}  hisparse {gbps[way]:7.2f} GB/s   {base} {gbps['copy_' + way]:7.2f} GB/s   "
              f"ratio {ratios[way]:.2f}  (median of {args.reps})")
    ok = all(r >= TARGET for r in ratios.values())
    print(f"ratio store {ratios['store']:.2f} load {ratios['load']:.2f} "
          f"(target >= {TARGET}: {'met' if ok else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
