"""cluster_hit_rate: prefix hit rate of 1-4 nodes whose router ignores locality, with and without the cluster tier.

A simulation of block keys only (no bytes, no daemon): multi-turn chat
sessions sharing a system prompt, each turn's prompt the previous turn's
plus new blocks; a router that sends every turn to a node drawn at random;
each node's hisparsed an LRU of ``--node-blocks`` blocks. Without the
cluster, a turn that lands on another node than its previous one finds only
what that node happens to hold. With it, every committed block is also in
the cluster (write-behind; an LRU of ``--cluster-blocks`` per node, the
memory the nodes lend), and a node's miss the cluster holds is promoted
(counted as a remote hit). The hit rate is prompt blocks not recomputed
over prompt blocks.

    python benchmarks/cluster_hit_rate.py [--users 64] [--turns 8]
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import OrderedDict
from dataclasses import dataclass


class LRU:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self.blocks: OrderedDict[tuple[int, int], None] = OrderedDict()

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self.blocks

    def touch(self, key: tuple[int, int]) -> None:
        self.blocks[key] = None
        self.blocks.move_to_end(key)
        while len(self.blocks) > self.capacity_blocks:
            self.blocks.popitem(last=False)


@dataclass(frozen=True)
class Workload:
    users: int
    turns: int
    system_blocks: int
    turn_blocks: int


@dataclass
class Rates:
    local: float
    remote: float

    @property
    def total(self) -> float:
        return self.local + self.remote


def prompt_keys(user: int, turn: int, w: Workload) -> list[tuple[int, int]]:
    # block i of a user's chain; the system prompt is user -1's, shared by all
    system = [(-1, i) for i in range(w.system_blocks)]
    return system + [(user, i) for i in range((turn + 1) * w.turn_blocks)]


def simulate(nodes: int, cluster: bool, w: Workload, node_blocks: int, cluster_blocks: int,
             seed: int) -> Rates:
    rng = random.Random(seed)
    caches = [LRU(node_blocks) for _ in range(nodes)]
    shared = LRU(cluster_blocks * nodes)
    order = [(u, t) for t in range(w.turns) for u in range(w.users)]
    local = remote = total = 0
    for user, turn in order:
        node = caches[rng.randrange(nodes)]
        keys = prompt_keys(user, turn, w)
        total += len(keys)
        i = 0
        while i < len(keys) and keys[i] in node:
            i += 1
        local += i
        if cluster:
            j = i
            while j < len(keys) and keys[j] in shared:
                j += 1
            remote += j - i
        for key in keys:  # loaded or computed, every block of the prompt is committed
            node.touch(key)
            if cluster:
                shared.touch(key)
    return Rates(local / total, remote / total)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=64)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-blocks", type=int, default=32)
    p.add_argument("--turn-blocks", type=int, default=16)
    p.add_argument("--node-blocks", type=int, default=8192, help="each node's hisparsed, in blocks")
    p.add_argument("--cluster-blocks", type=int, default=8192, help="segment each node lends, in blocks")
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    w = Workload(a.users, a.turns, a.system_blocks, a.turn_blocks)
    print(f"{a.users} users x {a.turns} turns, random router, {a.node_blocks} blocks per node, "
          f"cluster {a.cluster_blocks} blocks per node")
    print(f"{'nodes':>5} {'no cluster':>11} {'cluster (local + remote)':>26} {'ratio':>6}")
    for nodes in (1, 2, 3, 4):
        off = simulate(nodes, False, w, a.node_blocks, a.cluster_blocks, a.seed)
        on = simulate(nodes, True, w, a.node_blocks, a.cluster_blocks, a.seed)
        print(f"{nodes:>5} {off.total:>11.1%} {on.total:>10.1%} ({on.local:.1%} + {on.remote:.1%})"
              f" {on.total / max(off.total, 1e-9):>6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
