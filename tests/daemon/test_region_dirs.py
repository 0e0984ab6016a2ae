"""Each daemon's regions in a directory of its own: a second daemon, --fresh and a logout.

Two daemons with their own sockets and meta dirs share one shm dir, as two
users' daemons share /dev/shm. Neither removes, nor trips over, the other's
regions, whatever the flags; a daemon whose meta dir was removed (a logout
removes $XDG_RUNTIME_DIR) leaves a region directory that only a later daemon
of that same meta dir may reclaim, and only once no daemon runs on it.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal

import pytest

from hisparse import KVLayout
from hisparse.daemon.store.regiondir import ID_FILE
from hisparse.protocol import Op
from tests.rawclient import RawClient, keys_for

LAYOUT = KVLayout(num_layers=3, block_tokens=4, row_bytes=16)  # 192-byte pages
PAGES = [bytes([i + 1]) * 192 for i in range(6)]


def meta_of(d) -> str:
    return os.path.join(os.path.dirname(d.socket), "meta")


def region_dir_of(d) -> str:
    with open(os.path.join(meta_of(d), ID_FILE)) as f:
        return os.path.join(d.shm_dir, f.read().strip())


def store(d, namespace: str, tag: str) -> None:
    c = RawClient(d.socket)
    try:
        c.hello(namespace, LAYOUT, 192 * 16)
        assert c.store(keys_for(tag, len(PAGES)), PAGES) == len(PAGES)
    finally:
        c.close()


def read_back(d, namespace: str, tag: str) -> list[bytes]:
    """A fresh attach (it maps the region by the path the daemon names) and the pages it reads."""
    c = RawClient(d.socket)
    try:
        c.hello(namespace, LAYOUT, 192 * 16)
        assert c.call(Op.LOOKUP, keys=keys_for(tag, len(PAGES))) == {"count": len(PAGES)}
        pages = c.call(Op.PIN, keys=keys_for(tag, len(PAGES)))["pages"]
        return [c.read_page(p) for p in pages]
    finally:
        c.close()


@pytest.fixture
def two_daemons(daemon_factory):
    """A serving, B made on A's shm dir with its own socket and meta dir (not started)."""
    a = daemon_factory(capacity="64MiB")
    b = daemon_factory(capacity="64MiB", start=False)
    b.shm_dir = a.shm_dir
    return a, b


def test_fresh_on_a_second_daemon_never_touches_the_first_daemons_regions(two_daemons):
    a, b = two_daemons
    store(a, "a-ns", "a")
    a_files = sorted(glob.glob(os.path.join(a.shm_dir, "**", "*.region"), recursive=True))
    b.start()
    store(b, "b-ns", "b")
    b.restart("--fresh")
    b.restart("--fresh", kill=True)
    assert all(os.path.exists(p) for p in a_files), "B's --fresh removed A's region files"
    assert "start with --fresh" not in b.log() and "remove it" not in b.log()
    # A's attaches keep working, and its namespace survives its own restart
    assert read_back(a, "a-ns", "a") == PAGES
    a.restart(kill=True)
    assert read_back(a, "a-ns", "a") == PAGES
    # B's --fresh emptied only its own directory; its namespace is gone, as asked
    c = RawClient(b.socket)
    try:
        assert c.hello("b-ns", LAYOUT, 192 * 16)["region"]["created"] is True
    finally:
        c.close()
    assert region_dir_of(a) != region_dir_of(b)
    assert os.path.dirname(c.hello_reply["region"]["path"]) == region_dir_of(b)


def test_a_logout_leaves_a_directory_no_other_daemon_deletes_or_trips_over(two_daemons, tmp_path):
    a, b = two_daemons
    store(a, "a-ns", "a")
    b.start()
    store(b, "b-ns", "b")
    a_dir, b_dir = region_dir_of(a), region_dir_of(b)
    # "logout" while B still runs: its meta dir is removed under it
    shutil.rmtree(meta_of(b))
    # a daemon on B's (now new) meta dir path: B still runs on its directory, so it stays
    os.makedirs(tmp_path / "b2", mode=0o700)
    b2 = type(b)(str(tmp_path / "b2" / "hisparsed.sock"), b.shm_dir, [*b.args, "--meta-dir", meta_of(b)],
                 b.env, str(tmp_path / "b2.log"))
    b2.start()
    try:
        assert os.path.isdir(b_dir) and "a hisparsed still runs on it" in b2.log()
        assert read_back(b, "b-ns", "b") == PAGES, "B's attaches keep working"
        # A, restarted with --fresh, leaves B's directory alone too (not its meta dir's)
        a.restart("--fresh")
        assert os.path.isdir(b_dir) and os.listdir(b_dir)
        store(a, "a-ns", "a")
        # B ends (the logout's last process): a later daemon of that meta dir path reclaims its memory
        b.stop()
        b2.restart()
        assert not os.path.exists(b_dir), "an unused directory made for this very meta dir is reclaimed"
        assert f"removed region directory {b_dir}" in b2.log()
        # and A's, made for another meta dir, is left alone
        assert os.path.isdir(a_dir) and read_back(a, "a-ns", "a") == PAGES
    finally:
        b2.stop(signal.SIGKILL)


def test_tables_of_the_earlier_layout_are_adopted_and_their_regions_moved_in(daemon_factory):
    d = daemon_factory(capacity="64MiB")
    store(d, "ns", "x")
    d.stop()
    # what a daemon before region directories left: the region directly in shm_dir,
    # no region directory named by its meta dir
    region_dir = region_dir_of(d)
    (region,) = glob.glob(os.path.join(region_dir, "*.region"))
    legacy = os.path.join(d.shm_dir, os.path.basename(region))
    os.rename(region, legacy)
    shutil.rmtree(region_dir)
    os.unlink(os.path.join(meta_of(d), ID_FILE))
    # and another old daemon's region beside it, named by none of our tables
    foreign = os.path.join(d.shm_dir, "hisparse-0123456789abcdef0123-00000000000000aa.region")
    with open(foreign, "wb") as f:
        f.write(b"another daemon's pages")
    d.start()
    assert read_back(d, "ns", "x") == PAGES
    assert not os.path.exists(legacy) and glob.glob(os.path.join(region_dir_of(d), "*.region"))
    d.restart("--fresh")
    assert os.path.exists(foreign), "a file no table of ours names is never ours to remove"
    assert "start with --fresh" not in d.log()


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's directory needs root (chown); CI runs as root")
def test_planted_region_directories_are_refused_or_left_alone(daemon_factory):
    d = daemon_factory(capacity="64MiB")
    store(d, "ns", "x")
    d.stop()
    os.chmod(d.shm_dir, 0o1777)  # shared, as /dev/shm is
    # another user's directories under names the daemon uses: one a link to the daemon's meta dir
    link = os.path.join(d.shm_dir, "hisparsed-00000000000000aa")
    os.symlink(meta_of(d), link)
    foreign = os.path.join(d.shm_dir, "hisparsed-00000000000000bb")
    os.mkdir(foreign, 0o700)
    os.chown(foreign, 4242, 4242)
    d.start()
    assert os.path.islink(link) and os.path.isdir(foreign) and os.path.isdir(meta_of(d))
    assert read_back(d, "ns", "x") == PAGES
    d.stop()
    # its own directory replaced by another user's: refused at start, saying which and why
    mine = region_dir_of(d)
    shutil.rmtree(mine)
    os.mkdir(mine, 0o750)
    os.chown(mine, 4242, 4242)
    with pytest.raises(RuntimeError, match="owned by uid 4242"):
        d.start()
