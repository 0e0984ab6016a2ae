"""vLLM HiSparse host-pool tests: vLLM's real scheduler-side classes against a real hisparsed."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.hisparse.coordinator")

from tests.conftest import QUOTAS_OFF  # noqa: E402
from tests.vllm_hisparse.engine import SchedulerSide  # noqa: E402


@pytest.fixture
def daemon_factory(daemon_factory):
    """The shared ``daemon_factory`` with quotas lifted: these engines are one uid, and one
    engine's host pool may use its whole region (quotas: tests/daemon/test_tenants.py)."""
    def make(*, extra: tuple[str, ...] = (), **kw):
        return daemon_factory(extra=(*QUOTAS_OFF, *extra), **kw)
    return make


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

