"""Fixtures for SGLang on the node tier: SGLang engines (``tests.sglang.engine``) on the test's daemon.

Skipped as a whole where SGLang is not installed (``pip install 'hisparse[sglang]'``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("sglang")

from tests.sglang import cpu_stubs  # noqa: E402

cpu_stubs.install_imports()  # before any test module imports SGLang's cache stack

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE_EXTRA = {"capacity": "16MiB", "timeout_s": 2.0, "down_s": 0.3}


@pytest.fixture
def sglang_engines(hisparsed: Any) -> Iterator[Any]:
    """``sglang_engines(**Engine kwargs)`` -> an SGLang engine in this process, on the test's daemon."""
    from tests.sglang.engine import Engine

    made: list[Any] = []

    def make(socket: str | None = None, **kwargs: Any) -> Any:
        kwargs["extra"] = {**ENGINE_EXTRA, **kwargs.get("extra", {})}
        engine = Engine(socket or hisparsed.socket, **kwargs)
        made.append(engine)
        return engine

    make.daemon = hisparsed  # type: ignore[attr-defined]
    yield make
    for engine in made:
        engine.close()


class EngineProcess:
    """``tests.sglang.engine_main`` in a subprocess: an SGLang engine of its own."""

    def __init__(self, socket: str, tmp_path: Any, name: str, extra: dict[str, Any]) -> None:
        self.tmp_path = tmp_path
        self.name = name
        self.log_path = str(tmp_path / f"{name}.log")
        env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.sglang.engine_main", socket, json.dumps(extra)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, cwd=ROOT, text=True)
        self.calls = 0

    def _reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            with open(self.log_path, errors="replace") as f:
                raise AssertionError(f"engine {self.name} exited ({self.proc.poll()}):\n{f.read()[-4000:]}")
        return json.loads(line)

    def ready(self) -> None:
        assert self._reply() == {"ready": True}

    def call(self, op: str, tokens: list[int], seed: int = 0) -> tuple[Any, dict[str, Any]]:
        import torch

        self.calls += 1
        out = str(self.tmp_path / f"{self.name}-{self.calls}.pt")
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, "tokens": tokens, "seed": seed, "out": out}) + "\n")
        self.proc.stdin.flush()
        reply = self._reply()
        return torch.load(out), reply

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def exit(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(30)


@pytest.fixture
def engine_processes(hisparsed: Any, tmp_path: Any) -> Iterator[Any]:
    """``engine_processes(name)`` -> an SGLang engine in a process of its own (call ``.ready()``)."""
    made: list[EngineProcess] = []

    def make(name: str, **extra: Any) -> EngineProcess:
        p = EngineProcess(hisparsed.socket, tmp_path, name, {**ENGINE_EXTRA, **extra})
        made.append(p)
        return p

    yield make
    for p in made:
        p.kill()
