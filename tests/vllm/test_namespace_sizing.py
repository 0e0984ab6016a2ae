"""An operator sizes a vLLM engine's namespace in the daemon's config before the first engine starts.

The shipped config's ``[namespaces."NAME"]`` section applies to engines that
say ``"namespace": NAME`` in ``kv_connector_extra_config``, as docs/vllm.md
tells them to.
"""

from __future__ import annotations

import os
import tomllib

from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from hisparse.ctl import Control
from hisparse.protocol import Op
from tests.vllm.conftest import Engine, offloading_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def shipped_namespace() -> str:
    with open(os.path.join(REPO, "systemd", "hisparsed.toml"), "rb") as f:
        [name] = tomllib.load(f)["namespaces"]
    return name


def test_the_docs_give_engines_the_name_the_shipped_config_sizes():
    name = shipped_namespace()
    with open(os.path.join(REPO, "docs", "vllm.md")) as f:
        assert f'"namespace":"{name}"' in f.read()
    with open(os.path.join(REPO, "systemd", "hisparsed.toml")) as f:
        assert f'"namespace":"{name}"' in f.read()


def test_an_engine_naming_the_configured_namespace_gets_its_configured_size(daemon_factory, tmp_path):
    name = shipped_namespace()
    config = tmp_path / "hisparsed.toml"
    config.write_text(f'[namespaces."{name}"]\ncapacity = "4KiB"\n')  # 32 pages of 128 B
    d = daemon_factory(extra=("--config", str(config)))
    # the engine asks for 8 pages; the daemon's section, read before it started, decides
    spec = OffloadingSpecFactory.create_spec(
        offloading_config(d.socket, capacity_pages=8, extra={"namespace": name}))
    engine = Engine(spec)
    try:
        assert spec.namespace == name
        assert engine.manager.num_pages == 32
        # what the daemon sees: the engine attached to the configured name, at its size
        ctl = Control(d.socket)
        try:
            ns = ctl.call(Op.STATS)["namespaces"]
        finally:
            ctl.close()
        assert list(ns) == [name] and ns[name]["num_pages"] == 32 and ns[name]["sessions"] >= 1
    finally:
        engine.close()
