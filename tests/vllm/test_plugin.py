"""hisparse's vLLM plugin never stops or changes an engine that does not use hisparse (issue 41).

vLLM calls ``plugin.register`` in every engine process once hisparse is
installed. On vLLM 0.32 it raised ``AttributeError`` (no
``runtime.get_hisparse_host_pool``) out of ``load_general_plugins``, and every
``LLM()`` failed. tests/vllm_cpu runs the real 0.32 engine; here vLLM 0.34's
own loader and runtime, with the runtime as another release has it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

import hisparse.vllm.versions as versions
from hisparse.vllm import plugin, worker_pool


@pytest.fixture(autouse=True)
def no_hook() -> Iterator[None]:
    worker_pool.uninstall_hook()
    yield
    worker_pool.uninstall_hook()


def test_on_a_vllm_the_host_pool_path_was_not_tested_with_nothing_is_hooked(monkeypatch) -> None:
    from vllm.v1.hisparse import runtime

    original = runtime.get_hisparse_host_pool
    monkeypatch.setattr(versions, "installed_vllm_version", lambda: "0.32.0")
    plugin.register()
    assert not worker_pool.hook_installed()
    assert runtime.get_hisparse_host_pool is original  # vLLM's own, untouched


def test_a_runtime_without_the_host_pool_lookup_does_not_stop_the_engine(monkeypatch, caplog) -> None:
    from vllm.v1.hisparse import runtime

    # 0.32's runtime has no get_hisparse_host_pool; here on a version the check lets through
    monkeypatch.delattr(runtime, "get_hisparse_host_pool")
    with caplog.at_level(logging.WARNING, logger="hisparse.vllm.plugin"):
        plugin.register()  # raised AttributeError out of vLLM's load_general_plugins before
    assert not worker_pool.hook_installed()
    assert "engines without hisparse's HiSparseConnector are unaffected" in caplog.text
