"""Kernel tests run Triton's interpreter on CPU tensors when there is no GPU.

Triton chooses interpreter or compiler when it is first imported, so the
variable is set here, before any test module of this folder imports it.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
