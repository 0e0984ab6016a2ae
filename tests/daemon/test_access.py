"""Access control per namespace: a group per namespace, checked by what the kernel lets a user read.

The tenants are real users: the test forks, and the child drops to another
uid (with or without the namespace's group) before it talks to the daemon.
That needs root (CI runs as root); elsewhere the test skips, saying so.
"""

from __future__ import annotations

import grp
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile

import pytest

from hisparse import KVLayout
from hisparse.paths import access_key_path, read_access_key
from hisparse.protocol import ErrorCode, Op
from tests.conftest import Daemon
from tests.rawclient import RawClient, keys_for
from tests.tenants import as_user

LAYOUT = KVLayout(num_layers=3, block_tokens=4, row_bytes=16)  # 192-byte pages
TENANT_UID = 4243
GROUP = "hsp-test-team-a"

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("groupadd") is None,
                                reason="tenants are other users: needs root and groupadd (CI has both)")


@pytest.fixture
def team_gid() -> int:
    subprocess.run(["groupadd", "-f", GROUP], check=True, capture_output=True)
    return grp.getgrnam(GROUP).gr_gid


@pytest.fixture
def shared_daemon(tmp_path, team_gid):
    """A daemon whose socket other users can reach (its group: root, gid 0)."""
    run_dir = tempfile.mkdtemp(prefix="hisparse-acl-", dir="/tmp")
    shm_dir = tempfile.mkdtemp(prefix="hisparse-acl-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.chmod(run_dir, 0o711)
    os.chmod(shm_dir, 0o711)
    cfg = tmp_path / "acl.toml"
    cfg.write_text(f'[namespaces."secret"]\ngroup = "{GROUP}"\ncapacity = 12288\n')
    d = Daemon(os.path.join(run_dir, "hisparsed.sock"), shm_dir, ["--config", str(cfg), "--capacity", "64MiB"],
               {**os.environ, "PYTHONUNBUFFERED": "1"}, str(tmp_path / "hisparsed.log"))
    d.start()
    yield d
    for proc in d.history:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(shm_dir, ignore_errors=True)


def _attach_and_store(socket: str) -> dict:
    from hisparse import HisparseError

    c = RawClient(socket)
    try:
        try:
            c.hello("secret", LAYOUT, access_key=read_access_key(socket, "secret"))
        except HisparseError as exc:
            return {"refused": str(exc)}
        stored = c.store(keys_for("tenant", 2), [b"t" * 192, b"u" * 192])
        page = c.call(Op.PIN, keys=keys_for("tenant", 1))["pages"][0]
        stats = c.call(Op.STATS)
        return {"stored": stored, "read": c.read_page(page).decode(), "stats": sorted(stats["namespaces"])}
    finally:
        c.close()


def _steal_region(path: str) -> str:
    try:
        open(path, "rb").close()
        return "opened"
    except PermissionError:
        return "denied"


def test_only_members_of_a_namespaces_group_attach_see_or_map_it(shared_daemon, team_gid):
    d = shared_daemon
    key_path = access_key_path(d.socket, "secret")
    st = os.stat(key_path)
    assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (team_gid, 0o640)
    # a member: attaches, stores, reads back its page
    member = as_user(TENANT_UID, lambda: _attach_and_store(d.socket), [0, team_gid])
    assert member == {"ok": {"stored": 2, "read": "t" * 192, "stats": ["secret"]}}, member
    # the region file belongs to the group, 0660: only its members can map it
    owner = RawClient(d.socket)
    try:
        region = owner.hello("open-ns", LAYOUT, 192 * 8)["region"]
        stats = owner.call(Op.STATS)["namespaces"]
        assert "secret" not in stats and "open-ns" in stats, "a restricted namespace is not listed to others"
    finally:
        owner.close()
    regions = os.path.dirname(region["path"])  # the daemon's own region directory in shm_dir
    (secret_region,) = [p for p in os.listdir(regions) if p.endswith(".region")
                        and p != os.path.basename(region["path"])]
    secret_region = os.path.join(regions, secret_region)
    st = os.stat(secret_region)
    assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (team_gid, 0o660)
    # someone else: cannot read the key, so the daemon refuses; nor can it map the region
    other = as_user(TENANT_UID, lambda: _attach_and_store(d.socket), [0])
    assert other["ok"]["refused"].startswith(f"[{ErrorCode.PERMISSION_DENIED.value}]"), other
    assert f"restricted to group '{GROUP}'" in other["ok"]["refused"]
    assert as_user(TENANT_UID, lambda: _steal_region(secret_region), [0]) == {"ok": "denied"}
    # an admin session without the token sees neither the namespace nor its sessions
    plain = RawClient(d.socket)
    try:
        plain.hello()
        stats = plain.call(Op.STATS)
        assert "secret" not in stats["namespaces"]
        assert all(row["namespace"] != "secret" for row in stats["sessions"])
    finally:
        plain.close()
    # the admin (hisparsectl with the token) sees every namespace
    r = subprocess.run([sys.executable, "-m", "hisparse.ctl", "--socket", d.socket, "stats", "--json"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "secret" in json.loads(r.stdout)["namespaces"]


def test_an_unknown_group_is_a_config_error(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[namespaces."x"]\ngroup = "no-such-group-hsp"\n')
    r = subprocess.run([sys.executable, "-m", "hisparse.daemon.main", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and 'namespaces."x".group' in r.stderr and "no group" in r.stderr
