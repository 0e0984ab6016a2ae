"""Leases: a silent session loses its reservations (never visible) and its pins."""

from __future__ import annotations

from hisparse import KVLayout
from hisparse.daemon.index import NamespaceIndex
from hisparse.daemon.namespaces import Namespace
from hisparse.daemon.sessions import QUARANTINE_S, SessionTable
from hisparse.shm.region import RegionGeometry
from hisparse.shm.table import MetaTable, TableHeader
from tests.rawclient import keys_for


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_namespace(tmp_path) -> Namespace:
    g = RegionGeometry(KVLayout(1, 1, 8), 4)
    table = MetaTable.create(str(tmp_path / "t.meta"), TableHeader("ns", g, 1, "r"))
    return Namespace("ns", g.layout, g, "r", 1, table, NamespaceIndex(table), True)


def test_expiry_aborts_reservations_and_releases_pins(tmp_path):
    clock = Clock()
    table = SessionTable(lease_ttl_s=2.0, clock=clock)
    ns = make_namespace(tmp_path)
    writer = table.open(ns, "w")
    k = keys_for("a", 3)
    ns.index.reserve(tuple(k[:1]), writer.reservations)
    ns.index.commit(k[0], writer.reservations.pop(k[0]))
    ns.index.reserve(tuple(k[1:]), writer.reservations)
    pages = ns.index.pin((k[0],))
    writer.pins[k[0]] = [pages[0], 1]
    other = table.open(ns, "o")
    clock.now += 1.5
    assert table.get(other.id) is other  # renews the other's lease only
    clock.now += 1.0
    expired = table.expire()
    assert [(s.id, a, r) for s, a, r in expired] == [(writer.id, 2, 1)]
    assert table.get(writer.id) is None and table.get(other.id) is other
    assert ns.index.lookup(tuple(k)) == 1 and ns.index.num_pinned_pages == 0
    assert ns.index.num_writing == 0
    # the expired writer's two pages wait a moment before reuse
    assert len(ns.index.free) == 1 and len(ns.index.quarantine) == 2
    assert ns.index.end_quarantine(clock.now + QUARANTINE_S - 0.01) == 0
    assert ns.index.end_quarantine(clock.now + QUARANTINE_S) == 2 and len(ns.index.free) == 3


def test_an_explicit_close_frees_at_once(tmp_path):
    table = SessionTable(lease_ttl_s=2.0, clock=Clock())
    ns = make_namespace(tmp_path)
    s = table.open(ns, "w")
    ns.index.reserve(tuple(keys_for("b", 2)), s.reservations)
    table.close(s)
    assert len(ns.index.free) == 4 and not ns.index.quarantine


def test_session_ids_are_random_and_distinct(tmp_path):
    table = SessionTable(10.0)
    ids = {table.open(None, "").id for _ in range(100)}
    assert len(ids) == 100 and all(0 < i < (1 << 62) for i in ids)
