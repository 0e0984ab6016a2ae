"""Run one harness engine in its own process: ``python -m tests.vllm.run_engine SOCKET SEED LENGTH [N]``.

Serves ``N`` requests (default 1) whose prompts are ``prompt(SEED, LENGTH)``
with a different last token each, waits until their KV is committed in
hisparsed, and prints one JSON line: tokens computed, KV mismatches, finish
reasons. A second engine in another process then shares that prefix.
"""

from __future__ import annotations

import json
import sys

from tests.vllm.harness import VllmEngine, prompt


def main(argv: list[str]) -> int:
    socket, seed, length = argv[0], int(argv[1]), int(argv[2])
    count = int(argv[3]) if len(argv) > 3 else 1
    engine = VllmEngine(socket, engine_id=f"proc-{seed}")
    base = prompt(seed, length)
    ids = []
    for i in range(count):
        req_id = f"p{seed}-{i}"
        engine.add(req_id, base[:-1] + [1 + i])
        ids.append(req_id)
    engine.run(ids)
    engine.drain()
    print(json.dumps({"computed": dict(engine.computed), "mismatches": engine.mismatches,
                      "finished": {k: v.name for k, v in engine.finished.items()}}))
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
