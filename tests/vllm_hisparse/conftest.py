"""vLLM HiSparse host-pool tests: vLLM's real scheduler-side classes against a real hisparsed."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.hisparse.coordinator")

from tests.vllm_hisparse.engine import SchedulerSide  # noqa: E402


@pytest.fixture
def sides(hisparsed):
    """``sides(**kw)``: scheduler sides (our host pool in vLLM's coordinator) on one daemon."""
    made: list[SchedulerSide] = []

    def make(**kw) -> SchedulerSide:
        side = SchedulerSide(hisparsed.socket, **kw)
        made.append(side)
        return side

    yield make
    for side in made:
        side.close()

