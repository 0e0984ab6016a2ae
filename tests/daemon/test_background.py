"""The daemon's background threads run at a lower priority than its loop (Linux: per thread)."""

from __future__ import annotations

import os
import threading

from hisparse.daemon.store import background


def test_a_background_thread_runs_at_its_nice_and_leaves_the_others_alone():
    seen: dict[str, int] = {}

    def work() -> None:
        background.lower_priority()
        seen["background"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=work)
    t.start()
    t.join(10)
    assert seen["background"] == min(background.MAX_NICE, before + background.BACKGROUND_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
