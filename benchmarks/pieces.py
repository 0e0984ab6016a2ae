"""pieces: how much of a large call's daemon time the pieces hide, on any machine.

A GPU's copy engines move bytes without the host's CPU, so a store or load
in pieces (``hisparse.client.pipeline``) overlaps its reserve/commit (or
pin/unpin) requests with its copies. This program measures that overlap
without a GPU: the client and the daemon are real (a real hisparsed, real
requests, real fences), and only the copy engine is modelled. It takes
``bytes / --gbps`` of wall time per copy, queued behind the one before (an
engine's timeline), and no CPU; ``wait()`` sleeps until the copy's end, as
a CUDA event's wait leaves the GIL to the transport's thread.

Both ways run in this one run, interleaved rep by rep, on GLM-5 pages:
whole (one reserve, the copies, one commit) and in pieces. Printed: each
way's time against the modelled copy alone (1.0 would be no overhead at
all), the ratio whole/pieces, and where the copy engine waited: before its
first copy (the first reserve or pin) and after its last (the last commit
or unpin). ``benchmarks/bandwidth.py --device cuda`` (and ``--whole``) is
the same comparison on a real GPU.

    python benchmarks/pieces.py [--size 256MiB] [--reps 30] [--gbps 55]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hisparse import KVLayout, client, format_size, parse_size  # noqa: E402
from hisparse.client import backends, pipeline  # noqa: E402
from hisparse.client.backends import cpu  # noqa: E402
from hisparse.local import start_daemon  # noqa: E402

WHOLE = 1 << 62  # pipeline.PIECE_BYTES that keeps every call whole


class ModelledEngine(cpu.CpuBackend):
    """Copies that take wall time on one engine's timeline and no CPU (no bytes move)."""

    overlaps = True

    def __init__(self, gbps: float) -> None:
        super().__init__()
        self.bytes_per_s = gbps * 1e9
        self.first_start = self.last_end = 0.0

    def _queue(self, nbytes: int) -> "Landing":
        now = time.perf_counter()
        if self.last_end == 0.0:
            self.first_start = now
        end = self.last_end = max(self.last_end, now) + nbytes / self.bytes_per_s
        return Landing(end)

    def scatter_async(self, region, page_ids, pages, rows):  # type: ignore[override]
        return self._queue(len(page_ids) * pages.shape[1])

    def gather_async(self, region, page_ids, out):  # type: ignore[override]
        return self._queue(len(page_ids) * out.shape[1])

    def scatter(self, region, page_ids, pages, rows):  # type: ignore[override]
        self.scatter_async(region, page_ids, pages, rows).wait()

    def gather(self, region, page_ids, out):  # type: ignore[override]
        self.gather_async(region, page_ids, out).wait()


class Landing:
    def __init__(self, end: float) -> None:
        self.end = end

    def wait(self) -> None:
        left = self.end - time.perf_counter()
        if left > 0:
            time.sleep(left)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="256MiB", help="bytes per call (whole pages)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--gbps", type=float, default=55.0, help="the modelled engine's GB/s (an H200's: 55)")
    p.add_argument("--layout", default="78,64,656", help="layers,block_tokens,row_bytes")
    args = p.parse_args(argv)
    layout = KVLayout(*(int(x) for x in args.layout.split(",")))
    n = max(1, parse_size(args.size) // layout.page_bytes)
    engine = ModelledEngine(args.gbps)
    backends.for_tensor = lambda tensor: engine  # this process's client copies on the model
    pages = np.zeros((n, layout.page_bytes), dtype=np.uint8)  # never touched: no bytes move
    out = np.zeros_like(pages)
    copy_s = n * layout.page_bytes / engine.bytes_per_s
    capacity = 3 * n * layout.page_bytes  # every store evicts as much as it writes
    ways = {"whole": WHOLE, "pieces": pipeline.PIECE_BYTES}
    samples: dict[str, list[float]] = {f"{w} {c}": [] for w in ways for c in ("store", "load", "wait before",
                                                                               "wait after")}
    with start_daemon(str(capacity + (64 << 20))) as daemon:
        with client.attach("bench/pieces", layout, socket=daemon.socket, capacity=capacity,
                           populate=True, timeout_s=30) as c:
            held = [hashlib.sha256(b"pieces/held/%d" % i).digest() for i in range(n)]
            c.store(held, pages)
            print(f"pieces: {n} pages of {layout.page_bytes:,} B ({format_size(n * layout.page_bytes)}) per call, "
                  f"modelled engine {args.gbps:g} GB/s ({copy_s * 1e3:.2f} ms a call), {args.reps} reps, "
                  f"{len(pipeline.pieces(n, layout.page_bytes))} pieces, hisparsed pid {daemon.pid}", flush=True)
            for rep in range(args.reps):
                for way, piece_bytes in ways.items():
                    pipeline.PIECE_BYTES = piece_bytes
                    keys = [hashlib.sha256(b"pieces/%s/%d/%d" % (way.encode(), rep, i)).digest()
                            for i in range(n)]
                    for call, fn in (("store", lambda: c.store(keys, pages)), ("load", lambda: c.load(held, out))):
                        engine.last_end = 0.0
                        t0 = time.perf_counter()
                        fn()
                        t1 = time.perf_counter()
                        samples[f"{way} {call}"].append(t1 - t0)
                        if call == "store":
                            samples[f"{way} wait before"].append(engine.first_start - t0)
                            samples[f"{way} wait after"].append(t1 - engine.last_end)
            pipeline.PIECE_BYTES = ways["pieces"]
    med = {k: statistics.median(v) for k, v in samples.items()}
    for way in ways:
        print(f"{way:<6}  store {med[way + ' store'] * 1e3:6.2f} ms ({copy_s / med[way + ' store']:.2f} of the "
              f"copy alone)  load {med[way + ' load'] * 1e3:6.2f} ms ({copy_s / med[way + ' load']:.2f})  "
              f"store's engine idle: {med[way + ' wait before'] * 1e3:.2f} ms before, "
              f"{med[way + ' wait after'] * 1e3:.2f} ms after  (median of {args.reps})")
    print(f"ratio whole/pieces: store {med['whole store'] / med['pieces store']:.2f} "
          f"load {med['whole load'] / med['pieces load']:.2f} (above 1: the pieces are faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
