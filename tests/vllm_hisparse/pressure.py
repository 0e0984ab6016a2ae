"""Engines growing past a shared host pool: vLLM's real Scheduler stepped round-robin, measured.

A ``Workload`` gives each engine requests whose KV grows by decoding (a
prompt of ``prompt_blocks`` blocks, ``max_tokens`` so that it ends at
``final_blocks``), all added at once, and ``drive`` steps every engine in
turn (``real_engine.Engine.step``: vLLM's ``schedule()``, the stand-in
worker's spills, ``update_from_output``) until every request finished or
``max_steps`` passed. It counts what the issue asks: requests finished,
preemptions (``Request.num_preemptions``), tokens computed again
(scheduled tokens beyond each request's prompt and output), exceptions
out of ``schedule()``, and every step's wall time. Used by
``test_pool_pressure.py`` and ``benchmarks/vllm_pool_pressure.py``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tests.vllm_hisparse.real_engine import BLOCK_TOKENS, Engine

PAGE_BYTES = 2 * BLOCK_TOKENS * 96  # one host page of the tiny model: 2 layers x 64 rows x 96 B


def pool_gib(pages: int) -> float:
    """``host_pool_gib`` that gives a region (or a private pool) of ``pages`` pages."""
    return (pages * PAGE_BYTES + PAGE_BYTES // 2) / 2**30


@dataclass
class Workload:
    requests_per_engine: int = 8
    prompt_blocks: int = 3
    final_blocks: int = 5
    max_model_len: int = 512

    def prompt(self, engine: int, index: int) -> list[int]:
        base = 10_000 + 1_000 * (engine * 64 + index)  # unique tokens: no prefix sharing
        return list(range(base, base + self.prompt_blocks * BLOCK_TOKENS))

    @property
    def max_tokens(self) -> int:
        return (self.final_blocks - self.prompt_blocks) * BLOCK_TOKENS


@dataclass
class Result:
    finished: int = 0
    requests: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    exceptions: list[str] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    steps: int = 0

    def row(self) -> dict[str, Any]:
        return {"finished": f"{self.finished}/{self.requests}", "preemptions": self.preemptions,
                "recomputed_tokens": self.recomputed_tokens, "exceptions": len(self.exceptions),
                "steps": self.steps, "max_step_ms": round(1000 * max(self.step_s, default=0.0), 1)}


def make_engines(socket: str, model_dir: str, count: int, *, region_pages: int, workload: Workload,
                 own_pool: bool = False, with_indexer: bool = False, namespace: str | None = None) -> list[Engine]:
    """``count`` engines: ours on one region of ``region_pages`` pages, or (``own_pool``) vLLM's
    own connector with a private pool each of ``region_pages // count`` pages (the same total).
    ``namespace``: instead of the derived one (a fresh one per run of a benchmark)."""
    pages = region_pages // count if own_pool else region_pages
    extra = {"namespace": namespace} if namespace else {}
    return [Engine(socket, model_dir, host_pool_gib=pool_gib(pages), max_model_len=workload.max_model_len,
                   own_pool=own_pool, with_indexer=with_indexer, extra=extra) for _ in range(count)]


def drive(engines: list[Engine], workload: Workload, *, max_steps: int = 4000,
          deadline_s: float = 600.0) -> Result:
    """Add the workload to every engine and step them round-robin until all finished."""
    mine: list[list[Any]] = []
    for e, engine in enumerate(engines):
        mine.append([engine.add(f"e{e}-r{i}", workload.prompt(e, i), max_tokens=workload.max_tokens)
                     for i in range(workload.requests_per_engine)])
    requests = [r for reqs in mine for r in reqs]
    result = Result(requests=len(requests))
    scheduled = dict.fromkeys((r.request_id for r in requests), 0)
    dead: set[int] = set()
    until = time.monotonic() + deadline_s
    while result.steps < max_steps and time.monotonic() < until:
        active = [(i, engine) for i, engine in enumerate(engines)
                  if i not in dead and not all(r.is_finished() for r in mine[i])]
        if not active:
            break
        for i, engine in active:
            started = time.perf_counter()
            try:
                for req_id, tokens in engine.step().items():
                    scheduled[req_id] = scheduled.get(req_id, 0) + tokens
            except Exception:  # an exception out of schedule(): the engine would die
                result.exceptions.append(traceback.format_exc(limit=6))
                dead.add(i)
                continue
            result.step_s.append(time.perf_counter() - started)
        result.steps += 1
    for request in requests:
        result.preemptions += request.num_preemptions
        if request.is_finished():
            result.finished += 1
            needed = request.num_prompt_tokens + request.num_output_tokens - 1  # the last token is not fed
            result.recomputed_tokens += max(0, scheduled[request.request_id] - needed)
    return result


def close_all(engines: list[Engine]) -> None:
    for engine in engines:
        engine.close()


@contextlib.contextmanager
def scratch_daemon(prefix: str, *args: str) -> Iterator[tuple[Any, str]]:
    """A real hisparsed (``args`` added) on a scratch socket and shm directory, outside pytest
    (the benchmarks): ``(daemon, work directory)``, killed and removed afterwards."""
    from tests.conftest import Daemon

    work = tempfile.mkdtemp(prefix=prefix)
    shm = tempfile.mkdtemp(prefix=prefix, dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.makedirs(os.path.join(work, "d"))
    daemon = Daemon(os.path.join(work, "d", "hisparsed.sock"), shm, ["--capacity", "256MiB", *args],
                    {**os.environ, "PYTHONUNBUFFERED": "1"}, os.path.join(work, "hisparsed.log"))
    daemon.start()
    try:
        yield daemon, work
    finally:
        daemon.kill()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
