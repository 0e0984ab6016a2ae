"""Regions on a hugetlbfs mount (2 MiB pages): create, store, restart, adopt.

Needs root to mount hugetlbfs and reserve huge pages; CI runs as root. The
test restores the machine's huge page reservation and unmounts afterwards.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from hisparse import KVLayout
from hisparse.protocol import Op
from tests.rawclient import RawClient, keys_for

NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"


@pytest.fixture
def hugetlbfs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting hugetlbfs needs root")
    mount = tmp_path / "huge"
    mount.mkdir()
    with open(NR_HUGEPAGES) as f:
        saved = f.read().strip()
    try:
        with open(NR_HUGEPAGES, "w") as f:
            f.write(str(int(saved) + 16))
    except OSError as exc:
        pytest.skip(f"cannot reserve huge pages here: {exc}")
    r = subprocess.run(["mount", "-t", "hugetlbfs", "-o", "pagesize=2M", "none", str(mount)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        with open(NR_HUGEPAGES, "w") as f:
            f.write(saved)
        pytest.skip(f"cannot mount hugetlbfs here: {r.stderr.strip()}")
    yield str(mount)
    # lazy: the test process may still map a region until its views are collected
    subprocess.run(["umount", "-l", str(mount)], check=False)
    with open(NR_HUGEPAGES, "w") as f:
        f.write(saved)


def test_regions_on_hugetlbfs_survive_a_restart(hugetlbfs, daemon_factory):
    d = daemon_factory(start=False, extra=("--meta-dir", hugetlbfs + "/../meta"))
    d.shm_dir = hugetlbfs
    d.start()
    layout = KVLayout(3, 4, 16)
    c = RawClient(d.socket)
    try:
        c.hello("huge", layout, capacity_bytes=192 * 1000)
        region = c.hello_reply["region"]
        assert os.stat(region["path"]).st_size % (2 << 20) == 0, "sized in whole huge pages"
        k = keys_for("h", 10)
        pages = [bytes([i]) * 192 for i in range(10)]
        assert c.store(k, pages) == 10
    finally:
        c.close()
    d.restart(kill=True)
    c = RawClient(d.socket)
    try:
        c.hello("huge", layout)
        assert c.call(Op.LOOKUP, keys=k) == {"count": 10}
        got = c.call(Op.PIN, keys=k)["pages"]
        assert [c.read_page(p) for p in got] == pages
    finally:
        c.close()
    d.stop()
    for top, _dirs, files in os.walk(hugetlbfs):  # the regions are in the daemon's own directory
        for name in files:
            os.unlink(os.path.join(top, name))  # free the huge pages before unmounting
