"""Namespaces and their regions: creation, sizing, adoption after a restart.

Each namespace owns one region file (``hisparse-<tag>.region``, mode 0660, in
``shm_dir``) and one metadata table (``hisparse-<tag>.meta``, mode 0600, in
``meta_dir``), where ``tag`` is a hash of the namespace's name. The table's
header names the namespace, its geometry and the region's random id, so a
restarted daemon can adopt both without any other state.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import secrets
from dataclasses import dataclass

from hisparse.daemon.config import Config
from hisparse.daemon.index import NamespaceIndex
from hisparse.errors import CapacityError, InvalidArgument, LayoutMismatch
from hisparse.layout import KVLayout, format_size
from hisparse.shm.region import RegionGeometry, create_file, file_size_for
from hisparse.shm.table import MetaTable, TableHeader

log = logging.getLogger(__name__)

REGION_SUFFIX = ".region"
TABLE_SUFFIX = ".meta"


def namespace_tag(namespace: str) -> str:
    return hashlib.sha256(namespace.encode()).hexdigest()[:20]


@dataclass
class Namespace:
    name: str
    layout: KVLayout
    geometry: RegionGeometry
    region_path: str
    region_id: int
    table: MetaTable
    index: NamespaceIndex
    created: bool  # by this daemon run (False: adopted)

    def region_info(self) -> dict[str, object]:
        g = self.geometry
        return {
            "path": self.region_path,
            "size_bytes": g.size_bytes,
            "num_pages": g.num_pages,
            "page_bytes": g.layout.page_bytes,
            "num_layers": g.layout.num_layers,
            "block_tokens": g.layout.block_tokens,
            "row_bytes": g.layout.row_bytes,
            "layer_stride_bytes": g.layer_stride_bytes,
            "region_id": self.region_id,
            "created": self.created,
        }


class Registry:
    """Every namespace of this daemon, within ``capacity_bytes`` together."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.namespaces: dict[str, Namespace] = {}

    @property
    def allocated_bytes(self) -> int:
        return sum(ns.geometry.size_bytes for ns in self.namespaces.values())

    def _paths(self, namespace: str) -> tuple[str, str]:
        tag = namespace_tag(namespace)
        return (os.path.join(self.config.shm_dir, f"hisparse-{tag}{REGION_SUFFIX}"),
                os.path.join(self.config.metadata_dir, f"hisparse-{tag}{TABLE_SUFFIX}"))

    # -- start-up --

    def adopt_all(self) -> None:
        """Adopt the regions an earlier run left, or remove them with ``--fresh``."""
        pattern = os.path.join(self.config.metadata_dir, f"hisparse-*{TABLE_SUFFIX}")
        for table_path in sorted(glob.glob(pattern)):
            if self.config.fresh:
                self._remove(table_path)
                continue
            try:
                self._adopt(table_path)
            except (InvalidArgument, CapacityError, OSError) as exc:
                log.warning("not adopting %s: %s; removing it", table_path, exc)
                self._remove(table_path)
        if self.config.fresh:
            for region in glob.glob(os.path.join(self.config.shm_dir, f"hisparse-*{REGION_SUFFIX}")):
                _unlink(region)

    def _adopt(self, table_path: str) -> None:
        table = MetaTable.open(table_path)
        h = table.header
        region_path, expected_table = self._paths(h.namespace)
        if os.path.abspath(expected_table) != os.path.abspath(table_path):
            table.close()
            raise InvalidArgument("table name does not match its namespace")
        if not os.path.exists(region_path):
            table.close()
            raise InvalidArgument(f"its region {region_path} is gone")
        if os.path.getsize(region_path) < h.geometry.size_bytes:
            table.close()
            raise InvalidArgument(f"its region {region_path} is smaller than its geometry")
        configured = self.config.namespaces.get(h.namespace)
        if configured and configured.capacity_bytes // h.geometry.layout.page_bytes != h.geometry.num_pages:
            table.close()
            raise InvalidArgument("the configured capacity changed its page count")
        if self.allocated_bytes + h.geometry.size_bytes > self.config.capacity_bytes:
            table.close()
            raise CapacityError("it does not fit in --capacity any more")
        index = NamespaceIndex(table)
        committed, freed = index.adopt()
        self.namespaces[h.namespace] = Namespace(h.namespace, h.geometry.layout, h.geometry,
                                                 region_path, h.region_id, table, index, False)
        log.info("adopted namespace %r: %d pages, %d committed, %d WRITING freed, region %s",
                 h.namespace, h.geometry.num_pages, committed, freed, region_path)

    def _remove(self, table_path: str) -> None:
        try:
            namespace = MetaTable.open(table_path)
            region_path = self._paths(namespace.header.namespace)[0]
            namespace.close()
            _unlink(region_path)
        except (InvalidArgument, OSError, UnicodeDecodeError):
            pass
        _unlink(table_path)

    # -- attach --

    def get_or_create(self, name: str, layout: KVLayout, capacity_bytes: int | None) -> Namespace:
        ns = self.namespaces.get(name)
        if ns is not None:
            if ns.layout != layout:
                raise LayoutMismatch(
                    f"namespace {name!r} exists with layout {ns.layout}, not {layout}")
            return ns
        return self._create(name, layout, capacity_bytes)

    def _create(self, name: str, layout: KVLayout, requested_bytes: int | None) -> Namespace:
        configured = self.config.namespaces.get(name)
        if configured is not None:
            capacity = configured.capacity_bytes
        elif requested_bytes is not None:
            capacity = requested_bytes
        else:
            # Unsized: the default, or what is left when less is, rather than a refusal.
            capacity = min(self.config.default_namespace_capacity_bytes,
                           self.config.capacity_bytes - self.allocated_bytes)
        left = self.config.capacity_bytes - self.allocated_bytes
        if capacity < layout.page_bytes:
            raise CapacityError(
                f"namespace {name!r} needs at least one page of {format_size(layout.page_bytes)}; "
                f"{format_size(left)} of the daemon's {format_size(self.config.capacity_bytes)} is left")
        geometry = RegionGeometry.for_capacity(layout, capacity)
        if geometry.size_bytes > left:
            raise CapacityError(
                f"namespace {name!r} needs {format_size(geometry.size_bytes)}; "
                f"{format_size(left)} of the daemon's {format_size(self.config.capacity_bytes)} is left")
        region_path, table_path = self._paths(name)
        for stale in (region_path, table_path):
            _unlink(stale)  # a leftover that was not adopted: never reuse its bytes
        region_id = secrets.randbits(62)
        create_file(region_path, geometry.size_bytes)
        try:
            table = MetaTable.create(table_path, TableHeader(name, geometry, region_id,
                                                             os.path.basename(region_path)))
        except BaseException:
            _unlink(region_path)
            raise
        ns = Namespace(name, layout, geometry, region_path, region_id, table,
                       NamespaceIndex(table), True)
        self.namespaces[name] = ns
        log.info("created namespace %r: %d pages of %s (%s), region %s", name, geometry.num_pages,
                 format_size(layout.page_bytes), format_size(geometry.size_bytes), region_path)
        return ns

    def flush(self) -> None:
        for ns in self.namespaces.values():
            ns.table.flush()

    def stats(self) -> dict[str, object]:
        cap = self.config.capacity_bytes
        used = self.allocated_bytes
        return {"capacity_bytes": cap, "allocated_bytes": used, "unallocated_bytes": cap - used,
                "region_file_bytes": sum(file_size_for(self.config.shm_dir, ns.geometry.size_bytes)
                                         for ns in self.namespaces.values())}


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
