"""KeyMirror against a real hisparsed: events, resyncs, stale evictions, a daemon restart."""

from __future__ import annotations

import numpy as np
import pytest

from hisparse.client import attach
from hisparse.layout import KVLayout
from hisparse.protocol import EVENT_COMMIT, EVENT_EVICT
from hisparse.vllm.mirror import KeyMirror
from hisparse.vllm.rpc import NamespaceOps

LAYOUT = KVLayout(num_layers=2, block_tokens=4, row_bytes=16)


def keys(*ints: int) -> list[bytes]:
    return [b"key-%d" % i for i in ints]


def pages(n: int) -> np.ndarray:
    return np.zeros((n, LAYOUT.page_bytes), dtype=np.uint8)


@pytest.fixture
def pair(hisparsed):
    """A mirror on one session and a writer on another, both on a 4-page namespace."""
    capacity = 4 * LAYOUT.page_bytes
    reader = attach("mirror-test", LAYOUT, socket=hisparsed.socket, capacity=capacity, timeout_s=2)
    writer = attach("mirror-test", LAYOUT, socket=hisparsed.socket, timeout_s=2)
    yield KeyMirror(NamespaceOps(reader), max_age_s=0), writer
    writer.close()
    reader.close()


def test_first_refresh_scans_what_is_already_committed(pair):
    mirror, writer = pair
    writer.store(keys(1, 2), pages(2))
    changes = mirror.refresh()
    assert set(mirror.pages) == set(keys(1, 2))
    assert {(c.kind, c.key) for c in changes} == {(EVENT_COMMIT, k) for k in keys(1, 2)}
    assert mirror.resyncs == 1


def test_refresh_follows_commits_and_evictions(pair):
    mirror, writer = pair
    mirror.refresh()
    writer.store(keys(1, 2, 3, 4), pages(4))
    mirror.refresh()
    assert set(mirror.pages) == set(keys(1, 2, 3, 4))
    writer.store(keys(5), pages(1))  # a full region: [1] goes
    changes = mirror.refresh()
    assert [(c.kind, c.key) for c in changes] == [(EVENT_EVICT, b"key-1"), (EVENT_COMMIT, b"key-5")]
    assert set(mirror.pages) == set(keys(2, 3, 4, 5))
    assert mirror.resyncs == 1  # all of it from the event stream


def test_a_late_eviction_of_an_older_page_keeps_the_newer_one(pair):
    mirror, writer = pair
    mirror.refresh()
    writer.store(keys(1, 2, 3, 4), pages(4))
    writer.store(keys(5), pages(1))  # evicts [1] from its page ...
    writer.store(keys(1), pages(1))  # ... and [1] comes back in another
    mirror.refresh()  # sees commit(1, p), evict(1, p), ..., commit(1, q) in one go
    with writer.pin(keys(1)) as pin:
        assert mirror.get(b"key-1") == int(pin.page_ids[0])


def test_a_cursor_the_daemon_no_longer_has_resyncs(pair):
    mirror, writer = pair
    writer.store(keys(1), pages(1))
    mirror.refresh()
    mirror.seq = mirror.seq + 1_000  # ahead of the daemon: the stream has a gap
    mirror.pages[b"ghost"] = 3
    changes = mirror.refresh()
    assert mirror.resyncs == 2
    assert b"ghost" not in mirror.pages and b"key-1" in mirror.pages
    assert any(c.kind == EVENT_EVICT and c.key == b"ghost" for c in changes)


def test_a_restarted_daemon_is_resynced(daemon_factory):
    daemon = daemon_factory(lease_ttl=2)
    capacity = 4 * LAYOUT.page_bytes
    with attach("restart", LAYOUT, socket=daemon.socket, capacity=capacity, timeout_s=5) as c:
        c.store(keys(1, 2), pages(2))
        mirror = KeyMirror(NamespaceOps(c), max_age_s=0)
        mirror.refresh()
        daemon.restart()  # SIGTERM, then the same regions are adopted
        c.store(keys(3), pages(1))  # re-attaches the client's session
        mirror.refresh()
        assert set(mirror.pages) == set(keys(1, 2, 3))
        assert mirror.resyncs == 2


def test_max_age_bounds_the_refresh_rate(pair):
    mirror, writer = pair
    now = [100.0]
    mirror = KeyMirror(mirror._source, max_age_s=0.005, clock=lambda: now[0])
    assert mirror.due()
    mirror.refresh()
    now[0] += 0.004
    assert not mirror.due()
    now[0] += 0.002
    assert mirror.due()


def test_an_update_fetched_before_a_clear_is_dropped(pair):
    # the background thread fetches unlocked; a reset_cache in between must win
    mirror, writer = pair
    writer.store(keys(1), pages(1))
    mirror.refresh()
    writer.store(keys(2), pages(1))
    update = mirror.fetch()
    mirror.clear()
    assert mirror.apply(update) == [] and mirror.pages == {}
    mirror.refresh()  # the next refresh rescans
    assert set(mirror.pages) == set(keys(1, 2))


def test_own_evictions_leave_at_once(pair):
    mirror, writer = pair
    writer.store(keys(1), pages(1))
    mirror.refresh()
    mirror.note_evicted(b"key-1")
    assert b"key-1" not in mirror
