"""The manager for releases whose scheduler never enters ``OffloadingManager.lock`` (0.32).

``HiSparseOffloadingManager`` shares its state with its background thread
(``syncer``) under ``lock``, which 0.33+ schedulers hold around every call.
0.32's scheduler calls it bare, so here every call the scheduler makes takes
the lock itself (0.32 never holds it, so the lock need not be reentrant).
One thing is lost: 0.34 holds the lock from a lookup that answers HIT to the
``prepare_load`` that loads it; here the background thread may run between
the two. It only drops a hold there when the daemon's session is lost
(restart, expired lease), and that load then fails: on 0.32 the engine stops
(docs/vllm.md, "vLLM 0.32").

0.32 has no ``on_reset_flushed`` either: it runs after
``RESET_FLUSH_STEPS`` further scheduler steps, by when the workers have
waited out every job that was in flight at the reset (0.32 hands them the
flush with the next step's metadata; one more step covers a step scheduled
ahead under async scheduling).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from hisparse.vllm.manager import HiSparseOffloadingManager

# Every OffloadingManager call 0.32's scheduler makes, but shutdown (which stops the thread).
LOCKED_CALLS = ("lookup", "get_load_source", "prepare_load", "touch", "complete_load", "prepare_store",
                "complete_store", "on_new_request", "on_request_finished", "on_schedule_end",
                "has_pending_work", "reset_cache", "take_events", "get_stats")
RESET_FLUSH_STEPS = 3


def _locked(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(self: HiSparseOffloadingManager, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return method(self, *args, **kwargs)
    return call


class _ResetFlush(HiSparseOffloadingManager):
    """``on_reset_flushed`` run by step count, for schedulers that never call it."""

    _steps_to_flush = 0

    def reset_cache(self) -> None:
        super().reset_cache()
        self._steps_to_flush = RESET_FLUSH_STEPS

    def on_schedule_end(self, context: Any) -> None:
        super().on_schedule_end(context)
        if self._steps_to_flush:
            self._steps_to_flush -= 1
            if not self._steps_to_flush:
                self.on_reset_flushed()

    def touch(self, keys: Any, req_context: Any) -> None:
        # 0.32's interface has touch (0.34 dropped it); recency is the daemon's: unpins rank pages.
        return


SelfLockingManager: type[HiSparseOffloadingManager] = type(
    "SelfLockingManager", (_ResetFlush,),
    {name: _locked(getattr(_ResetFlush, name)) for name in LOCKED_CALLS}
    | {"__doc__": "HiSparseOffloadingManager that takes its own lock in every scheduler call (0.32).",
       "__module__": __name__})
