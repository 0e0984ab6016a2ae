"""``vllm serve`` (vLLM's CPU build) on the tiny model, and a chat client for it (OpenAI's).

``Server(model, socket)`` starts one OpenAI-compatible server on loopback,
with hisparse as its tier when ``socket`` is given; ``turn`` sends one chat
turn and returns the answer with the prompt's token count and how many of
those the engine had cached (``--enable-prompt-tokens-details``: tier hits
included). The tests and ``benchmarks/vllm_cpu_turns.py`` drive it.
"""

from __future__ import annotations

import json
import os
import signal
import socket as sockets
import subprocess
import sys
import time
from typing import Any

from hisparse.vllm.cpu import overlay
from hisparse.vllm.cpu.engines import START_TIMEOUT_S, EngineFailed
from hisparse.vllm.cpu.run import KV_CACHE_BYTES, kv_transfer_config

MODEL_NAME = "tiny"


def free_port() -> int:
    with sockets.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, model: str, socket: str | None, log_path: str, max_tokens: int = 16,
                 capacity: str = "256MiB") -> None:
        import openai

        self.port = free_port()
        self.log_path = log_path
        self.max_tokens = max_tokens
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--host", "127.0.0.1",
               "--port", str(self.port), "--enforce-eager", "--dtype", "bfloat16", "--seed", "0",
               "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--max-model-len", "4096",
               "--attention-backend", "CPU_ATTN", "--enable-prompt-tokens-details",
               "--served-model-name", MODEL_NAME]
        if socket:
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config(socket, capacity=capacity))]
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=overlay.engine_env(), stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none",
                                    timeout=300, max_retries=0)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        import openai

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineFailed(f"vllm serve exited {self.proc.returncode}:\n{self.log()[-6000:]}")
            try:
                self.client.models.list()
                return
            except openai.APIConnectionError:
                time.sleep(0.5)
        raise EngineFailed(f"vllm serve not ready in {timeout_s:.0f} s:\n{self.log()[-6000:]}")

    def turn(self, messages: list[dict[str, str]]) -> tuple[str, int, int]:
        """One chat turn: (answer, prompt tokens, cached prompt tokens)."""
        r: Any = self.client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                                     max_tokens=self.max_tokens, temperature=0.0)
        details = r.usage.prompt_tokens_details
        return r.choices[0].message.content or "", r.usage.prompt_tokens, int(details.cached_tokens or 0)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: engine core and worker too
            self.proc.wait()
