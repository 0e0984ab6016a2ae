"""An SGLang engine process (``tests.sglang.engine.Engine``) driven by JSON lines on stdin.

``python -m tests.sglang.engine_main SOCKET '{"capacity": "16MiB"}'`` prints
``{"ready": true}`` once its cache stack is up, then answers one line per
command: ``{"op": "put"|"get", "tokens": [...], "seed": N, "out": PATH}``
saves the KV bytes to ``PATH`` (``torch.save``) and answers ``{"ok": true,
"tokens": n, "stats": ...}``; ``{"op": "exit"}`` closes the engine.
"""

from __future__ import annotations

import json
import sys

import torch


def main() -> None:
    from tests.sglang.engine import Engine

    engine = Engine(sys.argv[1], extra=json.loads(sys.argv[2]) if len(sys.argv) > 2 else None)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        if cmd["op"] == "put":
            rows = engine.put(cmd["tokens"], cmd["seed"])
        else:
            rows = engine.get(cmd["tokens"])
        torch.save(rows.clone(), cmd["out"])
        print(json.dumps({"ok": True, "tokens": int(rows.shape[1]),
                          "stats": engine.backend.get_stats()}), flush=True)
    engine.close()


if __name__ == "__main__":
    main()
