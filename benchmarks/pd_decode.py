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
Ratios promotion / none. Beside them, the decode daemon's own answer
time: a separate process pings it every ``PING_EVERY_S`` (p99 and the
longest wait, which is how long the daemon was silent at most).

    python benchmarks/pd_decode.py [--size 64MiB] [--requests 4] [--seconds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
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
from hisparse.ctl import Control  # noqa: E402
from hisparse.errors import HisparseError  # noqa: E402
from hisparse.protocol import MAX_KEYS_PER_REQUEST, Op  # noqa: E402


PING_EVERY_S = 0.005
# Pings the daemon until its stdin closes, then prints "sent_at answer_s" per ping.
# A process of its own, so that the engine's Python threads do not delay its pings.
PINGER = """
import sys, threading, time
from hisparse.ctl import Control
from hisparse.protocol import Op
ctl, out, done = Control(sys.argv[1], 60), [], threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
while not done.wait(float(sys.argv[2])):
    t0 = time.time(); ctl.call(Op.PING); out.append((t0, time.time() - t0))
print("\\n".join(f"{t!r} {s!r}" for t, s in out))
"""


def pinger(socket_path: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PINGER, socket_path, str(PING_EVERY_S)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT})


def pings(proc: subprocess.Popen) -> list[tuple[float, float]]:
    out, _ = proc.communicate(timeout=120)
    return [(float(t), float(s)) for t, s in (line.split() for line in out.splitlines() if line)]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def daemon_pid(socket_path: str) -> int:
    ctl = Control(socket_path, 30)
    try:
        return int(ctl.call(Op.PING)["pid"])
    finally:
        ctl.close()


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
        for attempt in range(3):
            try:
                engine = harness.VllmEngine(b_sock, engine_id="decode-b", deadline_s=0.02, timeout_s=1.0,
                                            capacity=str(2 * size), num_blocks=256)  # the adapter's defaults
                break
            except HisparseError:  # its hello waits for the new region, past the engine's 1 s on a
                if attempt == 2:   # busy machine; the daemon finishes it, and the next hello finds it
                    raise
                time.sleep(5)
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
        probe = pinger(b_sock)
        stack.callback(probe.kill)
        phase(engine, 1.0)  # warm up: prefills done, decoding
        b_pid = daemon_pid(b_sock)
        base_t0, base_cpu0 = time.time(), cpu_s(b_pid)
        base, base_wall = phase(engine, args.seconds)
        during_t0, during_cpu0 = time.time(), cpu_s(b_pid)
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
        during_t1, during_cpu1 = time.time(), cpu_s(b_pid)
        during_failed = [failed[0] - base_failed[0], failed[1] - base_failed[1]]
        tier = _cluster(b_sock)
        promoted = tier["promoted_pages"]
        answers = pings(probe)
    base_ping = [s for t, s in answers if base_t0 <= t < during_t0]
    during_ping = [s for t, s in answers if during_t0 <= t < during_t1]
    print(f"pd_decode: {promoted} of {n} pages of {layout.page_bytes:,} B "
          f"({format_size(n * layout.page_bytes)}) promoted in {took['s']:.2f} s by the decode "
          f"engine's own client; {args.requests} requests decoding; load average {os.getloadavg()[0]:.1f}")
    print(f"decode daemon: {during_cpu1 - during_cpu0:.2f} CPU s during the promotion "
          f"({(during_cpu0 - base_cpu0) / base_wall:.2f} CPU s/s before it); its cluster worker "
          f"{tier['get_s']:.2f} s in gets, {tier['hash_s']:.2f} s checking")
    print(f"{'':18}{'steps':>7}{'p50 ms':>9}{'p99 ms':>9}{'blocked':>9}{'failed prepare_store':>22}"
          f"{'pings':>7}{'ping p99 ms':>13}{'max ms':>9}")
    rows = (("no promotion", base, base_wall, base_failed, base_ping),
            ("promotion", during, during_wall, during_failed, during_ping))
    for name, s, wall, f, p in rows:
        print(f"{name:18}{len(s):7}{percentile(s, 50) * 1e3:9.2f}{percentile(s, 99) * 1e3:9.2f}"
              f"{sum(s) / wall:9.3f}{f'{f[1]} of {f[0]}':>22}"
              f"{len(p):7}{percentile(p, 99) * 1e3:13.2f}{max(p) * 1e3:9.2f}")
    print(f"ratio promotion/none: p99 schedule() {percentile(during, 99) / percentile(base, 99):.2f}, "
          f"blocked share {(sum(during) / during_wall) / (sum(base) / base_wall):.2f}, "
          f"daemon ping p99 {percentile(during_ping, 99) / percentile(base_ping, 99):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
