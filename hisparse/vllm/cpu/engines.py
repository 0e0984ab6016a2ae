"""Engine processes on the tiny model: start one (``EngineProcess``), wait for what it measured.

Each engine is ``python -m hisparse.vllm.cpu.run JOB OUT`` in its own
session (its engine core and worker processes go with it on ``kill``), its
log in the work directory. The demo, the figures and the tests start them
this way.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from hisparse.vllm.cpu import overlay
from hisparse.vllm.cpu.run import EngineJob, write_job

START_TIMEOUT_S = 600.0  # 20-80 s on a busy 2-core box; a hang is a failure, not a wait


class EngineFailed(RuntimeError):
    """An engine process exited non-zero or timed out; the message ends with its log's tail."""


class EngineProcess:
    def __init__(self, name: str, job: EngineJob, workdir: str | os.PathLike[str],
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.workdir = Path(workdir)
        self.out_path = self.workdir / f"{name}.out"
        self.log_path = self.workdir / f"{name}.log"
        path = write_job(str(self.workdir / f"{name}.json"), job)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hisparse.vllm.cpu.run", path, str(self.out_path)],
                env=env or overlay.engine_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def result(self, timeout_s: float = START_TIMEOUT_S) -> dict[str, Any]:
        """What ``run`` wrote (``EngineFailed`` if it did not finish cleanly in time)."""
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            code = None
        if code != 0:
            raise EngineFailed(f"engine {self.name} exited {code}:\n{self.log()[-6000:]}")
        return json.loads(self.out_path.read_text())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
