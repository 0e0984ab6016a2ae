"""vLLM HiSparse engines against a hisparsed with the SHIPPED DEFAULTS (quotas on, as installed).

``tests/vllm_hisparse/conftest.py`` lifts the daemon's quotas for tests of
other things; the tests here are about what an engine sees from a daemon as
it ships: quota refusals and short reserves included.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers.models.deepseek_v32")
pytest.importorskip("vllm.v1.hisparse.coordinator")

from tests.vllm_hisparse.real_engine import Engine, write_model_dir  # noqa: E402


@pytest.fixture
def model_dir(tmp_path) -> str:
    return write_model_dir(str(tmp_path / "tiny-deepseek-v32"))


@pytest.fixture
def closing():
    """``closing(engines)``: closed (their daemon sessions said bye) after the test."""
    made: list[Engine] = []

    def keep(engines: list[Engine]) -> list[Engine]:
        made.extend(engines)
        return engines

    yield keep
    for engine in made:
        engine.close()
