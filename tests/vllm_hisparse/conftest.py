"""vLLM HiSparse host-pool tests: vLLM's real scheduler-side classes against a real hisparsed."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.hisparse.coordinator")

from tests.conftest import quotas_lifted  # noqa: E402
from tests.vllm_hisparse.engine import SchedulerSide  # noqa: E402


@pytest.fixture
def daemon_factory(daemon_factory):
    """Quotas lifted: these engines are one uid, and one engine's host pool may use its
    whole region (quotas: tests/daemon/test_tenants.py)."""
    return quotas_lifted(daemon_factory)


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

