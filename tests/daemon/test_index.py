"""The namespace index: reserve/commit/abort/pin/evict/clear, and adoption from the table."""

from __future__ import annotations

import pytest

from hisparse import KVLayout
from hisparse.daemon.store.index import NamespaceIndex
from hisparse.protocol import SLOT_BUSY, SLOT_COMMITTED
from hisparse.shm.region import RegionGeometry
from hisparse.shm.table import MetaTable, TableHeader
from tests.rawclient import keys_for


@pytest.fixture
def make_index(tmp_path):
    def make(num_pages: int = 4, name: str = "t.meta") -> NamespaceIndex:
        g = RegionGeometry(KVLayout(2, 4, 8), num_pages)
        return NamespaceIndex(MetaTable.create(str(tmp_path / name), TableHeader("ns", g, 1, "r")))
    return make


def store(index: NamespaceIndex, keys, held=None) -> list[int]:
    held = {} if held is None else held
    slots, _ = index.reserve(tuple(keys), held)
    for key, slot in zip(keys, slots):
        if slot >= 0:
            index.commit(key, held.pop(key))
    return slots


def test_lookup_counts_the_committed_prefix(make_index):
    index = make_index()
    k = keys_for("a", 4)
    held: dict[bytes, int] = {}
    slots, _ = index.reserve(tuple(k[:3]), held)
    assert slots == [0, 1, 2]
    index.commit(k[0], held.pop(k[0]))
    index.commit(k[2], held.pop(k[2]))
    # k[1] is still WRITING: invisible, and it cuts the prefix
    assert index.lookup(tuple(k)) == 1
    assert index.lookup((k[2],)) == 1


def test_reserve_skips_committed_and_reports_busy(make_index):
    index = make_index()
    k = keys_for("a", 3)
    store(index, k[:1])
    other: dict[bytes, int] = {}
    index.reserve((k[1],), other)  # another session is writing k[1]
    mine: dict[bytes, int] = {}
    slots, _ = index.reserve(tuple(k), mine)
    assert slots[0] == SLOT_COMMITTED and slots[1] == SLOT_BUSY and slots[2] >= 0
    # asking again for a key I am writing is BUSY too: one reservation, one writer
    again, _ = index.reserve((k[2],), mine)
    assert again == [SLOT_BUSY]


def test_full_region_evicts_lru_and_never_pinned_or_writing(make_index):
    index = make_index(num_pages=4)
    a = keys_for("a", 4)
    store(index, a)
    index.pin((a[0],))  # pinned: never evicted
    index.lookup((a[1],))  # a[1] most recent; LRU order now a[2], a[3], a[1]
    b = keys_for("b", 2)
    slots, evicted = index.reserve(tuple(b), {})
    assert evicted == [a[2], a[3]] and len(slots) == 2
    assert index.lookup((a[2],)) == 0 and index.lookup((a[3],)) == 0
    assert index.lookup((a[0],)) == 1 and index.lookup((a[1],)) == 1
    # one evictable page left (a[1]); two WRITING and one pinned are not
    c = keys_for("c", 3)
    slots, evicted = index.reserve(tuple(c), {})
    assert len(slots) == 1 and evicted == [a[1]], "fewer pages, not an error"


def test_unpin_makes_the_page_evictable_as_most_recent(make_index):
    index = make_index(num_pages=2)
    a = keys_for("a", 2)
    store(index, a)
    pages = index.pin((a[0],))
    slots, _ = index.reserve(tuple(keys_for("b", 1)), {})
    assert index.lookup((a[1],)) == 0  # a[0] was pinned, a[1] went
    index.unpin(pages[0])
    assert index.num_pinned_pages == 0


def test_abort_frees_and_forgets(make_index):
    index = make_index(num_pages=2)
    k = keys_for("a", 2)
    held: dict[bytes, int] = {}
    index.reserve(tuple(k), held)
    for key in k:
        index.abort(key, held.pop(key))
    assert index.lookup(tuple(k)) == 0 and len(index.free) == 2 and index.num_writing == 0


def test_clear_frees_unpinned_and_dooms_pinned(make_index):
    index = make_index(num_pages=3)
    k = keys_for("a", 3)
    store(index, k)
    pages = index.pin((k[0],))
    freed, doomed = index.clear()
    assert (freed, doomed) == (2, 1)
    assert index.lookup(tuple(k)) == 0
    assert len(index.free) == 2
    index.unpin(pages[0])
    assert len(index.free) == 3


def test_adopt_brings_back_committed_and_frees_writing(tmp_path, make_index):
    index = make_index(num_pages=5)
    k = keys_for("a", 4)
    store(index, k[:3])
    index.reserve((k[3],), {})  # a writer that will die
    index.table.close()
    index2 = NamespaceIndex(MetaTable.open(str(tmp_path / "t.meta")))
    committed, freed = index2.adopt()
    assert (committed, freed) == (3, 1)
    assert index2.lookup(tuple(k)) == 3
    assert sorted(index2.free.tolist()) == [3, 4]
    # the adopted pages are evictable and the freed one reusable
    slots, evicted = index2.reserve(tuple(keys_for("b", 3)), {})
    assert len(slots) == 3 and len(evicted) == 1


def test_events_record_commits_and_evictions_once_asked(make_index):
    index = make_index(num_pages=1)
    a, b, c = (keys_for(x, 1)[0] for x in "abc")
    store(index, [c])  # before anyone asked: not recorded, so a cursor from before must resync
    events, seq, reset = index.events.since(0, 10)
    assert reset and events == []
    store(index, [a])
    store(index, [b])  # evicts a
    events, seq2, reset = index.events.since(seq, 10)
    assert not reset
    assert [(kind, key) for kind, key, _ in events] == [(2, c), (1, a), (2, a), (1, b)]
    assert seq2 == seq + 4


def test_committed_page_scan_pages_through_keys(make_index):
    index = make_index(num_pages=4)
    k = keys_for("a", 3)
    store(index, k)
    got, cursor = index.committed_page(0, 2)
    assert len(got) == 2 and cursor == 2
    rest, cursor = index.committed_page(cursor, 10)
    assert cursor == -1 and {key for key, _ in got + rest} == set(k)


def test_unpin_many_matches_unpin_one_by_one(make_index):
    import random

    from hisparse.daemon.store.index import DOOMED

    rng = random.Random(5)
    one, many = make_index(4096, "one.meta"), make_index(4096, "many.meta")
    keys = [f"k{i}".encode() for i in range(3000)]
    for ix in (one, many):
        for start in range(0, 3000, 500):
            chunk = tuple(keys[start:start + 500])
            slots, _ = ix.reserve(chunk, {})
            for key, page in zip(chunk, slots):
                ix.commit(key, page)
    counts = {}
    for _ in range(2500):
        key = keys[rng.randrange(3000)]
        for ix in (one, many):
            (page,) = ix.pin((key,))
        counts[page] = counts.get(page, 0) + 1
    for ix in (one, many):
        ix.clear()  # pinned pages become DOOMED, freed at their last unpin
        for page in list(counts)[:100]:
            ix.unpin(page)
    rest = {p: c - (1 if i < 100 else 0) for i, (p, c) in enumerate(counts.items())}
    rest = {p: c for p, c in rest.items() if c}
    for page, count in rest.items():
        for _ in range(count):
            one.unpin(page)
    assert len(rest) >= 1024, "exercise the vectorised path"
    many.unpin_many(list(rest), list(rest.values()))
    assert bytes(one.state) == bytes(many.state) and DOOMED not in set(many.state)
    assert list(one.pins) == list(many.pins) and one.num_pinned_pages == many.num_pinned_pages == 0
    assert sorted(one.free) == sorted(many.free) and one.lru.evictable == many.lru.evictable
def test_a_cluster_read_hold_keeps_the_page_and_its_place_in_the_lru(make_index):
    index = make_index(num_pages=4)
    k = keys_for("hold", 6)
    store(index, k[:4])
    stamp = index.hold_committed(k[0], 0)  # the oldest page, held while the cluster reads it
    assert stamp is not None and index.hold_committed(k[1], 3) is None  # not k[1]'s page
    # room for one more: page 0 is held, so k[1]'s page goes instead
    slots, evicted = index.reserve((k[4],), {})
    assert evicted == [k[1]]
    index.end_hold(0, stamp)
    # released at its old stamp: still the least recently used, so it goes next
    slots, evicted = index.reserve((k[5],), {})
    assert evicted == [k[0]]


def test_lookup_of_a_consecutive_chain_is_the_walks_answer(make_index):
    index = make_index(8)
    k = keys_for("c", 6)
    assert store(index, k) == list(range(6))
    assert index._committed_run(tuple(k)) == 0
    assert index.lookup(tuple(k)) == 6
    assert index.lookup(tuple(k[2:5])) == 3
    assert index.lookup((k[0], k[0])) == 2  # a repeated key: the walk, same answer
    assert index.lookup((k[0], k[2])) == 2  # not consecutive: the walk
    assert index.lookup(tuple(k[4:]) + (b"x" * 36,)) == 2  # past the chain: the walk
    assert index._committed_run(tuple(k[4:]) + (b"x" * 36,)) == -1
    # the head was touched last: the tail goes first
    assert index.lookup(tuple(k)) == 6
    assert [index.lru.pop_victim() for _ in range(6)] == [5, 4, 3, 2, 1, 0]


def test_committed_prefix_pages_of_a_run_and_of_a_walk_agree(make_index):
    index = make_index(8)
    k = keys_for("p", 5)
    store(index, k)
    assert index.committed_prefix_pages(tuple(k)) == [0, 1, 2, 3, 4]
    assert index.committed_prefix_pages(tuple(k[1:3])) == [1, 2]
    assert index._walk_prefix(tuple(k)) == [0, 1, 2, 3, 4]
    assert index.committed_prefix_pages((k[3], k[1])) == [3, 1]
