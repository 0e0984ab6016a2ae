"""Adopting what an earlier daemon run left: tables in ``meta_dir``, regions in its region directory.

A table is adopted only when it and the region it names are the daemon's
own files (owner, no foreign write bit, not a symbolic link), opened with
``O_NOFOLLOW`` and checked on the open descriptor. A file that fails those
checks is logged and left where it is: it is someone else's, not ours to
delete. A table of our own that no longer fits (its region is gone, the
config resized the namespace, it no longer fits in ``--capacity``) is
removed with its region, and the log says why.

Regions live in the daemon's own region directory (``regiondir``). A table
written before that (its region directly in ``shm_dir``) is still adopted:
its region file is moved into the region directory (a rename; clients that
map it keep their mapping, and the table keeps naming the same base name, so
a crash between the two finds it in either place).

``--fresh`` removes every table of ours in ``meta_dir``, the regions they
name, and what else is in our own region directory; nothing else. Region
files in our region directory that no table names (a crash between a
region's creation and its table's) are provably ours and unused (our
directory, locked; no client was ever told of them), so they are removed
at every start, unless a table of ours could not be read. Files directly in
``shm_dir`` that no table of ours names may be another daemon's: left
alone, whatever the flags.
"""

from __future__ import annotations

import errno
import glob
import logging
import os
import stat

from hisparse.daemon.policy import trust
from hisparse.daemon.store.index import NamespaceIndex
from hisparse.daemon.store.namespaces import REGION_SUFFIX, TABLE_SUFFIX, Namespace, Registry, namespace_cost_bytes
from hisparse.errors import CapacityError, InvalidArgument
from hisparse.layout import format_size
from hisparse.paths import namespace_tag
from hisparse.shm.table import MetaTable

log = logging.getLogger(__name__)


def _check_table(fd: int, path: str) -> None:
    trust.check_owned(fd, path)


def adopt_all(registry: Registry) -> None:
    """Adopt what an earlier run left (or remove it with ``--fresh``)."""
    cfg = registry.config
    named: set[str] = set()
    unread = 0  # our tables we could not read: their regions may be among the unnamed
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
                unread += 1
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
    _remove_unnamed(registry, named, unread)
    _report_legacy(registry, named)


def _region_path_of(registry: Registry, table: MetaTable) -> str | None:
    """The region file the table names, when that name is one this daemon would have made.

    In the region directory; a table of the earlier layout names a file
    directly in ``shm_dir``, which is moved into the region directory here.
    """

    name = table.header.region_file
    if "/" in name or not name.startswith(f"hisparse-{namespace_tag(table.header.namespace)}-"):
        return None
    path = os.path.join(registry.region_dir, name)
    legacy = os.path.join(registry.config.shm_dir, name)
    if legacy != path and not os.path.lexists(path) and os.path.lexists(legacy):
        return path if _migrate(legacy, path) else legacy
    return path


def _migrate(legacy: str, path: str) -> bool:
    """Move a region of the earlier layout into the region directory, if it is ours.

    False: left where it is (and adopted there, as before).
    """
    try:
        fd = trust.open_owned(legacy, os.O_RDONLY, allowed_write=stat.S_IWGRP)
    except (OSError, trust.UnsafePath) as exc:
        log.warning("region %s left where it is: %s", legacy, exc)
        return False
    try:
        before = os.fstat(fd)
        # shm_dir is sticky or ours: nobody else can swap our file between the check and the rename
        os.rename(legacy, path)
        after = os.lstat(path)
    except OSError as exc:
        log.warning("region %s not moved into %s: %s; adopted where it is", legacy, path, exc)
        return False
    finally:
        os.close(fd)
    if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
        os.rename(path, legacy)
        log.warning("region %s changed while it was moved: left where it is", legacy)
        return False
    log.info("moved region %s into this daemon's region directory (%s)", legacy, path)
    return True


def _adopt(registry: Registry, table: MetaTable, region_path: str | None) -> Namespace:

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


def _remove_unnamed(registry: Registry, named: set[str], unread: int) -> None:
    """Region files in our own region directory that no table names: ours and unused, removed."""

    if registry.region_dir == registry.config.shm_dir:
        return  # an in-process registry without a directory of its own: nothing is provably ours
    for path in glob.glob(os.path.join(registry.region_dir, f"hisparse-*{REGION_SUFFIX}")):
        if os.path.basename(path) in named:
            continue
        if unread and not registry.config.fresh:
            log.warning("%s is named by no table that could be read: left alone while %d table(s) "
                        "in %s cannot be read", path, unread, registry.config.metadata_dir)
            continue
        try:
            size = os.lstat(path).st_size
        except FileNotFoundError:
            continue
        if trust.unlink_own(path):
            log.info("removed %s (%s): in this daemon's region directory, named by no table",
                     path, format_size(size))


def _report_legacy(registry: Registry, named: set[str]) -> None:
    """Region files directly in ``shm_dir`` that none of our tables names: never ours to touch."""

    if registry.region_dir == registry.config.shm_dir:
        return
    others = [p for p in glob.glob(os.path.join(registry.config.shm_dir, f"hisparse-*{REGION_SUFFIX}"))
              if os.path.basename(p) not in named]
    if others:
        log.info("%d region file(s) directly in %s are named by no table of this daemon: left alone "
                 "(another hisparsed's, or of an earlier version whose tables are elsewhere)",
                 len(others), registry.config.shm_dir)
