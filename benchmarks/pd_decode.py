"""pd_decode: a decode engine's scheduler while its own client promotes pages from the cluster.

Two "nodes" on this machine share one ``mooncake_master`` (``benchmarks/
cluster.py``'s master and daemons). A prefill side stores ``--size`` of
pages of the decode engine's namespace on node A (write-behind puts them in
the cluster). The decode engine on node B is vLLM's real ``Scheduler`` with
the hisparse ``OffloadingConnector`` (``tests/vllm/harness.py``, no model),
decoding ``--requests`` requests. Its manager's own senders then promote
every page, as ``vllm/cluster.py`` does a long prompt's keys (one item,
its waited ``prefetch`` calls one after another on the manager's client),
while the engine keeps stepping.

Requests keep arriving in both phases, one every ``--arrive-every``
steps: each starts with a 64-token prefix that a prefill engine on node B
computed before (its blocks held by B's daemon, never in the decode
engine's GPU cache), then 32 new tokens. So the scheduler looks held
blocks up and stores new ones while the promotion runs, as in a P/D
decode node.

Per phase (no promotion, then promotion), on the same engine: p50/p99 of
``schedule()``, the share of the phase's wall time spent inside it
(blocked share), the scheduler's failed ``prepare_store`` calls and the longest
one (its reserve has ``deadline_s``, 20 ms: a longer answer fails it), the
arrivals that recomputed any of their held prefix (a held block that
answered MISS), and the time from an arrival to its end (its new keys are
asked of the cluster first: while they wait, so does the request), in ms
and in engine steps (the harness checks every token's KV each step, so a
step grows longer as the decoding requests grow, whatever the tier does). Ratios
promotion / none. Beside them, the decode daemon's own answer time: a
separate process pings it every ``PING_EVERY_S`` (p99 and the longest
wait, which is how long the daemon was silent at most).

    python benchmarks/pd_decode.py [--size 64MiB] [--requests 4] [--seconds 3] [--arrive-every 4]
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
from hisparse.protocol import Op  # noqa: E402


PING_EVERY_S = 0.005
HELD_TOKENS, NEW_TOKENS = 64, 32  # an arrival's prompt: a held prefix (whole blocks), then its own
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


class Arrivals:
    """Requests whose prompts begin with a prefix another engine computed (held by the daemon)."""

    def __init__(self, engine, held: list[list[int]], every: int) -> None:
        self.engine, self.held, self.every = engine, held, every
        self.added: list[str] = []
        self.steps = 0
        self.added_at: dict[str, tuple[float, int]] = {}
        # from its arrival to its end (its one token): seconds, and engine steps (a step's
        # length grows with the decoding requests' tokens, as the harness checks them all)
        self.wait_s: dict[str, float] = {}
        self.wait_steps: dict[str, int] = {}

    def step(self) -> None:
        """One engine step; a new arrival first, every ``every`` steps, while held prefixes last."""
        from tests.vllm import harness

        if self.every and self.steps % self.every == 0 and len(self.added) < len(self.held):
            i = len(self.added)
            self.added.append(f"a{i}")
            self.engine.add(self.added[-1], self.held[i] + harness.prompt(20_000 + i, NEW_TOKENS))
            self.added_at[self.added[-1]] = time.perf_counter(), self.steps
        self.steps += 1
        self.engine.step()
        self.settle()

    def settle(self) -> None:
        now = time.perf_counter()
        for req_id in list(self.added_at):
            if req_id in self.engine.finished:
                t0, step0 = self.added_at.pop(req_id)
                self.wait_s[req_id], self.wait_steps[req_id] = now - t0, self.steps - step0

    def waits(self, req_ids: list[str]) -> str:
        """p50 and longest time from arrival to end of ``req_ids``: ms, then steps."""
        if not req_ids:
            return "-"
        ms, steps = [self.wait_s[r] * 1e3 for r in req_ids], [self.wait_steps[r] for r in req_ids]
        return f"{percentile(ms, 50):.0f}/{max(ms):.0f} ms, {percentile(steps, 50):.0f}/{max(steps)}"

    def p50(self, req_ids: list[str], steps: bool = False) -> float:
        waits = self.wait_steps if steps else self.wait_s
        return percentile([waits[r] for r in req_ids], 50) if req_ids else float("nan")

    def recomputed(self, req_ids: list[str]) -> int:
        """Of ``req_ids`` (finished), those that computed any token of their held prefix."""
        return sum(self.engine.computed[r] > NEW_TOKENS for r in req_ids)


def phase(arrivals: Arrivals, seconds: float,
          stop: threading.Event | None = None) -> tuple[list[float], float, list[str]]:
    """Step for ``seconds`` (or until ``stop``): schedule() times, the phase's wall time, and
    the requests that arrived in it."""
    engine = arrivals.engine
    start, first = len(engine.schedule_s), len(arrivals.added)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds if stop is None else not stop.is_set():
        arrivals.step()
    return engine.schedule_s[start:], time.perf_counter() - t0, arrivals.added[first:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="64MiB", help="bytes promoted (whole pages of the engine's layout)")
    p.add_argument("--requests", type=int, default=4, help="requests decoding meanwhile")
    p.add_argument("--seconds", type=float, default=3.0, help="length of the no-promotion phase")
    p.add_argument("--arrive-every", type=int, default=4,
                   help="steps between arrivals with a held prefix (0: none)")
    p.add_argument("--held", type=int, default=160, help="held prefixes computed beforehand (arrivals at most)")
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

        store_s: list[float] = []  # each call's time: the daemon's answer to its reserve, mostly

        def recording(keys, req_context):  # the scheduler's own calls, as vLLM makes them
            t0 = time.perf_counter()
            out = prepare_store(keys, req_context)
            store_s.append(time.perf_counter() - t0)
            failed[0] += 1
            failed[1] += out is None
            return out

        manager.prepare_store = recording
        keys = _keys("prefill", n)
        data = np.random.default_rng(0).integers(0, 256, (n, layout.page_bytes), dtype=np.uint8)
        with client.attach(ns, layout, socket=a_sock, capacity=2 * size, timeout_s=120) as ca:
            assert ca.store(keys, data) == n
            _wait("A's write-behind", lambda: _cluster(a_sock)["put_pages"] >= n, timeout_s=600)
        held = [harness.prompt(10_000 + i, HELD_TOKENS) for i in range(args.held)]
        prefill = harness.VllmEngine(b_sock, engine_id="prefill-b", timeout_s=10.0)
        try:  # node B's own prefill engine: its blocks are held by B's daemon, never in decode-b's GPU
            for i, prompt in enumerate(held):
                prefill.add(f"h{i}", prompt)
            prefill.run([f"h{i}" for i in range(len(held))], timeout_s=600)
            prefill.drain(timeout_s=120)
        finally:
            prefill.shutdown()
        arrivals = Arrivals(engine, held, 0)
        for r in range(args.requests):
            engine.add(f"d{r}", harness.prompt(100 + r, 48), max_tokens=100_000)
        probe = pinger(b_sock)
        stack.callback(probe.kill)
        phase(arrivals, 1.0)  # warm up: prefills done, decoding
        arrivals.every = args.arrive_every
        b_pid = daemon_pid(b_sock)
        base_t0, base_cpu0 = time.time(), cpu_s(b_pid)
        base, base_wall, base_arrived = phase(arrivals, args.seconds)
        during_t0, during_cpu0 = time.time(), cpu_s(b_pid)
        base_failed = list(failed)
        took: dict[str, float] = {}
        stop = threading.Event()

        def promote() -> None:
            t0 = time.perf_counter()
            promotions = manager._cluster
            asked = promotions.requested_keys + n  # counted as each waited prefetch is answered
            try:  # the engine's own promotion path (vllm/cluster.py): one item to its senders
                promotions._post(keys)
                _wait("the promotion's prefetches answered", lambda: promotions.requested_keys >= asked,
                      timeout_s=900)
            finally:
                took["s"] = time.perf_counter() - t0
                stop.set()

        threading.Thread(target=promote, daemon=True).start()
        during, during_wall, during_arrived = phase(arrivals, 0, stop)
        during_t1, during_cpu1 = time.time(), cpu_s(b_pid)
        during_failed = [failed[0] - base_failed[0], failed[1] - base_failed[1]]
        while arrivals.added_at:  # the arrivals' lookups were made in their phase
            engine.step()
            arrivals.settle()
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
          f"{'prepare_store max ms':>22}{'held prefix missed':>20}{'arrival p50/max: ms, steps':>28}{'pings':>7}{'ping p99 ms':>13}{'max ms':>9}")
    base_stores = store_s[:base_failed[0]]
    during_stores = store_s[base_failed[0]:base_failed[0] + during_failed[0]]
    rows = (("no promotion", base, base_wall, base_failed, base_stores, base_arrived, base_ping),
            ("promotion", during, during_wall, during_failed, during_stores, during_arrived, during_ping))
    for name, s, wall, f, stores, came, p in rows:
        print(f"{name:18}{len(s):7}{percentile(s, 50) * 1e3:9.2f}{percentile(s, 99) * 1e3:9.2f}"
              f"{sum(s) / wall:9.3f}{f'{f[1]} of {f[0]}':>22}{max(stores, default=0) * 1e3:22.1f}{f'{arrivals.recomputed(came)} of {len(came)}':>20}"
              f"{arrivals.waits(came):>28}"
              f"{len(p):7}{percentile(p, 99) * 1e3:13.2f}{max(p) * 1e3:9.2f}")
    print(f"ratio promotion/none: p99 schedule() {percentile(during, 99) / percentile(base, 99):.2f}, "
          f"blocked share {(sum(during) / during_wall) / (sum(base) / base_wall):.2f}, "
          f"daemon ping p99 {percentile(during_ping, 99) / percentile(base_ping, 99):.2f}, "
          f"arrival p50 {arrivals.p50(during_arrived) / arrivals.p50(base_arrived):.2f} "
          f"({arrivals.p50(during_arrived, True) / arrivals.p50(base_arrived, True):.2f} in steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
