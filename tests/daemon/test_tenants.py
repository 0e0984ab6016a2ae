"""Tenants that do not trust each other: quotas per uid, short stores that say why,
namespaces the config keeps, metrics that show only what stats would.

The attackers are real other users (``tests.tenants``: a forked child drops to
another uid); the daemon learns who is who from the kernel (SO_PEERCRED).
"""

from __future__ import annotations

import grp
import os
import urllib.request

from hisparse import HisparseError, KVLayout
from hisparse.ctlviews import scrape
from hisparse.paths import read_access_key
from hisparse.protocol import Op
from tests.rawclient import RawClient, keys_for
from tests.tenants import ATTACKER_UID, OTHER_UID, as_user, holding_as_user, needs_root
from tests.tenants import tenant_daemon  # noqa: F401 - a fixture

LAYOUT = KVLayout(num_layers=3, block_tokens=4, row_bytes=16)  # 192-byte pages
PAGES = 16


def _page(tag: str, i: int) -> bytes:
    return (f"{tag}{i}".encode() * 192)[:192]


def _hog(socket: str, sessions: int = 4) -> dict:
    """One process, many sessions: store every page, hold reservations, pin all it can, publish pinned."""
    clients = [RawClient(socket) for _ in range(sessions)]
    for c in clients:
        c.hello("ns", LAYOUT, 192 * PAGES)
    keys = keys_for("hog", PAGES)
    for i in range(0, PAGES, 4):
        try:
            clients[0].store(keys[i:i + 4], [_page("h", j) for j in range(i, i + 4)])
        except HisparseError:
            pass  # a second process of the uid: the uid's quota is already used
    spare = clients[-1]
    placeholders = keys_for("placeholder", 2)
    reserve = spare.request(Op.RESERVE, keys=placeholders)
    pinned, refusals = 0, []
    for n, c in enumerate(clients):
        reply = c.request(Op.PIN, keys=keys[4 * n:4 * n + 4])
        if reply.ok is not None:
            pinned += reply.ok["count"]
        else:
            refusals.append(f"{reply.error_code} {reply.error_message}")
    published = spare.request(Op.PUBLISH, keys=placeholders, as_keys=keys_for("late", 2), pin=True)
    more = spare.request(Op.RESERVE, keys=keys_for("more", PAGES))
    return {"pinned": pinned, "refusals": refusals,
            "reserved": len(reserve.ok["slots"]) if reserve.ok else reserve.error_code,
            "publish": f"{published.error_code} {published.error_message}",
            "more": len(more.ok["slots"]) if more.ok else f"{more.error_code} {more.error_message}"}


@needs_root
def test_one_uid_holds_its_share_however_many_sessions_or_processes(tenant_daemon):
    # the embedded defaults (quotas on: half a region per session and per uid), pins at a quarter
    d = tenant_daemon("--session-pin-share", "0.25")
    victim = RawClient(d.socket)
    try:
        victim.hello("ns", LAYOUT, 192 * PAGES)
        with holding_as_user(ATTACKER_UID, lambda: _hog(d.socket)) as hog:
            assert "ok" in hog, hog
            hog = hog["ok"]
            # four sessions, 4 pins each: the uid's pin share (4 of 16) is all it gets
            assert hog["reserved"] == 2 and hog["pinned"] == PAGES // 4, hog
            assert hog["refusals"] and all("QUOTA_EXCEEDED" in r and "peer_pin_share" in r
                                           for r in hog["refusals"]), hog
            # publish with pin=True is a pin: refused past the share, naming it
            assert hog["publish"].startswith("QUOTA_EXCEEDED") and "peer_pin_share" in hog["publish"], hog
            # pins + reservations of the uid stay within half the region (8): 4 + 2 held, 2 more
            assert hog["more"] == 2, hog
            # a second process of the same uid gets nothing more
            again = as_user(ATTACKER_UID, lambda: _hog(d.socket, sessions=1))["ok"]
            assert again["pinned"] == 0 and str(again["reserved"]).startswith("QUOTA_EXCEEDED"), again
            # the other tenant (another uid) still stores half the region, and pins its share
            keys = keys_for("victim", PAGES // 2)
            assert victim.store(keys, [_page("v", i) for i in range(PAGES // 2)]) == PAGES // 2
            pages = victim.call(Op.PIN, keys=keys[:4])["pages"]
            assert [victim.read_page(p) for p in pages] == [_page("v", i) for i in range(4)]
    finally:
        victim.close()


def test_a_store_cut_by_quota_says_so(daemon_factory):
    d = daemon_factory()  # defaults: a session reserves at most half the region while another is short
    one, other = RawClient(d.socket), RawClient(d.socket)
    try:
        one.hello("ns", LAYOUT, 192 * PAGES)
        other.hello("ns", LAYOUT, 192 * PAGES)
        # the other session asks for more than the region: short (by room), it contends; the shares bind
        assert len(other.call(Op.RESERVE, keys=keys_for("other", PAGES + 1))["slots"]) == PAGES
        other.call(Op.ABORT, keys=keys_for("other", PAGES))
        body = one.call(Op.RESERVE, keys=keys_for("big", 12))
        assert len(body["slots"]) == 8
        assert body["shortfall"]["by"] == "quota" and body["shortfall"]["limit"] == "session_reserve_share"
        assert "session_reserve_share 0.5 of 16 pages" in body["shortfall"]["message"]
        assert "store short for session" in d.log(), "the daemon logs why a store came up short"
        one.call(Op.ABORT, keys=keys_for("big", 12)[:8])
        assert one.call(Op.RESERVE, keys=keys_for("small", 2))["shortfall"] is None
    finally:
        one.close()
        other.close()


_KEPT: list[RawClient] = []  # a child's clients, alive until it exits


def _attach(socket: str) -> bool:
    """Another tenant attached to the namespace, asking for nothing (yet)."""
    c = RawClient(socket)
    c.hello("ns", LAYOUT, 192 * PAGES)
    _KEPT.append(c)
    return True


def _pin_share(socket: str, tag: str, count: int) -> int:
    c = RawClient(socket)
    c.hello("ns", LAYOUT, 192 * PAGES)
    keys = keys_for(tag, count)
    c.store(keys, [_page(tag, i) for i in range(count)])
    return c.call(Op.PIN, keys=keys)["count"]


@needs_root
def test_a_store_cut_by_others_pins_says_so(tenant_daemon):
    d = tenant_daemon()
    victim = RawClient(d.socket)
    try:
        victim.hello("ns", LAYOUT, 192 * PAGES)
        with holding_as_user(ATTACKER_UID, lambda: _pin_share(d.socket, "a", 8)) as a, \
                holding_as_user(OTHER_UID, lambda: _pin_share(d.socket, "b", 6)) as b:
            assert (a, b) == ({"ok": 8}, {"ok": 6})
            body = victim.call(Op.RESERVE, keys=keys_for("late", 8))
            assert len(body["slots"]) == 2 and body["shortfall"]["by"] == "room", body
            assert "14 of 16 pages pinned" in body["shortfall"]["message"]
    finally:
        victim.close()


def _create(socket: str, names: list[str], capacity: int = 192 * 8) -> list[str]:
    c = RawClient(socket)
    out = []
    try:
        for name in names:
            reply = c.request(Op.HELLO, namespace=name, layout=LAYOUT, capacity_bytes=capacity,
                              client="squatter")
            out.append("ok" if reply.ok is not None else f"{reply.error_code} {reply.error_message}")
    finally:
        c.close()
    return out


def test_namespaces_named_in_the_config_keep_their_slots_and_capacity(daemon_factory, tmp_path):
    cfg = tmp_path / "h.toml"
    cfg.write_text(f'[namespaces."kept"]\ncapacity = {192 * 1024}\n')
    d = daemon_factory(capacity="1MiB", extra=("--config", str(cfg), "--max-namespaces", "3",
                                              "--peer-max-namespaces", "10"))
    # capacity: what is left after "kept"'s 192 KiB (and its table) is not all the squatter's
    (big,) = _create(d.socket, ["squat-big"], capacity=900 << 10)
    assert big.startswith("CAPACITY") and "kept for namespaces named in the config" in big, big
    # slots: one connection squats until refused; "kept"'s slot is not among them
    got = _create(d.socket, [f"squat-{i}" for i in range(4)])
    assert got[:2] == ["ok", "ok"], got
    assert got[2].startswith("CAPACITY") and "1 slots kept for those named in the config" in got[2], got
    d.restart()  # the squatters' namespaces are adopted: "kept" still has its place
    assert _create(d.socket, ["squat-late"])[0].startswith("CAPACITY")
    c = RawClient(d.socket)
    try:
        assert c.hello("kept", LAYOUT, None)["region"]["num_pages"] == 1024
    finally:
        c.close()


@needs_root
def test_a_lone_uid_may_take_every_unnamed_slot_but_not_half_once_another_uid_made_one(tenant_daemon):
    # 12 slots, the shipped peer_max_namespaces (32): a lone tenant is not held back by it
    d = tenant_daemon("--max-namespaces", "12")
    assert _create(d.socket, [f"mine-{i}" for i in range(12)]) == ["ok"] * 12  # root, alone
    e = tenant_daemon("--max-namespaces", "12")
    assert as_user(OTHER_UID, lambda: _create(e.socket, ["theirs"]))["ok"] == ["ok"]
    got = as_user(ATTACKER_UID, lambda: _create(e.socket, [f"squat-{i}" for i in range(8)]))["ok"]
    assert got[:6] == ["ok"] * 6, got  # half of the 12 slots, once another uid has one
    assert got[6].startswith("QUOTA_EXCEEDED") and "peer_max_namespaces" in got[6], got
    assert as_user(OTHER_UID, lambda: _create(e.socket, ["theirs-2"]))["ok"] == ["ok"]


@needs_root
def test_namespace_creation_is_limited_per_uid_and_stats_name_the_creator(tenant_daemon):
    d = tenant_daemon("--peer-max-namespaces", "2")
    got = as_user(ATTACKER_UID, lambda: _create(d.socket, ["a-0", "a-1", "a-2"]))["ok"]
    assert got[:2] == ["ok", "ok"], got
    assert got[2].startswith("QUOTA_EXCEEDED") and "peer_max_namespaces (2)" in got[2], got
    # another connection, another process of the same uid: still that uid's limit
    again = as_user(ATTACKER_UID, lambda: _create(d.socket, ["a-3"]))["ok"]
    assert again[0].startswith("QUOTA_EXCEEDED"), again
    # another uid is not held back by it
    assert as_user(OTHER_UID, lambda: _create(d.socket, ["b-0"]))["ok"] == ["ok"]
    admin = RawClient(d.socket)
    try:
        admin.hello()
        namespaces = admin.call(Op.STATS)["namespaces"]
        assert namespaces["a-0"]["creator"]["uid"] == ATTACKER_UID
        assert namespaces["a-0"]["creator"]["client"] == "squatter"
        assert namespaces["a-0"]["creator"]["pid"] > 0
        assert namespaces["b-0"]["creator"]["uid"] == OTHER_UID
    finally:
        admin.close()


def test_metrics_show_a_restricted_namespace_only_to_whom_stats_would(daemon_factory, tmp_path):
    from tests.daemon.test_metrics import free_port

    group = grp.getgrgid(os.getegid()).gr_name  # the daemon's user is in its own group
    cfg = tmp_path / "h.toml"
    cfg.write_text(f'[namespaces."secret-ns"]\ngroup = "{group}"\ncapacity = {192 * 8}\n')
    port = free_port()
    d = daemon_factory(extra=("--config", str(cfg), "--metrics-address", f"127.0.0.1:{port}"))
    c = RawClient(d.socket)
    try:
        c.hello("secret-ns", LAYOUT, access_key=read_access_key(d.socket, "secret-ns"))
        c.store(keys_for("s", 2), [_page("s", 0), _page("s", 1)])
        other = RawClient(d.socket)
        other.hello("open-ns", LAYOUT, 192 * 8)
        other.close()
        # over TCP nobody is known: only what any session's stats shows
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'namespace="open-ns"' in text and "secret-ns" not in text
    finally:
        c.close()
    # the unix socket (0600) as the daemon's own user: the operator's view
    d2 = daemon_factory(extra=("--config", str(cfg)))
    c = RawClient(d2.socket)
    try:
        c.hello("secret-ns", LAYOUT, access_key=read_access_key(d2.socket, "secret-ns"))
        text = scrape(os.path.join(os.path.dirname(d2.socket), "hisparsed.metrics.sock"))
        assert 'namespace="secret-ns"' in text
    finally:
        c.close()


@needs_root
def test_a_page_pinned_by_two_sessions_of_one_uid_counts_once(tenant_daemon):
    # a scheduler and its worker (or two replicas) pin the same prefix: it is held once
    d = tenant_daemon()  # defaults: one uid pins at most half the region while another is attached
    a, b = RawClient(d.socket), RawClient(d.socket)
    try:
        a.hello("ns", LAYOUT, 192 * PAGES)
        b.hello("ns", LAYOUT, 192 * PAGES)
        with holding_as_user(OTHER_UID, lambda: _attach(d.socket)) as other:
            assert other == {"ok": True}, other
            keys = keys_for("shared", PAGES // 2)
            assert a.store(keys, [_page("s", i) for i in range(PAGES // 2)]) == PAGES // 2
            assert a.call(Op.PIN, keys=keys)["count"] == PAGES // 2
            assert b.call(Op.PIN, keys=keys)["count"] == PAGES // 2, "the same 8 pages: still the uid's 8"
            more = keys_for("more", 1)
            assert b.request(Op.RESERVE, keys=more).error_code == "QUOTA_EXCEEDED", "8 held: the uid's half"
    finally:
        a.close()
        b.close()
