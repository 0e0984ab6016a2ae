"""The namespace's region changes under a running vLLM HiSparse engine: nobody loads bytes nobody wrote.

vLLM's worker maps the region once (``RegionHostPool.allocate``) and
cannot follow it; the scheduler's client re-attaches to whatever region the
daemon has now. Three ways the daemon gets a new region (a new
``region_id``) under a running engine A, each with vLLM's real scheduler
and worker (``test_worker.py``'s ``world``) and a real hisparsed:
``hisparsectl drop --force``, a ``--fresh`` restart, and a restart whose
config resizes the namespace. A keeps serving; another engine B then looks
up A's requests through vLLM's own lookup, and every page it finds must hold
the tokens' KV, byte for byte (before the fix A published the pages its
worker wrote into the old mapping under the new region: B read zeros).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v32")

from hisparse.vllm import worker_pool  # noqa: E402
from hisparse.vllm.hisparse_connector import RegionHandshake  # noqa: E402
from hisparse.vllm.region_guard import RegionChanged  # noqa: E402
from tests.vllm_hisparse.model_loop import ModelLoop, drive  # noqa: E402
from tests.vllm_hisparse.test_worker import PROMPT, world  # noqa: E402,F401  (the fixture)
from tests.waiting import wait_for  # noqa: E402

SECOND = list(range(3000, 3000 + 400))  # 6 full blocks, none of PROMPT's
PAGE_BYTES = 2 * 64 * 96  # the tiny model's host page: 2 layers x 64 rows x 96 B
RESIZED_PAGES = 400


def drop_force(daemon, namespace: str, tmp_path) -> dict:
    r = subprocess.run([sys.executable, "-m", "hisparse.ctl", "--socket", daemon.socket, "drop", namespace,
                        "--force"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "sessions ended" in r.stdout, r.stderr
    return {}


def fresh_restart(daemon, namespace: str, tmp_path) -> dict:
    daemon.restart("--fresh")
    return {}


def resize(daemon, namespace: str, tmp_path) -> dict:
    cfg = tmp_path / "resized.toml"
    cfg.write_text(f'[namespaces."{namespace}"]\ncapacity = {RESIZED_PAGES * PAGE_BYTES}\n')
    daemon.restart("--config", str(cfg))
    assert "resized by the config" in daemon.log()
    # an engine sized for the new region (vLLM computes host_pool_gib * 2**30 // page bytes blocks)
    return {"host_pool_gib": (RESIZED_PAGES * PAGE_BYTES + 100) / 2**30}


CHANGES = {"drop --force": drop_force, "--fresh restart": fresh_restart, "resize": resize}


def record_new_blocks(pool) -> list[int]:
    """The host block ids ``pool.get_new_blocks`` hands vLLM from now on, in order (one request:
    its blocks in token order)."""
    handed_out: list[int] = []
    original = pool.get_new_blocks

    def get_new_blocks(num_blocks: int):
        blocks = original(num_blocks)
        handed_out.extend(b.block_id for b in blocks)
        return blocks

    pool.get_new_blocks = get_new_blocks
    return handed_out


def worker_bytes_ok(started, tokens: list[int], pages: list[int]) -> bool:
    """Whether the worker's own mapping (vLLM's host tensor) holds ``tokens``' KV at ``pages``."""
    from tests.vllm_hisparse.engine import token_bytes

    pool = started.connector.worker_pool
    lay = pool.geometry.layout
    view = pool.backing.view(torch.uint8).numpy().reshape(lay.num_layers, pool.geometry.num_blocks, -1)
    for index, page in enumerate(pages):
        for layer in range(lay.num_layers):
            want = token_bytes(tokens[index * 64:(index + 1) * 64], lay.row_bytes, layer).reshape(-1)
            if not (view[layer, page, :want.size] == want).all():
                return False
    return True


@pytest.fixture
def one_stage(monkeypatch):
    """vLLM's pipeline group, of one stage: ``Worker.get_kv_connector_handshake_metadata`` reads it."""
    from vllm.distributed import parallel_state

    from tests.vllm_hisparse.cpu_device import TpGroup

    monkeypatch.setattr(parallel_state, "_PP", TpGroup(0, 1, {}))


def handshake(engine, worker_dicts: list) -> None:
    """``EngineCore._set_kv_connector_handshake_metadata``: the workers' dicts merged, to the scheduler."""
    content: dict = {}
    for worker_dict in worker_dicts:
        if worker_dict is not None:
            content.update(worker_dict)
    engine.scheduler.get_kv_connector().set_xfer_handshake_metadata_pp_aware(content)


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_region_changed_under_a_running_engine_never_serves_another_engine_bytes_not_written(
        world, hisparsed, tmp_path, one_stage, caplog, change):
    worker_pool.install_hook()
    a = world.engine()
    started = world.worker(extensible=True, cudagraphs=True)
    handshake(a, [started.worker.get_kv_connector_handshake_metadata()])  # one region: accepted
    loop = ModelLoop(started, lambda r: a.scheduler.requests[r].all_token_ids, world.log)
    first = a.add("a1", PROMPT, max_tokens=8)
    drive(a, loop)
    old_region = started.connector.worker_pool.client.session.region_key
    held_before = set(a.pool._reserved)  # A's reservations in the region its worker maps
    b_settings = CHANGES[change](hisparsed, a.connector.namespace, tmp_path)
    # A keeps serving: a new request, after the change, is computed and finishes
    handed_out = record_new_blocks(a.pool)
    second = a.add("a2", SECOND, max_tokens=8)
    drive(a, loop)
    assert second.is_finished()
    # B, on the namespace's region now: whatever it finds holds the bytes written there
    b = world.engine(**b_settings)
    assert b.pool._ops.client.session.region_key != old_region
    for request in (first, second):
        tokens = list(request.all_token_ids)
        pages = b.host_lookup(tokens)
        assert b.bytes_ok(tokens, pages), (change, request.request_id, pages)
        assert pages == []  # A left the tier: nothing of its went to the new region
    # A says so, once; its worker still maps the region it started with
    assert a.pool.counters["region_changes"] == 1 and "restart this engine" in a.pool.tier_left
    assert [r.levelname for r in caplog.records if "leaves the tier" in r.getMessage()] == ["WARNING"]
    assert started.connector.worker_pool.region_key == old_region
    # ...and served a2 on pages it had reserved there, which hold a2's KV in its worker's mapping
    assert len(handed_out) >= len(SECOND) // 64 and set(handed_out) <= held_before
    assert worker_bytes_ok(started, SECOND, handed_out[:len(SECOND) // 64])
    # A gave back what its client held on the new region
    wait_for(lambda: a.pool._ops.client._sessions.closed, "A's scheduler client to close")
    # and the tier still works for engines on the new region: B serves a2's prompt, C finds it
    b.add("b1", SECOND, max_tokens=2)
    b.run()
    c = world.engine(**b_settings)
    pages = c.host_lookup(SECOND)
    assert len(pages) == 6 and c.bytes_ok(SECOND, pages)


def test_a_worker_on_another_region_than_its_scheduler_is_refused_at_start(world, hisparsed, tmp_path,
                                                                           one_stage):
    worker_pool.install_hook()
    started = world.worker(extensible=True, cudagraphs=True)
    # vLLM's Worker.get_kv_connector_handshake_metadata: what the worker mapped, keyed (pp, tp)
    worker_dict = started.worker.get_kv_connector_handshake_metadata()
    assert worker_dict == {(0, 0): RegionHandshake(*started.connector.worker_pool.region_key)}
    handshake(world.engine(), [worker_dict])  # the scheduler attached to the same region: accepted
    drop_force(hisparsed, started.connector.namespace, tmp_path)  # a change before the scheduler starts
    a = world.engine()
    with pytest.raises(RegionChanged, match="start the engine again"):
        handshake(a, [worker_dict])


def test_an_engine_whose_region_changed_never_loads_the_new_regions_pages(world, hisparsed, tmp_path):
    # A's worker maps the old region; B, started after the drop, publishes a prompt in the new
    # one. A then gets that prompt: a hit would have A's worker read the old mapping at page ids
    # of the new region. A computes it instead, into pages it reserved before.
    worker_pool.install_hook()
    a = world.engine()
    started = world.worker(extensible=True, cudagraphs=True)
    loop = ModelLoop(started, lambda r: a.scheduler.requests[r].all_token_ids, world.log)
    a.add("a1", PROMPT, max_tokens=2)
    drive(a, loop)
    held_before = set(a.pool._reserved)
    drop_force(hisparsed, a.connector.namespace, tmp_path)
    b = world.engine()
    b.add("b1", SECOND, max_tokens=2)
    b.run()
    assert len(b.host_lookup(SECOND)) == 6  # in the new region, for engines that map it
    prompt = SECOND + list(range(8000, 8010))
    # A's own lookup (vLLM's, pinning first): what it finds, A's worker reads in its mapping
    for _ in range(2):  # the first pass may only resync A's key mirror
        pages = a.host_lookup(prompt)
        assert worker_bytes_ok(started, prompt, pages), pages
    assert pages == []
    handed_out = record_new_blocks(a.pool)
    a.add("a3", prompt, max_tokens=2)
    drive(a, loop)
    assert loop.scheduled["a3"] == len(prompt) + 1  # every prompt token computed by A's model
    assert set(handed_out) <= held_before and worker_bytes_ok(started, prompt, handed_out[:6])
    assert a.pool.counters["region_changes"] == 1
