"""The daemon's background threads yield the CPU to its loop.

The loop answers engines; the cluster worker (a promotion's gets and
checks) and the region allocator (zero-filling a new namespace) only make
something ready sooner. On a busy node, four threads may want two cores:
the scheduler then lets the loop run first, and the background threads
take what is left (Linux keeps a nice value per thread). On an idle core
nothing changes.
"""

from __future__ import annotations

import os
import threading

# 5 above the loop: about a quarter of a core the loop also wants. At 10 (a tenth) a busy
# node starved promotions, and a worker preempted while holding the GIL held the loop up
# longer (docs/cluster.md, benchmarks/pd_decode.py).
BACKGROUND_NICE = 5
MAX_NICE = 19


def lower_priority() -> None:
    """Run this thread ``BACKGROUND_NICE`` above the nice it was started with (a thread
    initializer; a no-op where refused)."""
    tid = threading.get_native_id()
    try:
        nice = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, nice + BACKGROUND_NICE))
    except OSError:
        pass
