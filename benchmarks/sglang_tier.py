"""SGLang on the node tier: (1) host hit rate and turns/minute with one hisparsed namespace
against SGLang's per-engine HiCache host pools (simulated), (2) store and load of the same
pages through SGLang's storage interface: ``HisparseStore`` against SGLang's own ``file`` and
``mooncake`` backends, measured in one run.

(1) is the planner's shared-pool scenario (``hisparse.sim``, as benchmarks/shared_pool.py) with
SGLang's parameters: GLM-5.3 on 8xH200 as 8 DP-attention schedulers, each with a HiCache host
pool of ``--hicache-ratio`` 2.0 (SGLang's default in cache mode) times its HBM KV budget,
against one node namespace of the same total; full-residency decode (HiCache parks prefixes,
it does not decode past HBM); 16K-token system prompt, a quarter of the turns moving to another
scheduler, rolling engine restarts optional (a restart empties a private pool).

(2) runs SGLang 0.5.23's own cache stack on CPU (``tests.sglang.engine``: the radix cache,
HiCache controller and ``MLATokenToKVPoolHost`` with the CPU stand-ins of
``tests/sglang/cpu_stubs.py``) and calls each backend as SGLang's controller does for a batch
of pages already in the host pool: hisparse and mooncake through the zero-copy v1 calls
(``batch_set_v1``; ``batch_exists`` + ``batch_get_v1``), file through the flat-page calls the
controller uses for it (``get_data_page`` + ``batch_set``; ``batch_get`` +
``set_from_flat_data_page``). hisparsed and the file directory are on tmpfs (memory against
memory); Mooncake runs a real master and its store over TCP on loopback
(mooncake-transfer-engine-non-cuda). Every load is checked byte-exact. Prints GB/s and the
ratio hisparse / each baseline. Run:
``PYTHONPATH=. python benchmarks/sglang_tier.py [--pages N] [--layers L] [--reps R] [--skip-io]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hisparse.sim import des, plan  # noqa: E402
from hisparse.sim.presets import SCENARIOS, HostConfig  # noqa: E402

HICACHE_RATIO = 2.0  # SGLang's default --hicache-ratio in cache mode


def simulate(users: int, restart_interval_s: float) -> None:
    sc = SCENARIOS["glm53-8xh200-shared-pool"]
    sc = replace(sc, workload=replace(sc.workload, restart_interval_s=restart_interval_s))
    e = sc.engine
    per_engine = int(HICACHE_RATIO * plan.kv_budget_bytes(sc.model, sc.node, e) * e.tp)
    total = per_engine * e.dp
    results = {}
    for shared in (True, False):
        sc_mode = replace(sc, baseline_host=HostConfig(park_bytes=total, shared=shared))
        results[shared] = des.simulate(sc_mode, "full", users)
    restarts = f", restarts every {restart_interval_s:.0f} s per engine" if restart_interval_s else ""
    print(f"(1) {e.dp} SGLang DP-attention schedulers, HiCache host pool {per_engine / 2**30:.0f} GiB each "
          f"(--hicache-ratio {HICACHE_RATIO}), {users} users{restarts}")
    print(f"{'host tier':>20} {'running':>8} {'host hit':>9} {'turns/min':>10} {'turn s':>7}")
    for shared, r in results.items():
        name = "hisparsed (shared)" if shared else "SGLang per-engine"
        print(f"{name:>20} {r.mean_running:>8.2f} {r.host_hit_rate:>9.1%} {r.turns_per_min:>10.1f}"
              f" {r.mean_turn_s:>7.1f}")
    s, q = results[True], results[False]
    print(f"ratio node tier / per-engine pools: host hit {s.host_hit_rate / max(q.host_hit_rate, 1e-9):.2f}x,"
          f" turns/min {s.turns_per_min / max(q.turns_per_min, 1e-9):.2f}x")


# -- (2) the same pages through three backends --


def keys_for(tag: str, n: int) -> list[str]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]


class Pages:
    """``n`` pages of random bytes in the engine's host pool, and a second set of slots to load into."""

    def __init__(self, engine, n: int) -> None:
        import torch

        pool = engine.cache.cache_controller.storage_host_pool
        pool.pin_memory = False  # CPU stand-in: file's staging pages would ask for pinned memory
        self.pool, self.ps, self.n = pool, pool.page_size, n
        self.src = pool.alloc(n * self.ps)
        self.dst = pool.alloc(n * self.ps)
        assert self.src is not None and self.dst is not None, "host pool too small"
        flat = pool.get_data_page(0, flat=True)
        gen = torch.Generator().manual_seed(1)
        for i in range(n):
            noise = torch.randint(0, 256, (flat.numel() * flat.element_size(),), dtype=torch.uint8, generator=gen)
            pool.set_from_flat_data_page(int(self.src[i * self.ps]), noise.view(flat.dtype))
        self.page_bytes = flat.numel() * flat.element_size()

    def check(self) -> None:
        import torch

        for i in range(self.n):
            a = self.pool.get_data_page(int(self.src[i * self.ps]), flat=True)
            b = self.pool.get_data_page(int(self.dst[i * self.ps]), flat=True)
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"page {i} differs"


def v1_round(backend, pages: Pages, keys: list[str]) -> tuple[float, float]:
    t0 = time.perf_counter()
    assert all(backend.batch_set_v1(keys, pages.src))
    t1 = time.perf_counter()
    assert backend.batch_exists(keys) == len(keys)
    assert all(backend.batch_get_v1(keys, pages.dst))
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def file_round(backend, pages: Pages, keys: list[str]) -> tuple[float, float]:
    pool, ps = pages.pool, pages.ps
    t0 = time.perf_counter()
    assert backend.batch_set(keys, [pool.get_data_page(int(pages.src[i * ps])) for i in range(len(keys))])
    t1 = time.perf_counter()
    assert backend.batch_exists(keys) == len(keys)
    got = backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    for i, page in enumerate(got):
        assert page is not None
        pool.set_from_flat_data_page(int(pages.dst[i * ps]), page)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def mooncake_backend(stack: ExitStack, engine, log_dir: str, segment_bytes: int):
    from benchmarks.peers import _free_port, _listening, _process, _wait
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    bindir = os.path.dirname(sys.executable)
    master = shutil.which("mooncake_master") or os.path.join(bindir, "mooncake_master")
    meta, rpc, metrics = (_free_port() for _ in range(3))
    stack.enter_context(_process(
        [master, "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
         f"--http_metadata_server_port={meta}", "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
         "--metrics_host=127.0.0.1", f"--metrics_port={metrics}", "--enable_metric_reporting=false",
         "--default_kv_lease_ttl=2000"], log_dir, "mooncake_master"))
    _wait("mooncake_master", lambda: _listening(rpc) and _listening(meta))
    config = engine.backend.storage_config
    extra = {"master_server_address": f"127.0.0.1:{rpc}",
             "metadata_server": f"http://127.0.0.1:{meta}/metadata", "protocol": "tcp",
             "global_segment_size": segment_bytes, "local_hostname": "127.0.0.1", "check_server": False}
    store = MooncakeStore(replace(config, extra_config=extra), engine.cache.cache_controller.storage_host_pool)
    store.register_mem_pool_host(engine.cache.cache_controller.storage_host_pool)
    stack.callback(lambda: getattr(store, "close", lambda: None)())
    return store


def measure_io(n: int, layers: int, reps: int) -> None:
    from hisparse.local import shm_base, start_daemon
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile
    from tests.sglang.engine import Engine

    page_size, row_dim = 64, 576  # GLM-5 / DeepSeek MLA: 512 latent + 64 rope, bf16
    with ExitStack() as stack:
        log_dir = tempfile.mkdtemp(prefix="hisparse-sglang-bench-")
        stack.callback(shutil.rmtree, log_dir, True)
        page_bytes = layers * page_size * row_dim * 2
        region = (2 * reps + 2) * n * page_bytes
        daemon = stack.enter_context(start_daemon(str(region + (256 << 20))))
        engine = Engine(daemon.socket, page_size=page_size, layers=layers, kv_lora_rank=512, rope_dim=64,
                        kv_size=2 * n * page_size + page_size, mode="cache",
                        extra={"capacity": region, "timeout_s": 30.0})
        stack.callback(engine.close)
        pages = Pages(engine, n)
        file_dir = tempfile.mkdtemp(prefix="hicache-file-", dir=shm_base())
        stack.callback(shutil.rmtree, file_dir, True)
        file_config = replace(engine.backend.storage_config, extra_config={"file_storage_path": file_dir})
        backends = {"hisparse": (engine.backend, v1_round),
                    "file (tmpfs)": (HiCacheFile(file_config), file_round)}
        try:
            backends["mooncake (tcp)"] = (mooncake_backend(stack, engine, log_dir, 2 * region), v1_round)
        except Exception as exc:  # noqa: BLE001 - the figure names what is missing
            print(f"mooncake backend unavailable here: {exc!r}")
        print(f"(2) {n} pages of {page_bytes / 2**20:.2f} MiB ({layers} layers x {page_size} tokens x "
              f"{row_dim} bf16), {reps} reps, median; every load checked byte-exact")
        results = {}
        for name, (backend, round_fn) in backends.items():
            stores, loads = [], []
            for rep in range(reps):
                s, l = round_fn(backend, pages, keys_for(f"{name}/{rep}", n))
                pages.check()
                stores.append(s)
                loads.append(l)
            gb = n * page_bytes / 1e9
            results[name] = (gb / statistics.median(stores), gb / statistics.median(loads))
            print(f"{name:>16}: store {results[name][0]:6.2f} GB/s, load {results[name][1]:6.2f} GB/s")
        hs = results["hisparse"]
        for name, (s, l) in results.items():
            if name != "hisparse":
                print(f"ratio hisparse / {name}: store {hs[0] / s:.2f}x, load {hs[1] / l:.2f}x")
        print(json.dumps({k: {"store_GBps": round(v[0], 3), "load_GBps": round(v[1], 3)}
                          for k, v in results.items()}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=32)
    p.add_argument("--restart-interval", type=float, default=0.0, metavar="S")
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--skip-io", action="store_true", help="only the simulation (no SGLang needed)")
    a = p.parse_args(argv)
    simulate(a.users, a.restart_interval)
    if not a.skip_io:
        measure_io(a.pages, a.layers, a.reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
