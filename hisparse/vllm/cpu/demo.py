"""``hisparse demo --vllm``: two real vLLM CPU engines sharing a prefix through a private hisparsed.

Starts ``hisparsed`` on a temporary socket, builds the tiny model (4 layers,
random weights, a local tokenizer: no download), then runs engine A and,
after it exits, engine B: separate processes of vLLM's CPU build with
hisparse as their ``OffloadingConnector`` tier, each generating 32 greedy
tokens for the same 2,048-token prompt. A computes the prompt and stores
it; B finds it in the daemon. Prints B's cached tokens, both engines' time
to first token, and whether their tokens match.
"""

from __future__ import annotations

import os
import sys
import tempfile

from hisparse.layout import format_size
from hisparse.local import start_daemon
from hisparse.vllm.cpu import overlay
from hisparse.vllm.cpu.engines import EngineFailed, EngineProcess
from hisparse.vllm.cpu.model import TinyModel, sample_texts
from hisparse.vllm.cpu.run import EngineJob

PROMPT_TOKENS = 2048
MAX_TOKENS = 32


def prompt_ids(model_dir: str, tokens: int = PROMPT_TOKENS, seed: int = 1) -> list[int]:
    """``tokens`` ids of generated text (2,048: sixteen whole 128-token CPU blocks)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    ids: list[int] = []
    lines = 0
    while len(ids) < tokens:
        lines += 40
        ids = tok.encode(" ".join(sample_texts(lines, seed=seed))).ids
    return ids[:tokens]


def model_dir() -> str:
    """The tiny model, built once per user (seconds) and reused."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return str(TinyModel().build(os.path.join(cache, "hisparse", "tiny-llama")))


def main() -> int:
    if not overlay.available():
        print(f"hisparse demo --vllm: {overlay.why_unavailable()}", file=sys.stderr)
        return 2
    model = model_dir()
    ids = prompt_ids(model)
    spec = TinyModel()
    kv_bytes = spec.kv_bytes_per_token() * len(ids)
    with start_daemon("1GiB") as daemon, tempfile.TemporaryDirectory(prefix="hisparse-demo-") as work:
        print(f"hisparsed pid {daemon.pid} on {daemon.socket}")
        print(f"model: tiny Llama ({spec.num_layers} layers, hidden {spec.hidden_size}, random weights) "
              f"in {model}; prompt {len(ids)} tokens = {format_size(kv_bytes)} of KV\n")
        rows = []
        for name in ("A", "B"):
            print(f"engine {name}: starting vLLM's CPU engine (a separate process; 20-80 s) ...", flush=True)
            job = EngineJob(model=model, prompts=[ids], max_tokens=MAX_TOKENS, socket=daemon.socket)
            engine = EngineProcess(name, job, work)
            try:
                out = engine.result()
            except EngineFailed as exc:
                print(exc, file=sys.stderr)
                return 1
            rows.append(out["results"][0] | {"pid": out["pid"], "vllm": out["vllm"]})
    a, b = rows
    print(f"\nengine  pid      vLLM    cached tokens  time to first token")
    for name, r in zip("AB", rows):
        print(f"{name}       {r['pid']:<8} {r['vllm']:<7} {r['num_cached_tokens']:>5} of {len(ids):<5}  "
              f"{1000 * r['ttft_s']:.0f} ms")
    same = a["tokens"] == b["tokens"]
    print(f"\nB took {b['num_cached_tokens']} of its {len(ids)} prompt tokens from hisparsed (A computed them); "
          f"its first token came {a['ttft_s'] / b['ttft_s']:.1f}x sooner than A's; their {MAX_TOKENS} greedy "
          f"tokens {'match' if same else 'DIFFER'}.")
    return 0 if same and b["num_cached_tokens"] == len(ids) else 1
