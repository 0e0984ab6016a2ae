"""Adopting what an earlier daemon run left: tables in ``meta_dir``, regions in ``shm_dir``.

A table is adopted only when it and the region it names are the daemon's
own files (owner, no foreign write bit, not a symbolic link), opened with
``O_NOFOLLOW`` and checked on the open descriptor. A file that fails those
checks is logged and left where it is: it is someone else's, not ours to
delete. A table of our own that no longer fits (its region is gone, the
config resized the namespace, it no longer fits in ``--capacity``) is
removed with its region, and the log says why.

``--fresh`` removes every table of ours in ``meta_dir`` and the regions they
name, and nothing else.
"""

from __future__ import annotations

import errno
import glob
import logging
import os
import stat
from typing import TYPE_CHECKING

from hisparse.daemon import trust
from hisparse.daemon.index import NamespaceIndex
from hisparse.errors import CapacityError, InvalidArgument
from hisparse.layout import format_size
from hisparse.shm.table import MetaTable

if TYPE_CHECKING:
    from hisparse.daemon.namespaces import Namespace, Registry

log = logging.getLogger(__name__)


def _check_table(fd: int, path: str) -> None:
    trust.check_owned(fd, path)


def adopt_all(registry: Registry) -> None:
    from hisparse.daemon.namespaces import REGION_SUFFIX, TABLE_SUFFIX

    cfg = registry.config
    named: set[str] = set()
    for table_path in sorted(glob.glob(os.path.join(cfg.metadata_dir, f"hisparse-*{TABLE_SUFFIX}"))):
        try:
            table = MetaTable.open(table_path, check=_check_table)
        except trust.UnsafePath as exc:
            log.warning("not adopting %s: %s; left alone", table_path, exc)
            continue
        except (InvalidArgument, OSError) as exc:
            if isinstance(exc, OSError) and exc.errno == errno.ELOOP:
                log.warning("not adopting %s: it is a symbolic link; left alone", table_path)
            elif cfg.fresh:
                trust.unlink_own(table_path)
            else:
                log.warning("not adopting %s: %s; left alone (remove it, or start with --fresh)",
                            table_path, exc)
            continue
        region_path = _region_path_of(registry, table)
        if region_path is not None:
            named.add(os.path.basename(region_path))
        if cfg.fresh:
            _remove(table, region_path)
            continue
        try:
            _adopt(registry, table, region_path)
        except trust.UnsafePath as exc:
            table.close()
            log.warning("not adopting %s: its region %s; both left alone", table_path, exc)
        except (InvalidArgument, CapacityError, OSError) as exc:
            log.warning("not adopting namespace %r (%s): %s; removing its table and region",
                        table.header.namespace, table_path, exc)
            _remove(table, region_path)
    _report_orphans(registry, named, REGION_SUFFIX)


def _region_path_of(registry: Registry, table: MetaTable) -> str | None:
    """The region file the table names, when that name is one this daemon would have made."""
    from hisparse.daemon.namespaces import namespace_tag

    name = table.header.region_file
    if "/" in name or not name.startswith(f"hisparse-{namespace_tag(table.header.namespace)}-"):
        return None
    return os.path.join(registry.config.shm_dir, name)


def _adopt(registry: Registry, table: MetaTable, region_path: str | None) -> Namespace:
    from hisparse.daemon.namespaces import Namespace, namespace_cost_bytes

    cfg = registry.config
    h = table.header
    if os.path.abspath(registry.table_path(h.namespace)) != os.path.abspath(table.path):
        raise InvalidArgument("the table's name does not match its namespace")
    if region_path is None:
        raise InvalidArgument(f"it names a region file {h.region_file!r} this daemon never makes")
    try:
        fd = trust.open_owned(region_path, os.O_RDONLY, allowed_write=stat.S_IWGRP)
    except FileNotFoundError:
        raise InvalidArgument(f"its region {region_path} is gone") from None
    try:
        if os.fstat(fd).st_size < h.geometry.size_bytes:
            raise InvalidArgument(f"its region {region_path} is smaller than its geometry")
    finally:
        os.close(fd)
    if h.geometry.layout.page_bytes < cfg.min_page_bytes:
        raise InvalidArgument(f"its pages of {h.geometry.layout.page_bytes} B are below min_page_bytes")
    configured = cfg.namespaces.get(h.namespace)
    if (configured and configured.capacity_bytes
            and configured.capacity_bytes // h.geometry.layout.page_bytes != h.geometry.num_pages):
        raise InvalidArgument(f"resized by the config: {h.geometry.num_pages} pages now "
                              f"{configured.capacity_bytes // h.geometry.layout.page_bytes}; "
                              "its committed pages are dropped")
    if len(registry.namespaces) >= cfg.max_namespaces:
        raise CapacityError(f"max_namespaces ({cfg.max_namespaces}) already adopted")
    cost = namespace_cost_bytes(cfg.shm_dir, h.geometry)
    if registry.allocated_bytes + cost > cfg.capacity_bytes:
        raise CapacityError(f"its {format_size(cost)} does not fit in --capacity any more")
    index = NamespaceIndex(table)
    committed, freed = index.adopt()
    ns = Namespace(h.namespace, h.geometry.layout, h.geometry, region_path, h.region_id, table,
                   index, False, cost)
    registry.namespaces[h.namespace] = ns
    log.info("adopted namespace %r: %d pages, %d committed, %d WRITING freed, region %s",
             h.namespace, h.geometry.num_pages, committed, freed, region_path)
    return ns


def _remove(table: MetaTable, region_path: str | None) -> None:
    table.close()
    if region_path is not None:
        trust.unlink_own(region_path)
    trust.unlink_own(table.path)


def _report_orphans(registry: Registry, named: set[str], suffix: str) -> None:
    """Region files of ours that no table names (a crash mid-creation): removed by --fresh."""
    me = os.geteuid()
    for path in glob.glob(os.path.join(registry.config.shm_dir, f"hisparse-*{suffix}")):
        if os.path.basename(path) in named:
            continue
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if st.st_uid != me:
            log.warning("%s is not hisparsed's (owner uid %d): ignored, left alone", path, st.st_uid)
        elif registry.config.fresh:
            trust.unlink_own(path)
        else:
            log.warning("%s (%s) is named by no metadata table in %s: left alone; remove it, or start "
                        "with --fresh", path, format_size(st.st_size), registry.config.metadata_dir)
