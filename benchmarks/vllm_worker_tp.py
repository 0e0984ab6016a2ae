"""Copies per spilled page at TP 1, 2 and 8: vLLM 0.34's HiSparse worker over the node pool.

Each TP rank of one engine is vLLM's real worker side (start-up,
``HiSparseConnectorWorker``'s step loop) with CUDA replaced at its boundary
(``tests/vllm_hisparse/cpu_device.py``), the ranks simulated one after
another in this process (``tests/vllm_hisparse/tp_ranks.py``), driven by
vLLM's real scheduler against a real hisparsed. Every copy the ranks make
into the region is logged; printed per TP size: region rows written per
distinct row ("copies per spilled page"), ranks writing each page, for
hisparse (the region presented as vLLM's shared pool: TP rank 0 writes) and
the baseline (no shared pool: every rank a writer, the behaviour before),
and the ratio baseline / hisparse. Run from the repository root:
``python benchmarks/vllm_worker_tp.py``.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402  (its MonkeyPatch undoes the CPU device patches after each run)

from benchmarks._common import running_daemon  # noqa: E402

PROMPTS = [list(range(1000, 1600)), list(range(1000, 1128)) + list(range(7000, 7200))]


def measure(socket: str, model_dir: str, tp: int, one_writer: bool) -> dict[str, float]:
    from hisparse.vllm import worker_pool
    from tests.vllm_hisparse import cpu_device, tp_ranks

    with pytest.MonkeyPatch.context() as mp:
        log = cpu_device.install(mp)
        if not one_writer:
            mp.setattr(worker_pool, "check_one_writer", lambda *a: None)
        worker_pool.install_hook()
        try:
            result = tp_ranks.run(socket, model_dir, tp, log, PROMPTS, one_writer=one_writer,
                                  namespace=f"vllm-hisparse/tp{tp}-{'one' if one_writer else 'every'}-writer")
        finally:
            worker_pool.uninstall_hook()
    assert result["bytes_ok"] and result["unfenced"] == 0, result
    return result


def main() -> int:
    logging.disable(logging.WARNING)
    from tests.vllm_hisparse.real_engine import write_model_dir

    with tempfile.TemporaryDirectory() as tmp, running_daemon("256MiB") as socket:
        model_dir = write_model_dir(os.path.join(tmp, "tiny-deepseek-v32"))
        print(f"{'TP':>3} {'pool':>10} {'copies/page':>12} {'writers/page':>13} {'pages':>6}")
        for tp in (1, 2, 8):
            rows = {}
            for one_writer in (True, False):
                rows[one_writer] = r = measure(socket, model_dir, tp, one_writer)
                print(f"{tp:>3} {'hisparse' if one_writer else 'baseline':>10} {r['copies_per_row']:>12.2f}"
                      f" {r['writers_per_page']:>13.2f} {r['pages']:>6}")
            print(f"    ratio baseline/hisparse: {rows[False]['copies_per_row'] / rows[True]['copies_per_row']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
