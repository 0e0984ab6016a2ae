"""vllm_cpu_turns: turns per minute of multi-turn chats across two `vllm serve` engines, with and without hisparse.

Two OpenAI-compatible servers of vLLM's CPU build (vllm-cpu 0.32,
``scripts/bootstrap``'s overlay) on the tiny model, and a router that ignores
locality: turn ``t`` of conversation ``k`` goes to server ``(k + t) % 2``, so
each turn lands on the server that did not run the conversation's last one.
``--conversations`` chats of ``--turns`` turns (a long system prompt, then a
user line and a 16-token answer per turn) run one turn at a time through the
OpenAI client, on two servers without a tier and on two servers sharing one
hisparsed, all four up at once, the pairs taking turns in alternation (load
that drifts during the run weighs on both alike). Prints turns per minute of
each (turns over the time spent in them) and their ratio, and the share of
prompt tokens the engines found cached (their own prefix cache, plus
hisparsed's pages with the tier).

    python benchmarks/vllm_cpu_turns.py [--conversations N] [--turns N] [--system-lines N]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import running_daemon  # noqa: E402


class Workload:
    """``conversations`` chats on one pair of servers, routed without locality; timed per turn."""

    def __init__(self, servers: list[Any], conversations: int, system_lines: int, seed: int) -> None:
        from hisparse.vllm.cpu.model import sample_texts

        self.servers = servers
        self.chats = [[{"role": "system", "content": " ".join(sample_texts(system_lines, seed=seed + k))}]
                      for k in range(conversations)]
        self.turns = self.prompt = self.cached = 0
        self.elapsed_s = 0.0

    def turn(self, t: int, k: int) -> None:
        from hisparse.vllm.cpu.model import sample_texts

        messages = self.chats[k]
        messages.append({"role": "user", "content": f"turn {t}: " + sample_texts(1, seed=t * 97 + k)[0]})
        started = time.perf_counter()
        answer, prompt, cached = self.servers[(k + t) % 2].turn(messages)
        self.elapsed_s += time.perf_counter() - started
        messages.append({"role": "assistant", "content": answer})
        self.turns, self.prompt, self.cached = self.turns + 1, self.prompt + prompt, self.cached + cached

    def per_min(self) -> float:
        return self.turns * 60 / self.elapsed_s

    def report(self, name: str) -> str:
        return (f"{name:14} {self.per_min():7.1f} turns/min  ({self.elapsed_s:.1f} s in its turns; "
                f"{100 * self.cached / self.prompt:.0f}% of prompt tokens cached)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-lines", type=int, default=40, help="system prompt, in 40-word lines (default 40)")
    args = p.parse_args()
    from hisparse.vllm.cpu import overlay
    from hisparse.vllm.cpu.demo import model_dir
    from hisparse.vllm.cpu.serve import Server

    if not overlay.available():
        print(overlay.why_unavailable(), file=sys.stderr)
        return 2
    model = model_dir()
    with running_daemon("1GiB") as socket, tempfile.TemporaryDirectory() as work, ExitStack() as stack:
        pairs: dict[str, list[Any]] = {}
        for name, sock in (("bare", None), ("tier", socket)):  # all four start at once
            pairs[name] = [Server(model, sock, os.path.join(work, f"{name}-{i}.log")) for i in range(2)]
            for server in pairs[name]:
                stack.callback(server.close)
        for servers in pairs.values():
            for server in servers:
                server.wait_ready()
        for servers in pairs.values():  # each engine's first request (warm-up), untimed
            warm = Workload(servers, 2, args.system_lines, seed=500)
            warm.turn(0, 0)
            warm.turn(0, 1)
        loads = {name: Workload(servers, args.conversations, args.system_lines, seed=1000)
                 for name, servers in pairs.items()}
        for t in range(args.turns):
            for k in range(args.conversations):
                for workload in loads.values():
                    workload.turn(t, k)
    bare, tier = loads["bare"], loads["tier"]
    print(f"{args.conversations} conversations x {args.turns} turns, each turn on the vllm serve that did "
          f"not run the last (vLLM CPU, tiny Llama); the two pairs alternate turn by turn")
    print(bare.report("without tier"))
    print(tier.report("with hisparse"))
    print(f"turns/min with/without: {tier.per_min() / bare.per_min():.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
