"""A cluster tier in the test's own process: a real registry, namespace "m", the real Mooncake client.

Tests that drive the tier's worker directly (its calls on the loop, a
promotion's rounds, a late get) run it on their own event loop against a
real ``mooncake_master``; ``tier.start(loop)`` is theirs to call.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hisparse.daemon.conf import config
from hisparse.daemon.cluster.tier import ClusterTier
from hisparse.daemon.main import _cluster_tier
from hisparse.daemon.store.namespaces import Namespace, Registry
from tests.cluster.test_two_nodes import LAYOUT


@contextmanager
def registry_and_tier(master, tmp_path, pages: int, capacity: str = "64MiB",
                      **cluster: Any) -> Iterator[tuple[Registry, Namespace, ClusterTier]]:
    """A registry on ``tmp_path`` (``capacity``) with namespace "m" of ``pages`` pages of
    ``LAYOUT``, and a tier on ``master`` (``cluster``: more ``ClusterConfig`` fields);
    the tier stopped and the registry closed on exit."""
    (tmp_path / "shm").mkdir()
    (tmp_path / "run" / "meta").mkdir(parents=True)
    cfg = config.build(env={}, flags={"socket": str(tmp_path / "run" / "s.sock"),
                                      "shm_dir": str(tmp_path / "shm"), "capacity": capacity})
    registry = Registry(cfg)
    ns = registry.get_or_create("m", LAYOUT, pages * LAYOUT.page_bytes)
    tier = _cluster_tier(config.ClusterConfig(backend="mooncake", master=master.address,
                                              metadata_server=master.metadata, **cluster))
    try:
        yield registry, ns, tier
    finally:
        tier.stop()
        registry.close()
