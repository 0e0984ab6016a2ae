"""Namespaces and their regions: creation, sizing, charging, dropping, adoption.

Each namespace owns one region file (``hisparse-<tag>-<id>.region``, mode
0660, in the daemon's own region directory under ``shm_dir``: ``regiondir``)
and one metadata table (``hisparse-<tag>.meta``, mode
0600, in ``meta_dir``), where ``tag`` is a hash of the namespace's name and
``id`` the region's random id. The table's header names the namespace, its
geometry and the region file, so a restarted daemon can adopt both without
any other state (``adoption``). A region's name is unguessable, so no file
planted in a shared ``shm_dir`` can stand in for it or block its creation.

A namespace costs its region, its table and its in-memory index; all three
are charged against ``--capacity`` (``namespace_cost_bytes``). Creating a
region allocates it (``fallocate``), which takes seconds per GiB: that runs
on a worker thread, and the namespace's attachers are answered when it is
ready while the event loop serves everyone else.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hisparse.daemon.conf.config import Config
from hisparse.daemon.policy import trust
from hisparse.daemon.policy.access import give_to_group
from hisparse.daemon.store import background
from hisparse.daemon.store.index import NamespaceIndex
from hisparse.errors import CapacityError, InvalidArgument, LayoutMismatch, QuotaExceeded
from hisparse.layout import KVLayout, format_size
from hisparse.paths import namespace_tag
from hisparse.shm.region import RegionGeometry, create_file, file_size_for
from hisparse.shm.table import MetaTable, TableHeader, table_size

log = logging.getLogger(__name__)

REGION_SUFFIX = ".region"
TABLE_SUFFIX = ".meta"
# In-memory index per page, measured (tracemalloc, 36-byte keys): ~153 B of
# key dict entry, 25 B of arrays (page key, state, pins, LRU stamp, free
# stack); rounded up for 64-byte keys.
INDEX_BYTES_PER_PAGE = 208
# What a namespace named in the config keeps aside until it exists: its region, plus
# this share of it for its table and index (its page size, hence their size, comes later).
RESERVED_OVERHEAD_SHARE = 1 / 16


def namespace_cost_bytes(shm_dir: str, geometry: RegionGeometry) -> int:
    """What a namespace takes from ``--capacity``: region file + metadata table + index."""
    return (file_size_for(shm_dir, geometry.size_bytes) + table_size(geometry.num_pages)
            + INDEX_BYTES_PER_PAGE * geometry.num_pages)


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
    cost_bytes: int = 0
    creator: dict[str, Any] | None = None  # uid, gid, pid, client of the hello that created it
    creator_key: object = None  # its Peer.key: what peer_max_namespaces counts

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


@dataclass
class _Creation:
    """A namespace whose region is being allocated on a worker thread."""

    name: str
    layout: KVLayout
    geometry: RegionGeometry
    cost_bytes: int
    future: asyncio.Future
    creator: dict[str, Any] | None = None
    creator_key: object = None


class Registry:
    """Every namespace of this daemon, within ``capacity_bytes`` together."""

    def __init__(self, config: Config, region_dir: str | None = None) -> None:
        self.config = config
        # Where region files are made: the daemon's own directory (``regiondir``);
        # an in-process registry (tools, benchmarks) makes them in shm_dir itself.
        self.region_dir = region_dir or config.shm_dir
        self.namespaces: dict[str, Namespace] = {}
        self.creating: dict[str, _Creation] = {}
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        # The group a namespace's region file is given (access.AccessControl.gid_for).
        self.gid_for: Callable[[str], int | None] = lambda namespace: None
        # Told of each dropped namespace (the cluster tier lets go of its mapping).
        self.on_drop: Callable[[Namespace], None] = lambda ns: None

    @property
    def allocated_bytes(self) -> int:
        """Charged against ``--capacity``: live namespaces and those being created."""
        return (sum(ns.cost_bytes for ns in self.namespaces.values())
                + sum(c.cost_bytes for c in self.creating.values()))

    def table_path(self, namespace: str) -> str:
        return os.path.join(self.config.metadata_dir, f"hisparse-{namespace_tag(namespace)}{TABLE_SUFFIX}")

    def region_path(self, namespace: str, region_id: int) -> str:
        return os.path.join(self.region_dir,
                            f"hisparse-{namespace_tag(namespace)}-{region_id:016x}{REGION_SUFFIX}")


    # -- attach --

    def get_or_create(self, name: str, layout: KVLayout, capacity_bytes: int | None) -> Namespace:
        """Synchronous attach (tools and benchmarks): creates the region on this thread."""
        ns = self._existing(name, layout, capacity_bytes, [])
        if ns is not None:
            return ns
        geometry, cost = self._plan(name, layout, capacity_bytes, [])
        return self._register(name, layout, self._build(name, geometry), cost)

    def attach(self, name: str, layout: KVLayout, capacity_bytes: int | None,
               warnings: list[str], creator: Any = None, client: str = "") -> Namespace | asyncio.Future:
        """The namespace, or a future of it while its region is allocated off the loop.

        Raises ``LayoutMismatch``, ``CapacityError`` or ``InvalidArgument``;
        appends to ``warnings`` what the attacher should be told (a capacity
        that is not the namespace's).
        """
        ns = self._existing(name, layout, capacity_bytes, warnings)
        if ns is not None:
            return ns
        pending = self.creating.get(name)
        if pending is not None:
            self._check_same(name, pending.layout, layout, pending.geometry, capacity_bytes, warnings)
            return pending.future
        geometry, cost = self._plan(name, layout, capacity_bytes, warnings, creator)
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        who = None if creator is None else {**creator.to_wire(), "client": client}
        key = None if creator is None else creator.key
        self.creating[name] = _Creation(name, layout, geometry, cost, future, who, key)
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="hisparse-alloc",
                                                                   initializer=background.lower_priority)
        work = loop.run_in_executor(self._executor, self._build, name, geometry)

        def done(work: asyncio.Future) -> None:
            self.creating.pop(name, None)
            if work.cancelled():
                future.cancel()
                return
            if work.exception() is not None:
                future.set_exception(work.exception())
                return
            try:
                ns = self._register(name, layout, work.result(), cost)
                ns.creator, ns.creator_key = who, key
                future.set_result(ns)
            except Exception as exc:  # every attacher gets an answer, whatever happened
                future.set_exception(exc)

        work.add_done_callback(done)
        return future

    def _existing(self, name: str, layout: KVLayout, capacity_bytes: int | None,
                  warnings: list[str]) -> Namespace | None:
        ns = self.namespaces.get(name)
        if ns is not None:
            self._check_same(name, ns.layout, layout, ns.geometry, capacity_bytes, warnings)
        return ns

    def _check_same(self, name: str, have: KVLayout, want: KVLayout, geometry: RegionGeometry,
                    capacity_bytes: int | None, warnings: list[str]) -> None:
        if have != want:
            raise LayoutMismatch(f"namespace {name!r} exists with layout {have}, not {want}")
        if capacity_bytes is not None and capacity_bytes // want.page_bytes != geometry.num_pages:
            text = (f"namespace {name!r} exists with {format_size(geometry.size_bytes)} "
                    f"({geometry.num_pages} pages); the requested {format_size(capacity_bytes)} is "
                    "ignored: drop the namespace (hisparsectl drop) or size it in the config to resize it")
            log.warning("%s", text)
            warnings.append(text)

    def _kept_aside_bytes(self, but: str) -> int:
        """Capacity kept for namespaces named in the config that do not exist yet (``but`` excepted)."""
        kept = 0
        for name, c in self.config.namespaces.items():
            if name != but and name not in self.namespaces and name not in self.creating:
                region = c.capacity_bytes or self.config.default_namespace_capacity_bytes
                kept += region + int(region * RESERVED_OVERHEAD_SHARE) + 4096
        return kept

    def _check_slots(self, name: str, creator: Any) -> None:
        """Namespaces named in the config keep their slots; others are limited, also per peer."""
        cfg = self.config
        if name in cfg.namespaces:
            return
        unlisted = [(n, c.creator_key) for n, c in (*self.namespaces.items(), *self.creating.items())
                    if n not in cfg.namespaces]
        slots = max(0, cfg.max_namespaces - len(cfg.namespaces))
        if len(unlisted) >= slots:
            raise CapacityError(f"max_namespaces ({cfg.max_namespaces}) reached: {len(unlisted)} "
                                f"namespaces, {len(cfg.namespaces)} slots kept for those named in the "
                                "config; drop one (hisparsectl drop NAME) or raise max_namespaces")
        if creator is not None:
            mine = sum(1 for _, key in unlisted if key == creator.key)
            # work-conserving, as the shares: past half the unnamed slots only while no other uid made one
            contended = any(key not in (None, creator.key) for _, key in unlisted)
            if mine >= cfg.peer_max_namespaces or (contended and mine >= max(1, slots // 2)):
                raise QuotaExceeded(f"peer_max_namespaces ({cfg.peer_max_namespaces}): "
                                    f"{creator.describe()} has created {mine} namespaces not named in "
                                    f"the config ({slots} slots for those; while another uid has made "
                                    "some, one uid takes at most half); drop one (hisparsectl drop NAME) "
                                    "or name it in the config")

    def _plan(self, name: str, layout: KVLayout, requested_bytes: int | None,
              warnings: list[str], creator: Any = None) -> tuple[RegionGeometry, int]:
        """The geometry and cost of a new namespace, or the refusal that names the limit."""
        cfg = self.config
        if layout.page_bytes < cfg.min_page_bytes:
            raise InvalidArgument(
                f"pages of {layout.page_bytes} B ({layout}) are below min_page_bytes "
                f"({cfg.min_page_bytes} B): a KV page holds a block of tokens of every layer")
        self._check_slots(name, creator)
        configured = cfg.namespaces.get(name)
        if configured is not None and configured.capacity_bytes is not None:
            capacity = configured.capacity_bytes
            if requested_bytes is not None and requested_bytes != capacity:
                warnings.append(f"namespace {name!r} is sized {format_size(capacity)} by the daemon's "
                                f"config; the requested {format_size(requested_bytes)} is ignored")
        elif requested_bytes is not None:
            capacity = requested_bytes
        else:
            capacity = cfg.default_namespace_capacity_bytes
        kept = self._kept_aside_bytes(name)
        left = max(0, cfg.capacity_bytes - self.allocated_bytes - kept)
        if capacity < layout.page_bytes:
            raise CapacityError(f"namespace {name!r}: {format_size(capacity)} holds no page of "
                                f"{format_size(layout.page_bytes)}")
        geometry = RegionGeometry.for_capacity(layout, capacity)
        cost = namespace_cost_bytes(cfg.shm_dir, geometry)
        if cost > left:
            raise CapacityError(
                f"namespace {name!r} needs {format_size(cost)} (region, table and index); "
                f"{format_size(left)} of the daemon's capacity {format_size(cfg.capacity_bytes)} is "
                f"left ({format_size(kept)} kept for namespaces named in the config): ask for less, "
                "drop a namespace, or raise --capacity")
        return geometry, cost

    def _build(self, name: str, geometry: RegionGeometry) -> tuple[str, int, MetaTable, NamespaceIndex]:
        """Allocate the region, write its table, build its index (a worker thread)."""
        started = time.monotonic()
        region_id = secrets.randbits(62)
        region_path = self.region_path(name, region_id)
        table_path = self.table_path(name)
        if os.path.lexists(table_path) and not trust.unlink_own(table_path):
            raise InvalidArgument(f"{table_path} is in the way and is not hisparsed's: remove it")
        try:
            gid = self.gid_for(name)
            # A restricted namespace's region is private until it is its group's:
            # no one of the daemon's group may open it in between and keep the fd.
            create_file(region_path, geometry.size_bytes, mode=0o600 if gid is not None else 0o660)
            give_to_group(region_path, gid)
        except Exception as exc:
            log.error("region of namespace %r (%s) not allocated in %s: %s", name,
                      format_size(geometry.size_bytes), self.config.shm_dir, exc)
            raise
        try:
            table = MetaTable.create(table_path, TableHeader(name, geometry, region_id,
                                                             os.path.basename(region_path)))
        except BaseException as exc:
            log.error("metadata table of namespace %r not created: %s", name, exc)
            trust.unlink_own(region_path)
            raise
        index = NamespaceIndex(table)
        log.debug("allocated %s for %r in %.2fs", format_size(geometry.size_bytes), name,
                  time.monotonic() - started)
        return region_path, region_id, table, index

    def _register(self, name: str, layout: KVLayout,
                  built: tuple[str, int, MetaTable, NamespaceIndex], cost: int) -> Namespace:
        region_path, region_id, table, index = built
        geometry = table.header.geometry
        ns = Namespace(name, layout, geometry, region_path, region_id, table, index, True, cost)
        self.namespaces[name] = ns
        log.info("created namespace %r: %d pages of %s (%s; %s charged), region %s", name,
                 geometry.num_pages, format_size(layout.page_bytes), format_size(geometry.size_bytes),
                 format_size(cost), region_path)
        return ns

    # -- drop --

    def drop(self, name: str) -> Namespace:
        """Forget a namespace and remove its files; its memory goes back to ``--capacity``.

        The caller has closed its sessions. Clients still mapping the region
        keep their mapping until they unmap it (tmpfs frees it then).
        """
        ns = self.namespaces.pop(name)
        ns.table.close()
        trust.unlink_own(ns.table.path)
        trust.unlink_own(ns.region_path)
        self.on_drop(ns)
        log.info("dropped namespace %r: %s back to the capacity", name, format_size(ns.cost_bytes))
        return ns

    def flush(self) -> None:
        for ns in self.namespaces.values():
            ns.table.flush()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    def stats(self) -> dict[str, object]:
        cap = self.config.capacity_bytes
        used = self.allocated_bytes
        return {"capacity_bytes": cap, "allocated_bytes": used, "unallocated_bytes": cap - used,
                "namespaces_creating": len(self.creating),
                "max_namespaces": self.config.max_namespaces,
                "region_file_bytes": sum(file_size_for(self.config.shm_dir, ns.geometry.size_bytes)
                                         for ns in self.namespaces.values())}
