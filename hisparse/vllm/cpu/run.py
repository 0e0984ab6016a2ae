"""One vLLM engine process on the tiny model, with or without hisparsed as its tier.

``python -m hisparse.vllm.cpu.run JOB.json OUT.json`` builds an ``LLM`` on
vLLM's CPU platform (``CPU_ATTN``, ``enforce_eager``, a fixed KV size), runs
each prompt of the job once, greedily, one after another, and writes what a
test or a benchmark compares: per prompt the tokens, ``num_cached_tokens``
(tier hits included), the time to first token (a 1-token generate first:
its wall time is the prefill) and the wall time of the whole generate. The
job (``EngineJob``) is JSON so the caller needs neither vLLM nor torch.
Engines run as their own processes, because a process holds one vLLM and a
tier's value is what a *new* process finds.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

KV_CACHE_BYTES = 256 << 20


@dataclass
class EngineJob:
    model: str
    prompts: list[list[int]]
    max_tokens: int = 32
    # hisparsed's socket; None: no tier (the engine vLLM would be without hisparse)
    socket: str | None = None
    namespace: str | None = None
    capacity: str = "256MiB"
    max_model_len: int = 4096
    # measure the time to first token with a 1-token generate before each prompt's run
    ttft: bool = True
    # connector extra keys beside ours (tests)
    extra: dict[str, Any] = field(default_factory=dict)


def kv_transfer_config(socket: str, namespace: str | None = None, capacity: str | None = None,
                       **extra: Any) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of docs/vllm.md, as a dict."""
    keys: dict[str, Any] = {"spec_name": "HiSparseOffloadingSpec", "spec_module_path": "hisparse.vllm",
                            "socket": socket, **extra}
    if namespace:
        keys["namespace"] = namespace
    if capacity:
        keys["capacity"] = capacity
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": keys}


def engine_args(job: EngineJob) -> dict[str, Any]:
    args: dict[str, Any] = {"model": job.model, "enforce_eager": True, "dtype": "bfloat16",
                            "kv_cache_memory_bytes": KV_CACHE_BYTES, "max_model_len": job.max_model_len,
                            "attention_backend": "CPU_ATTN", "seed": 0}
    if job.socket:
        args["kv_transfer_config"] = kv_transfer_config(job.socket, job.namespace, job.capacity, **job.extra)
    return args


def run(job: EngineJob) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(**engine_args(job))
    start_s = time.perf_counter() - started
    greedy = SamplingParams(max_tokens=job.max_tokens, temperature=0.0)
    first = SamplingParams(max_tokens=1, temperature=0.0)
    results = []
    for ids in job.prompts:
        ttft_s = cached = None
        if job.ttft:
            t0 = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": ids}], first, use_tqdm=False)[0]
            ttft_s = time.perf_counter() - t0
            cached = out.num_cached_tokens  # what the tier gave a prompt this engine never saw
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], greedy, use_tqdm=False)[0]
        results.append({"tokens": list(out.outputs[0].token_ids), "ttft_s": ttft_s,
                        "num_cached_tokens": out.num_cached_tokens if cached is None else cached,
                        "generate_s": time.perf_counter() - t0})
    import vllm

    return {"pid": os.getpid(), "vllm": vllm.__version__, "start_s": start_s, "results": results}


def main(argv: list[str]) -> int:
    job = EngineJob(**json.loads(open(argv[1]).read()))
    out = run(job)
    with open(argv[2], "w") as f:
        json.dump(out, f)
    return 0


def write_job(path: str, job: EngineJob) -> str:
    with open(path, "w") as f:
        json.dump(asdict(job), f)
    return path


if __name__ == "__main__":
    sys.exit(main(sys.argv))
