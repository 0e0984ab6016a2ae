"""Sessions and fences: an ended session's pages stay fenced until its process lets go."""

from __future__ import annotations

import fcntl
import os

import pytest

from hisparse import KVLayout
from hisparse.daemon.store.index import FENCED, NamespaceIndex
from hisparse.daemon.store.namespaces import Namespace
from hisparse.daemon.store.sessions import PinHold, SessionTable
from hisparse.errors import InvalidArgument
from hisparse.shm.fence import LIVE, LOST, FenceFile
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


def lock(fence: FenceFile) -> int:
    """A client's lock on a fence: another open file, LOCK_SH."""
    fd = os.open(fence.path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def hold_some(ns: Namespace, session, keys: list[bytes]) -> None:
    """Commit and pin keys[0]; reserve keys[1:]. Records the holds as the handlers do."""
    ns.index.reserve(tuple(keys[:1]), session.reservations)
    ns.index.commit(keys[0], session.reservations.pop(keys[0]))
    slots, _ = ns.index.reserve(tuple(keys[1:]), session.reservations)
    session.fence.add_reserved(slots)
    pages = ns.index.pin((keys[0],))
    session.fence.add_pins(pages)
    session.pins[pages[0]] = PinHold(keys[0], 1)


@pytest.fixture
def fence_dir(tmp_path):
    d = tmp_path / "fences"
    d.mkdir()
    return str(d)


def test_expiry_of_a_stalled_session_fences_its_pages_until_it_lets_go(tmp_path, fence_dir):
    clock = Clock()
    table = SessionTable(lease_ttl_s=2.0, clock=clock)
    ns = make_namespace(tmp_path)
    writer = table.open(ns, "w", b"peer-w", fence_dir)
    fd = lock(writer.fence)  # the writer's process is alive (stalled)
    k = keys_for("a", 3)
    hold_some(ns, writer, k)
    other = table.open(ns, "o", b"peer-o", fence_dir)
    clock.now += 1.5
    assert table.get(other.id, b"peer-o") is other  # renews the other's lease only
    clock.now += 1.0
    [(expired, zombie)] = table.expire()
    assert expired is writer and zombie is not None
    assert table.get(writer.id, b"peer-w") is None and table.get(other.id, b"peer-o") is other
    # holds are gone: nothing WRITING, the reservations never visible ...
    assert ns.index.lookup(tuple(k)) == 1 and ns.index.num_writing == 0
    assert writer.fence.state == LOST
    # ... but no page is reusable while the process may still touch it
    assert len(ns.index.free) == 1 and ns.index.num_fenced == 2
    assert ns.index.num_pinned_pages == 1
    assert table.reap_zombies() == []
    os.close(fd)  # the process exits, or comes back and lets go
    [(z, freed, dropped)] = table.reap_zombies()
    assert (freed, dropped) == (2, 1) and not table.zombies
    assert len(ns.index.free) == 3 and ns.index.num_fenced == 0 and ns.index.num_pinned_pages == 0
    assert not os.path.exists(writer.fence.path)


def test_a_session_that_holds_nothing_ends_at_once(tmp_path, fence_dir):
    table = SessionTable(lease_ttl_s=2.0, clock=Clock())
    ns = make_namespace(tmp_path)
    s = table.open(ns, "w", b"p", fence_dir)
    fd = lock(s.fence)
    assert table.end(s, "bye") is None and not table.zombies
    os.close(fd)


def test_a_bye_after_letting_go_frees_at_once(tmp_path, fence_dir):
    table = SessionTable(lease_ttl_s=2.0, clock=Clock())
    ns = make_namespace(tmp_path)
    s = table.open(ns, "w", b"p", fence_dir)
    fd = lock(s.fence)
    hold_some(ns, s, keys_for("b", 2))
    os.close(fd)  # the client lets go of its fence, then says bye
    assert table.end(s, "bye") is None
    assert len(ns.index.free) == 3 and ns.index.num_fenced == 0 and ns.index.num_pinned_pages == 0


def test_a_session_is_bound_to_its_connection(tmp_path, fence_dir):
    table = SessionTable(lease_ttl_s=2.0, clock=Clock())
    s = table.open(make_namespace(tmp_path), "w", b"mine", fence_dir)
    assert table.get(s.id, b"theirs") is None
    assert table.get(s.id, b"mine") is s


def test_evict_frees_a_live_session_on_the_operators_word(tmp_path, fence_dir):
    table = SessionTable(lease_ttl_s=2.0, clock=Clock())
    ns = make_namespace(tmp_path)
    s = table.open(ns, "w", b"p", fence_dir)
    fd = lock(s.fence)
    hold_some(ns, s, keys_for("c", 3))
    assert table.find(s.handle) is s
    assert table.evict(s) == (2, 1)
    assert len(ns.index.free) == 3 and not table.zombies and table.find(s.handle) is None
    os.close(fd)


def test_a_successor_refences_what_a_live_fence_names(tmp_path, fence_dir):
    """Daemon restart: the table frees WRITING pages, the fence puts them back out of reach."""
    clock = Clock()
    table = SessionTable(lease_ttl_s=2.0, clock=clock)
    ns = make_namespace(tmp_path)
    s = table.open(ns, "w", b"p", fence_dir)
    fd = lock(s.fence)
    hold_some(ns, s, keys_for("d", 3))
    ns.table.flush()
    # the successor: a fresh index from the same table, fences adopted from the directory
    successor = NamespaceIndex(ns.table)
    successor.adopt()
    ns2 = Namespace("ns", ns.layout, ns.geometry, "r", 1, ns.table, successor, False)

    class Reg:
        namespaces = {"ns": ns2}

    table2 = SessionTable(lease_ttl_s=2.0, clock=clock)
    assert table2.adopt_fences(fence_dir, Reg()) == (1, 0)  # type: ignore[arg-type]
    assert successor.num_fenced == 2 and successor.num_pinned_pages == 1
    assert len(successor.free) == 1 and all(successor.state[p] == FENCED for p in (1, 2))
    assert table2.reap_zombies() == []
    os.close(fd)
    assert len(table2.reap_zombies()) == 1
    assert len(successor.free) == 3 and successor.num_pinned_pages == 0


def test_fences_of_exited_processes_are_removed_at_adoption(tmp_path, fence_dir):
    table = SessionTable(lease_ttl_s=2.0, clock=Clock())
    ns = make_namespace(tmp_path)
    s = table.open(ns, "w", b"p", fence_dir)
    hold_some(ns, s, keys_for("e", 2))  # nobody holds its lock

    class Reg:
        namespaces = {"ns": ns}

    assert SessionTable(2.0).adopt_fences(fence_dir, Reg()) == (0, 1)  # type: ignore[arg-type]
    assert os.listdir(fence_dir) == []


def test_fence_states_and_handles(tmp_path, fence_dir):
    table = SessionTable(lease_ttl_s=2.0, clock=Clock())
    ns = make_namespace(tmp_path)
    s = table.open(ns, "w", b"p", fence_dir)
    assert s.fence.state == LIVE and len(s.handle) == 8 and s.handle in s.describe()
    assert f"{s.id:x}" not in s.describe()  # logs never carry the whole id
    path = s.fence.path
    table.end(s, "bye")
    assert not os.path.exists(path)  # nothing held: released and gone at once
    with pytest.raises(InvalidArgument):
        SessionTable(2.0).open(ns, "x", b"p", None)


def test_session_ids_are_random_and_distinct(tmp_path):
    table = SessionTable(10.0)
    ids = {table.open(None, "").id for _ in range(100)}
    assert len(ids) == 100 and all(0 < i < (1 << 62) for i in ids)
