"""What a value fetched from the cluster is: a page to commit, missing, failed, or refused.

Called by the cluster worker's promotion path (``cluster_promote``) on the
values a get brought. A value is committed only when its header and content
hash match the key it was asked for; anything else is refused (counted,
logged, removed from the cluster). A failed get fails its keys: the tier is
marked down only when the master does not answer for them either.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hisparse.cluster import format as fmt
from hisparse.daemon.cluster.health import ClusterDown, master_answers
from hisparse.daemon.cluster.state import Space, TierState

log = logging.getLogger(__name__)

OBJECT_NOT_FOUND = -704  # Mooncake's ErrorCode::OBJECT_NOT_FOUND
# The header's bytes before the digest that ``fmt.verify`` checks: magic, version, size and
# fingerprint (not the flags, at 6:8); then the digest.
FIXED_COLUMNS = np.r_[0:6, 8:32]
DIGEST = slice(32, 48)


def checked(tier: TierState, space: Space, mine: list[tuple[bytes, int]], verdicts: list[str],
            heads: np.ndarray, parts_of: Callable[[int], list[Any]], body: dict[str, Any]) -> list[int]:
    """The rows of ``mine`` whose value is that page (a "size" verdict, a header and a content
    hash that match, as ``fmt.verify`` checks); the others are refused. ``heads``: one header a row.
    The headers are compared at once; per page, only its hash is computed."""
    started = time.perf_counter()
    page_bytes = space.ns.layout.page_bytes
    expected = np.frombuffer(fmt.pack_header(space.fp, page_bytes, bytes(16)), dtype=np.uint8)
    fixed = (heads[:, FIXED_COLUMNS] == expected[FIXED_COLUMNS]).all(axis=1).tolist()
    good = []
    for i, verdict in enumerate(verdicts):
        if verdict != "size":
            continue
        key = mine[i][0]
        digest = fmt.content_hash(key, parts_of(i))
        if fixed[i] and heads[i, DIGEST].tobytes() == digest:
            good.append(i)
        else:
            refuse(tier, space, key, fmt.verify(heads[i].tobytes(), space.fp, page_bytes, digest)
                   or "header differs", body)
    tier.counters["hash_s"] += time.perf_counter() - started
    return good


def verdicts(tier: TierState, space: Space, mine: list[tuple[bytes, int]],
              got: list[int]) -> list[str]:
    """Per key: "size" (a whole value: check it), "missing", "failed", or "refused" (wrong size)."""
    expected = fmt.HEADER_BYTES + space.ns.layout.page_bytes
    out = []
    for (key, _page), size in zip(mine, got):
        if size == expected:
            out.append("size")
        elif size == OBJECT_NOT_FOUND:
            out.append("missing")
        else:
            if size < 0:
                # Mooncake refuses a value that does not fill the buffers exactly: ask its size
                # to tell a foreign value (refused) from a failed transfer (tried again later).
                size = backend(tier).size(fmt.cluster_key(space.fp, key))
                if size < 0 or size == expected:
                    out.append("failed")
                    continue
            out.append("refused")
            refuse(tier, space, key, f"value of {size} bytes, expected {expected}", None)
    return out


def refuse(tier: TierState, space: Space, key: bytes, why: str, body: dict[str, int] | None) -> None:
    """A value that is not this page: counted, logged, dropped from the cluster, never committed."""
    if body is not None:
        body["refused"] += 1
    tier.counters["refused_pages"] += 1
    log.warning("refused a cluster value for %r key %s...: %s", space.ns.name, key[:4].hex(), why)
    backend(tier).remove([fmt.cluster_key(space.fp, key)])


def count_failed(tier: TierState, space: Space, mine: list[tuple[bytes, int]], got: list[int],
                  verdicts: list[str], body: dict[str, int]) -> None:
    body["refused"] += verdicts.count("refused")
    body["missing"] += verdicts.count("missing")
    body["missing_keys"].extend(k for (k, _p), v in zip(mine, verdicts) if v == "missing")
    failed = verdicts.count("failed")
    if failed:
        log.warning("cluster get of %d pages of %r failed (Mooncake code %d)", failed, space.ns.name,
                    next(g for g, v in zip(got, verdicts) if v == "failed"))
    if failed == len(mine) and master_answers(
            tier._backend, [fmt.cluster_key(space.fp, k) for k, _ in mine]) is None:
        raise ClusterDown(f"get of {len(mine)} pages failed, and the master does not answer")
    # else those keys' failure (a get that met an overwrite): the tier serves on


def count_promoted(tier: TierState, body: dict[str, int], pages: int, page_bytes: int) -> None:
    body["promoted"] += pages
    tier.counters["promoted_pages"] += pages
    tier.counters["promoted_bytes"] += pages * page_bytes


def backend(tier: TierState) -> Any:
    if tier._backend is None:
        raise ClusterDown("not connected")
    return tier._backend
