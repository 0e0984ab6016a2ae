"""vLLM HiSparse host-pool tests: vLLM's real scheduler-side classes against a real hisparsed."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.hisparse.coordinator")
