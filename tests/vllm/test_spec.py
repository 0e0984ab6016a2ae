"""The spec as vLLM builds it: extra config, namespace, layout, hash-algorithm check."""

from __future__ import annotations

import dataclasses

import pytest
from vllm.v1.kv_offload.base import OffloadingManager, OffloadingWorker, make_offload_key
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from hisparse.errors import InvalidArgument
from hisparse.layout import KVLayout
from hisparse.vllm.config import AdapterConfig, HashAlgorithmError, check_hash_algorithm
from hisparse.vllm.namespace import derive_layout, derive_namespace
from hisparse.vllm.spec import HiSparseOffloadingSpec
from tests.vllm.conftest import Engine, offloading_config, req

SOCK = "/nonexistent/hisparsed.sock"


def test_factory_builds_the_spec_from_extra_config(engines):
    config = offloading_config(engines.daemon.socket, capacity_pages=16,
                               extra={"timeout_s": 3, "namespace": "my/ns", "hash_algo": "sha256_cbor"})
    assert OffloadingSpecFactory.get_spec_cls(config.extra_config) is HiSparseOffloadingSpec
    spec = OffloadingSpecFactory.create_spec(config)
    assert isinstance(spec, HiSparseOffloadingSpec)
    assert spec.adapter_config == AdapterConfig(socket=engines.daemon.socket, namespace="my/ns",
                                                capacity_bytes=16 * 128, timeout_s=3.0, deadline_s=2.0,
                                                hash_algo="sha256_cbor", mirror_refresh_s=0.0)
    assert spec.namespace == "my/ns"
    engine = Engine(spec)
    try:
        assert isinstance(engine.spec.get_manager(), OffloadingManager)
        assert engine.manager.num_pages == 16  # this engine created the namespace, at its capacity
        assert isinstance(engine.worker(engine.kv_caches()), OffloadingWorker)
    finally:
        engine.close()


@pytest.mark.parametrize("extra, message", [
    ({"capacity": "lots"}, "cannot parse size"),
    ({"capacity": 0}, "capacity must be positive"),
    ({"timeout_s": -1}, "timeout_s must be positive"),
    ({"timeout_s": "1"}, "timeout_s must be a number"),
    ({"socket": 5}, "socket must be a non-empty string"),
    ({"hash_algo": "md5"}, "hash_algo must be one of"),
])
def test_bad_extra_config_is_refused_at_construction(extra, message):
    with pytest.raises(InvalidArgument, match=message):
        HiSparseOffloadingSpec(offloading_config(SOCK, extra=extra))


def test_xxhash_without_pythonhashseed_is_an_error_with_the_fix(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(HashAlgorithmError, match="PYTHONHASHSEED"):
        HiSparseOffloadingSpec(offloading_config(SOCK, extra={"hash_algo": "xxhash"}))
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    HiSparseOffloadingSpec(offloading_config(SOCK, extra={"hash_algo": "xxhash"}))


def test_engine_hash_algorithm_must_match_the_config():
    with pytest.raises(HashAlgorithmError, match='"hash_algo": "xxhash_cbor"'):
        check_hash_algorithm(AdapterConfig(), environ={"PYTHONHASHSEED": "1"}, engine_algo="xxhash_cbor")
    check_hash_algorithm(AdapterConfig(hash_algo="xxhash_cbor"), environ={"PYTHONHASHSEED": "1"},
                         engine_algo="xxhash_cbor")


def test_keys_of_another_hash_than_configured_are_refused(engines):
    manager = engines().manager
    xxhash_key = make_offload_key(b"\x01" * 16, 0)  # 16-byte digest: the xxhash family
    with pytest.raises(HashAlgorithmError, match="xxhash or xxhash_cbor"):
        manager.lookup(xxhash_key, req())


def test_canonical_layout_is_refused():
    config = dataclasses.replace(offloading_config(SOCK), canonical_layout=True)
    with pytest.raises(InvalidArgument, match="canonical_layout"):
        HiSparseOffloadingSpec(config)


def _ns(**kw) -> str:
    config = offloading_config(SOCK, **kw)
    return derive_namespace(config, derive_layout(config), "sha256")


def test_compatible_engines_always_share_a_namespace():
    base = _ns()
    # another engine, DP replica or rank of the same model and layout
    assert _ns(engine_id="engine-9") == base
    config = offloading_config(SOCK)
    replica = dataclasses.replace(config, parallel=dataclasses.replace(
        config.parallel, data_parallel_index=3, data_parallel_size=4),
        model=dataclasses.replace(config.model, max_model_len=1 << 20), enable_kv_cache_events=False)
    assert derive_namespace(replica, derive_layout(replica), "sha256") == base
    assert _ns(world_size=2, rank=0) == _ns(world_size=2, rank=1)


@pytest.mark.parametrize("change", [
    {"model": "org/model-b"}, {"dtype": "fp8_e4m3"}, {"world_size": 2}, {"blocks_per_chunk": 2},
    {"groups": ((3, 4),)}, {"groups": ((2, 8),)}, {"layer_block_bytes": 32},
    {"world_size": 2, "replicated": True},
])
def test_incompatible_engines_never_share(change):
    assert _ns(**change) != _ns()


def test_hash_algorithm_is_part_of_the_namespace():
    config = offloading_config(SOCK)
    layout = derive_layout(config)
    assert derive_namespace(config, layout, "sha256") != derive_namespace(config, layout, "sha256_cbor")


def test_namespace_reads_well_and_fits_the_protocol():
    ns = _ns(model="/mnt/models/" + "x" * 300 + "/GLM-5.3-FP8")
    assert ns.startswith("vllm/") and "/GLM-5.3-FP8/bfloat16/tp1pp1/" in ns
    assert len(ns) <= 256 and ns.isprintable()


def test_layout_of_mla_rows():
    # GLM-5 style: 78 MLA layers, 64-token blocks of 656-byte rows
    mla = dict(groups=((78, 64),), layer_block_bytes=64 * 656)
    assert derive_layout(offloading_config(SOCK, **mla)) == KVLayout(78, 64, 656)
    assert derive_layout(offloading_config(SOCK, blocks_per_chunk=2, **mla)) == KVLayout(78, 128, 656)
    # MLA under TP: replicated, one copy; a non-replicated TP split holds each rank's bytes
    assert derive_layout(offloading_config(SOCK, world_size=8, replicated=True, **mla)).row_bytes == 656
    assert derive_layout(offloading_config(SOCK, world_size=2, **mla)).row_bytes == 1312


def test_an_engine_without_kv_blocks_is_refused():
    with pytest.raises(InvalidArgument, match="worker_kv_bytes_per_block"):
        HiSparseOffloadingSpec(offloading_config(SOCK, worker_kv_bytes_per_block=0, capacity_pages=None))


def test_a_sync_load_budget_is_refused_with_the_reason():
    # issue 10, item 2: vLLM cannot recompute a failed sync load; the engine would stop
    with pytest.raises(InvalidArgument, match="sync_load_budget_bytes is 1048576: remove it"):
        HiSparseOffloadingSpec(offloading_config(SOCK, extra={"sync_load_budget_bytes": 1 << 20}))


def test_a_key_of_another_length_names_the_setting_at_the_first_lookup(engines):
    # where no engine config is visible (a spec built by hand) the first key is checked
    manager = engines().manager
    with pytest.raises(HashAlgorithmError, match="set hash_algo to the engine's --prefix-caching-hash-algo"):
        manager.lookup(make_offload_key(b"\x02" * 16, 0), req())
