"""Files other local users plant or own: the daemon trusts none of them.

Another user is simulated by ``chown`` to a uid nobody uses (4242), which
needs root; CI runs as root. Elsewhere those tests skip, saying so.
"""

from __future__ import annotations

import glob
import os
import stat
import subprocess
import sys

import pytest

from hisparse import KVLayout
from hisparse.daemon.store.namespaces import namespace_tag
from hisparse.protocol import ErrorCode, Op
from hisparse.shm.region import RegionGeometry, create_file
from hisparse.shm.table import COMMITTED, MetaTable, TableHeader
from tests.rawclient import RawClient, keys_for

LAYOUT = KVLayout(num_layers=3, block_tokens=4, row_bytes=16)  # 192-byte pages
OTHER_UID = 4242  # another local user
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's files needs root "
                             "(chown to another uid); CI runs as root")


def start(args: list[str], timeout_s: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hisparse.daemon.main", *args], capture_output=True,
                          text=True, timeout=timeout_s)


def plant_namespace(directory: str, namespace: str, payload: bytes, uid: int) -> tuple[str, str]:
    """What an attacker plants: a table and a region with one COMMITTED page of its bytes,
    named as the daemon used to name them (``hisparse-<tag>.meta`` / ``.region``)."""
    tag = namespace_tag(namespace)
    region = os.path.join(directory, f"hisparse-{tag}.region")
    table_path = os.path.join(directory, f"hisparse-{tag}.meta")
    g = RegionGeometry(LAYOUT, 64)
    create_file(region, g.size_bytes)
    table = MetaTable.create(table_path, TableHeader(namespace, g, 7, os.path.basename(region)))
    key = keys_for("victim", 1)[0]
    table.set_writing(0, key, 1)
    table.set_state(0, COMMITTED)
    table.flush()
    table.close()
    with open(region, "r+b") as f:
        f.write(payload)
    for path in (region, table_path):
        os.chown(path, uid, uid)
        os.chmod(path, 0o666)
    return table_path, region


def test_metadata_lives_beside_the_socket_never_in_the_shm_dir(hisparsed):
    c = RawClient(hisparsed.socket)
    try:
        c.hello("ns", LAYOUT, 192 * 64)
    finally:
        c.close()
    meta = os.path.join(os.path.dirname(hisparsed.socket), "meta")
    assert glob.glob(os.path.join(meta, "hisparse-*.meta")) and os.path.exists(os.path.join(meta, "hisparsed.lock"))
    assert stat.S_IMODE(os.stat(meta).st_mode) == 0o700
    assert not glob.glob(os.path.join(hisparsed.shm_dir, "*.meta"))
    assert not os.path.exists(os.path.join(hisparsed.shm_dir, "hisparsed.lock"))
    region = glob.glob(os.path.join(hisparsed.shm_dir, "hisparsed-*", f"hisparse-{namespace_tag('ns')}-*.region"))
    assert len(region) == 1, "the region's name carries its random id, in the daemon's own directory"


@as_root
def test_planted_table_and_region_are_never_adopted(daemon_factory):
    d = daemon_factory(start=False)
    os.chmod(d.shm_dir, 0o1777)  # a shared shm dir, as /dev/shm is
    # the old attack: a table and region in the shm dir, planted by another user
    planted = plant_namespace(d.shm_dir, "ns", b"attacker bytes", OTHER_UID)
    d.start()
    c = RawClient(d.socket)
    try:
        reply = c.hello("ns", LAYOUT, 192 * 64)
        assert reply["region"]["created"] is True and reply["region"]["path"] not in planted
        assert c.call(Op.LOOKUP, keys=keys_for("victim", 1)) == {"count": 0}
    finally:
        c.close()
    assert all(os.path.exists(p) for p in planted), "another user's files are left alone"
    # and a table of another user in the daemon's own meta dir: logged, left alone
    meta = os.path.join(os.path.dirname(d.socket), "meta")
    d.stop()
    foreign = plant_namespace(meta, "other-ns", b"x", OTHER_UID)
    d.start()
    assert os.path.exists(foreign[0])
    assert f"not adopting {foreign[0]}" in d.log() and "not by hisparsed's user" in d.log()
    c = RawClient(d.socket)
    try:
        # its name is taken by a file the daemon may not remove: a typed refusal that says so
        reply = c.request(Op.HELLO, namespace="other-ns", layout=LAYOUT, capacity_bytes=192 * 64)
        assert reply.error_code == ErrorCode.INVALID_ARGUMENT.value and "in the way" in reply.error_message
        # the daemon's own namespace is adopted as before
        assert c.hello("ns", LAYOUT, 192 * 64)["region"]["created"] is False
    finally:
        c.close()


@as_root
def test_a_planted_region_file_cannot_block_a_configured_namespace(daemon_factory, tmp_path):
    cfg = tmp_path / "ns.toml"
    cfg.write_text('[namespaces."glm"]\ncapacity = 12288\n')
    d = daemon_factory(start=False, extra=("--config", str(cfg)))
    os.chmod(d.shm_dir, 0o1777)
    tag = namespace_tag("glm")
    # what another user may plant under the names the region used to have (a
    # directory: not even root's daemon can unlink it)
    for name in (f"hisparse-{tag}.region", f"hisparse-{tag}.meta"):
        path = os.path.join(d.shm_dir, name)
        os.mkdir(path)
        os.chown(path, OTHER_UID, OTHER_UID)
    d.start()
    c = RawClient(d.socket)
    try:
        assert c.hello("glm", LAYOUT)["region"]["num_pages"] == 64
    finally:
        c.close()


@as_root
def test_directories_of_another_user_or_writable_by_others_are_refused(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    os.chown(foreign, OTHER_UID, OTHER_UID)  # e.g. /tmp/hisparsed-$UID made by someone else first
    r = start(["--socket", str(foreign / "hisparsed.sock"), "--shm-dir", str(shm),
               "--meta-dir", str(tmp_path / "meta")])
    assert r.returncode == 1 and "owned by uid 4242" in r.stderr and "Traceback" not in r.stderr
    assert not os.path.exists(foreign / "hisparsed.token")
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    r = start(["--socket", str(open_dir / "hisparsed.sock"), "--shm-dir", str(shm)])
    assert r.returncode == 1 and f"chmod go-w {open_dir}" in r.stderr
    # a world-writable meta dir (the old default was /dev/shm) is refused too
    run = tmp_path / "run"
    run.mkdir()
    r = start(["--socket", str(run / "hisparsed.sock"), "--shm-dir", str(shm), "--meta-dir", str(open_dir)])
    assert r.returncode == 1 and "meta_dir" in r.stderr and "chmod go-w" in r.stderr
    # a shared shm dir must be sticky, or others could swap the region files
    r = start(["--socket", str(run / "hisparsed.sock"), "--shm-dir", str(open_dir)])
    assert r.returncode == 1 and "shm_dir" in r.stderr and "chmod +t" in r.stderr


@as_root
def test_a_planted_lock_of_another_user_is_named(tmp_path):
    run = tmp_path / "run"
    (run / "meta").mkdir(parents=True, mode=0o700)
    lock = run / "meta" / "hisparsed.lock"
    lock.write_text("")
    os.chown(lock, OTHER_UID, OTHER_UID)
    r = start(["--socket", str(run / "hisparsed.sock"), "--shm-dir", str(tmp_path)])
    assert r.returncode == 1 and str(lock) in r.stderr and "not by hisparsed's user" in r.stderr


def test_the_admin_token_is_a_fresh_private_file(daemon_factory, tmp_path):
    d = daemon_factory(start=False)
    token = os.path.join(os.path.dirname(d.socket), "hisparsed.token")
    target = tmp_path / "elsewhere"
    target.write_text("untouched")
    os.symlink(target, token)  # a link left in the token's place is replaced, never written through
    d.start()
    st = os.lstat(token)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert target.read_text() == "untouched"
    assert len(d.token) == 64


def test_a_planted_symlink_table_is_not_followed(daemon_factory, tmp_path):
    d = daemon_factory()
    c = RawClient(d.socket)
    try:
        c.hello("ns", LAYOUT, 192 * 64)
        c.store(keys_for("k", 2), [b"\1" * 192, b"\2" * 192])
    finally:
        c.close()
    d.stop()
    meta = os.path.join(os.path.dirname(d.socket), "meta")
    (table,) = glob.glob(os.path.join(meta, "hisparse-*.meta"))
    moved = str(tmp_path / "moved.meta")
    os.rename(table, moved)
    os.symlink(moved, table)
    d.start()
    assert "it is a symbolic link; left alone" in d.log() and os.path.islink(table)
    c = RawClient(d.socket)
    try:
        reply = c.request(Op.HELLO, namespace="ns", layout=LAYOUT, capacity_bytes=192 * 64)
        # the link is in the way of the namespace's table: a typed refusal, not INTERNAL
        assert reply.error_code == ErrorCode.INVALID_ARGUMENT.value and "in the way" in reply.error_message
    finally:
        c.close()


@as_root
def test_clients_refuse_a_default_socket_directory_of_another_user(monkeypatch, tmp_path):
    from hisparse import PermissionDenied
    from hisparse.paths import SYSTEM_SOCKET, default_socket_path

    if os.path.exists(SYSTEM_SOCKET):
        pytest.skip(f"{SYSTEM_SOCKET} exists here: the default is the system daemon")
    monkeypatch.delenv("HISPARSE_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_socket_path() == str(tmp_path / "hisparsed" / "hisparsed.sock")
    (tmp_path / "hisparsed").mkdir()
    os.chown(tmp_path / "hisparsed", OTHER_UID, OTHER_UID)  # planted before the daemon ever ran
    with pytest.raises(PermissionDenied, match="owned by uid 4242"):
        default_socket_path()
    # and the daemon refuses to start there
    r = start(["--shm-dir", str(tmp_path)], timeout_s=30)
    assert r.returncode == 1 and "owned by uid 4242" in r.stderr
