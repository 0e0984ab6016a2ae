"""Optional dependencies: which extra brings each, and the typed error when one is absent.

The daemon, ``hisparsectl`` and a numpy-only client need none of them. An
engine needs ``hisparse[engine]`` (torch, cuda-python, triton); the vLLM
adapter ``hisparse[vllm]``; ``hisparse plan --plot`` ``hisparse[plot]``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from hisparse.errors import MissingExtra

EXTRA_FOR_MODULE: dict[str, str] = {
    "torch": "engine",
    "triton": "engine",
    "cuda": "engine",
    "vllm": "vllm",
    "sglang": "sglang",
    "matplotlib": "plot",
}


def missing(module: str, what: str) -> MissingExtra:
    """The error for ``what`` needing ``module``, naming the extra to install."""
    top = module.split(".")[0]
    extra = EXTRA_FOR_MODULE.get(top, "engine")
    return MissingExtra(f"{what} needs {top}, which is not installed: "
                        f"pip install 'hisparse[{extra}]' into this environment")


def require(module: str, what: str) -> ModuleType:
    """``import module``, or ``MissingExtra`` saying which extra brings it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if exc.name is not None and exc.name.split(".")[0] != module.split(".")[0]:
            raise  # the module is there but one of its own imports failed: not ours to rename
        raise missing(module, what) from None
