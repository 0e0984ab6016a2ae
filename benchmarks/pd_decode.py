"""pd_decode: a decode engine's scheduler while its own client promotes pages from the cluster.

Two "nodes" on this machine share one ``mooncake_master`` (``benchmarks/
cluster.py``'s master and daemons). A prefill side stores ``--size`` of
pages of the decode engine's namespace on node A (write-behind puts them in
the cluster). The decode engine on node B is vLLM's real ``Scheduler`` with
the hisparse ``OffloadingConnector`` (``tests/vllm/harness.py``, no model),
decoding ``--requests`` requests. Its manager's own client then promotes
every page with one waited ``prefetch`` (the call ``vllm/cluster.py``
makes), while the engine keeps stepping.

Per phase (no promotion, then promotion), on the same engine: p50/p99 of
``schedule()``, the share of the phase's wall time spent inside it
(blocked share), and the scheduler's failed ``prepare_store`` calls.
Ratios promotion / none.

    python benchmarks/pd_decode.py [--size 64MiB] [--requests 4] [--seconds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from contextlib import ExitStack

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks._common import percentile  # noqa: E402
from benchmarks.cluster import _cluster, _keys, _wait, daemon, master  # noqa: E402
from hisparse import client, format_size, parse_size  # noqa: E402
from hisparse.protocol import MAX_KEYS_PER_REQUEST  # noqa: E402


def manager_of(engine):
    return engine.manager


def phase(engine, seconds: float, stop: threading.Event | None = None) -> tuple[list[float], float]:
    """Step for ``seconds`` (or until ``stop``): schedule() times and the phase's wall time."""
    start = len(engine.schedule_s)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds if stop is None else not stop.is_set():
        engine.step()
    return engine.schedule_s[start:], time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="64MiB", help="bytes promoted (whole pages of the engine's layout)")
    p.add_argument("--requests", type=int, default=4, help="requests decoding meanwhile")
    p.add_argument("--seconds", type=float, default=3.0, help="length of the no-promotion phase")
    args = p.parse_args(argv)
    from tests.vllm import harness

    log_dir = tempfile.mkdtemp(prefix="hisparse-pd-bench-")
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, log_dir, True)
        addr, metadata = stack.enter_context(master(log_dir))
        size = parse_size(args.size)
        knobs = {"backend": "mooncake", "master": addr, "metadata_server": metadata,
                 "local_hostname": "127.0.0.1", "segment_size": str(size * 3 // 4 + (64 << 20)),
                 "timeout": "120", "queue_pages": str(1 << 22)}
        a_sock = stack.enter_context(daemon(3 * size, knobs))  # region, table and index
        b_sock = stack.enter_context(daemon(3 * size, knobs))
        engine = harness.VllmEngine(b_sock, engine_id="decode-b", deadline_s=0.02, timeout_s=1.0,
                                    capacity=str(2 * size), num_blocks=256)  # the adapter's defaults
        _wait("the engine's cluster probe", lambda: manager_of(engine)._cluster._enabled, timeout_s=60)
        stack.callback(engine.shutdown)
        manager = engine.manager
        ns, layout = manager._ops.client.namespace, manager._ops.client.layout
        n = size // layout.page_bytes
        failed = [0, 0]
        prepare_store = manager.prepare_store

        def recording(keys, req_context):  # the scheduler's own calls, as vLLM makes them
            out = prepare_store(keys, req_context)
            failed[0] += 1
            failed[1] += out is None
            return out

        manager.prepare_store = recording
        keys = _keys("prefill", n)
        data = np.random.default_rng(0).integers(0, 256, (n, layout.page_bytes), dtype=np.uint8)
        with client.attach(ns, layout, socket=a_sock, capacity=2 * size, timeout_s=120) as ca:
            assert ca.store(keys, data) == n
            _wait("A's write-behind", lambda: _cluster(a_sock)["put_pages"] >= n, timeout_s=600)
        for r in range(args.requests):
            engine.add(f"d{r}", harness.prompt(100 + r, 48), max_tokens=100_000)
        phase(engine, 1.0)  # warm up: prefills done, decoding
        base, base_wall = phase(engine, args.seconds)
        base_failed = list(failed)
        took: dict[str, float] = {}
        stop = threading.Event()

        def promote() -> None:
            t0 = time.perf_counter()
            try:  # the engine's own promotion path (vllm/cluster.py), on its manager's client
                for start in range(0, n, MAX_KEYS_PER_REQUEST):  # as its sender thread chunks
                    manager._cluster._send(keys[start:start + MAX_KEYS_PER_REQUEST])
            finally:
                took["s"] = time.perf_counter() - t0
                stop.set()

        threading.Thread(target=promote, daemon=True).start()
        during, during_wall = phase(engine, 0, stop)
        during_failed = [failed[0] - base_failed[0], failed[1] - base_failed[1]]
        promoted = _cluster(b_sock)["promoted_pages"]
    print(f"pd_decode: {promoted} of {n} pages of {layout.page_bytes:,} B "
          f"({format_size(n * layout.page_bytes)}) promoted in {took['s']:.2f} s by the decode "
          f"engine's own client; {args.requests} requests decoding; load average {os.getloadavg()[0]:.1f}")
    print(f"{'':18}{'steps':>7}{'p50 ms':>9}{'p99 ms':>9}{'blocked':>9}{'failed prepare_store':>22}")
    rows = (("no promotion", base, base_wall, base_failed), ("promotion", during, during_wall, during_failed))
    for name, s, wall, f in rows:
        print(f"{name:18}{len(s):7}{percentile(s, 50) * 1e3:9.2f}{percentile(s, 99) * 1e3:9.2f}"
              f"{sum(s) / wall:9.3f}{f'{f[1]} of {f[0]}':>22}")
    print(f"ratio promotion/none: p99 schedule() {percentile(during, 99) / percentile(base, 99):.2f}, "
          f"blocked share {(sum(during) / during_wall) / (sum(base) / base_wall):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
