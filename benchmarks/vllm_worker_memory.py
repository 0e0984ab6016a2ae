"""Host memory of one vLLM HiSparse worker at start: the node pool against a leaked private pool.

vLLM 0.34's real worker start-up (``tests/vllm_hisparse/worker_side.py``:
``Worker.initialize_from_config``, ``profile_cudagraph_memory``,
``extend_kv_cache``, ``init_hisparse_kv_cache``), CUDA replaced at its
boundary (``tests/vllm_hisparse/cpu_device.py``; host registration faults
every page in, as ``cudaHostRegister`` pins it), with CUDA graphs on. Each
mode starts in its own process; printed: the resident memory the start
added at its peak (VmHWM, reset by ``clear_refs`` first) and kept after it
(VmRSS), less the device KV cache (host memory on this CPU stand-in, GPU
memory on a GPU), and each plus the region (allocated by hisparsed, shared
by every engine) over the region.

Modes: ``plugin`` (hisparse installed: its vLLM plugin makes the region the
pool at vLLM's first request), ``plugin-extensible`` (the same with the
extensible KV cache, CUDA's default), ``no-plugin`` (the connector releases
the pool vLLM profiled with), ``baseline`` (the behaviour before: the
profiled pool replaced but never released). Run from the repository root:
``python benchmarks/vllm_worker_memory.py [--host-pool-gib G]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MODES = ("plugin", "plugin-extensible", "no-plugin", "baseline")


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def start_one(mode: str, socket: str, model_dir: str, host_pool_gib: float) -> dict[str, int]:
    """In this process: start one worker in ``mode``; the peak bytes the start added and the region's."""
    import pytest

    from hisparse.vllm import worker_pool
    from tests.vllm_hisparse import cpu_device, worker_side
    from tests.vllm_hisparse.real_engine import make_configs

    kept: list = []
    with pytest.MonkeyPatch.context() as mp:
        cpu_device.install(mp)
        if mode.startswith("plugin"):
            worker_pool.install_hook()
        if mode == "baseline":
            mp.setattr(worker_pool, "release_private_pool", lambda pool: kept.append(pool) or 0)
        vllm_config, kv_config = make_configs(socket, model_dir, host_pool_gib=host_pool_gib,
                                              extensible=mode == "plugin-extensible")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident set starts again from now
        before = status_kib("VmRSS")
        started = worker_side.start(vllm_config, kv_config, cudagraphs=True)
        peak, after = status_kib("VmHWM"), status_kib("VmRSS")
        region = started.connector.worker_pool.client.session.region.geometry.size_bytes
        # the device KV cache lives in host memory here (GPU memory on a GPU): not counted
        # (one backing allocation, which every device tensor of the config describes)
        device = max(t.size for t in started.runner.kv_cache_config.kv_cache_tensors if not t.host_resident)
        started.agent.shutdown()
    return {"peak_bytes": (peak - before) * 1024 - device, "kept_bytes": (after - before) * 1024 - device,
            "region_bytes": region}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host-pool-gib", type=float, default=0.25)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--socket", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.mode:
        logging.disable(logging.WARNING)
        print(json.dumps(start_one(a.mode, a.socket, a.model_dir, a.host_pool_gib)))
        return 0

    from benchmarks._common import running_daemon
    from tests.vllm_hisparse.real_engine import write_model_dir

    results = {}
    with tempfile.TemporaryDirectory() as tmp, running_daemon("2GiB") as socket:
        model_dir = write_model_dir(os.path.join(tmp, "tiny-deepseek-v32"))
        for mode in MODES:
            out = subprocess.run([sys.executable, __file__, "--mode", mode, "--socket", socket, "--model-dir",
                                  model_dir, "--host-pool-gib", str(a.host_pool_gib)], cwd=REPO, check=True,
                                 capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO})
            results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"host_pool_gib {a.host_pool_gib}: host memory at a worker's start (CUDA graphs on)")
    print(f"{'mode':>18} {'region MiB':>11} {'peak added':>11} {'kept added':>11} {'peak/region':>12}"
          f" {'kept/region':>12}")
    for mode, r in results.items():
        region = r["region_bytes"]
        r["peak"] = (region + r["peak_bytes"]) / region
        r["kept"] = (region + r["kept_bytes"]) / region
        print(f"{mode:>18} {region / 2**20:>11.1f} {r['peak_bytes'] / 2**20:>11.1f} {r['kept_bytes'] / 2**20:>11.1f}"
              f" {r['peak']:>12.3f} {r['kept']:>12.3f}")
    print(f"ratio baseline/plugin, host memory kept after start: "
          f"{results['baseline']['kept'] / results['plugin']['kept']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
