"""Region geometry and files: the layer-major layout docs/design.md fixes, byte for byte."""

from __future__ import annotations

import os
import stat

import pytest

from hisparse import CapacityError, InvalidArgument, KVLayout
from hisparse.shm.region import RegionGeometry, RegionMap, create_file
from hisparse.shm.table import COMMITTED, FREE, WRITING, MetaTable, TableHeader


def test_glm_page_bytes():
    assert KVLayout(78, 64, 656).page_bytes == 3_274_752


def test_row_offset_is_layer_major_across_pages():
    g = RegionGeometry(KVLayout(num_layers=3, block_tokens=4, row_bytes=8), num_pages=5)
    bt, rb, n = 4, 8, 5
    for layer in range(3):
        for page in range(5):
            for token in range(4):
                assert g.row_offset(layer, page, token) == layer * n * bt * rb + page * bt * rb + token * rb
    assert g.layer_stride_bytes == n * bt * rb
    assert g.size_bytes == 3 * n * bt * rb


def test_capacity_rounds_down_to_pages_and_refuses_zero():
    lay = KVLayout(2, 4, 8)  # 64 B pages
    assert RegionGeometry.for_capacity(lay, 64 * 10 + 63).num_pages == 10
    with pytest.raises(CapacityError):
        RegionGeometry.for_capacity(lay, 63)


def test_create_file_is_allocated_mode_0660_and_exclusive(tmp_path):
    path = str(tmp_path / "r.region")
    old = os.umask(0o077)  # a strict umask must not narrow the region's mode
    try:
        size = create_file(path, 10_000)
    finally:
        os.umask(old)
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o660
    assert st.st_size == size >= 10_000
    assert st.st_blocks * 512 >= 10_000, "allocated, not sparse"
    with pytest.raises(FileExistsError):
        create_file(path, 10_000)


def test_views_address_the_same_bytes(tmp_path):
    g = RegionGeometry(KVLayout(3, 4, 8), 5)
    path = str(tmp_path / "r.region")
    create_file(path, g.size_bytes)
    region = RegionMap(path, g)
    pages = region.pages_view()
    assert pages.shape == (3, 5, 32)
    pages[2, 4, 8:16] = 7  # layer 2, page 4, token 1
    rows = region.layer_rows(2)
    assert rows.shape == (20, 8)
    assert (rows[4 * 4 + 1] == 7).all()
    assert region.array[g.row_offset(2, 4, 1)] == 7
    with pytest.raises(InvalidArgument):
        region.layer_rows(3)
    region.close()


def test_table_records_survive_reopen(tmp_path):
    g = RegionGeometry(KVLayout(2, 4, 8), 6)
    path = str(tmp_path / "t.meta")
    t = MetaTable.create(path, TableHeader("ns/α", g, 12345, "r.region"))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    t.set_writing(1, b"a" * 36, 7)
    t.set_state(1, COMMITTED)
    t.set_writing(3, b"b", 1)  # left WRITING, as by a writer that died
    t.close()
    t2 = MetaTable.open(path)
    assert t2.header == TableHeader("ns/α", g, 12345, "r.region")
    committed, writing = t2.scan()
    assert committed.tolist() == [1] and writing.tolist() == [3]
    assert t2.committed_keys(committed) == [b"a" * 36]
    assert t2.key_of(3) == b"b" and t2.generation_of(1) == 7
    assert t2.records["state"][0] == FREE and t2.records["state"][3] == WRITING


def test_table_open_rejects_foreign_files(tmp_path):
    path = tmp_path / "x.meta"
    path.write_bytes(b"\0" * 8192)
    with pytest.raises(InvalidArgument):
        MetaTable.open(str(path))
