"""``hisparsed``: the node daemon's entry point.

Start-up order: config -> lock the metadata directory -> lock the region
directory it names (``regiondir``) -> adopt (or, with ``--fresh``, remove)
regions an earlier run left -> remove region directories provably ours and
unused -> bind the socket ->
write the admin token -> serve. READY=1 goes to systemd only once a real
ping over the bound socket has been answered by the running loop.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import functools
import logging
import os
import secrets
import sys
import time

import zmq
import zmq.asyncio

from hisparse import pipes, protocol
from hisparse.daemon.conf import config as config_mod
from hisparse.daemon.front import notify
from hisparse.daemon.front.server import Server, endpoint_for
from hisparse.daemon.ops.handlers import DaemonContext
from hisparse.daemon.ops.sweep import BEFORE_BIND_S, FenceSweep
from hisparse.daemon.policy import trust
from hisparse.daemon.policy.access import AccessControl, give_to_group
from hisparse.daemon.policy.limits import raise_fd_limit
from hisparse.daemon.store import adoption, regiondir
from hisparse.daemon.store.namespaces import Registry
from hisparse.daemon.store.sessions import SessionTable
from hisparse.errors import HisparseError
from hisparse.layout import format_size
from hisparse.paths import access_key_path
from hisparse.shm.fence import FENCE_DIR_MODE, fence_dir_for

log = logging.getLogger("hisparse.daemon")

LOCK_NAME = "hisparsed.lock"
# How long a thread running Python keeps the GIL while another waits for it (CPython's
# default is 5 ms). The loop waits that long for every request while a background thread
# (the cluster worker verifying a promotion, the allocator) runs Python, so it is kept
# well under a millisecond: the loop answers within one switch, at the cost of a few
# more thread switches. The door watch (daemon.door) needs it too: a connect flood uses up
# the descriptors' headroom in a few milliseconds.
GIL_SWITCH_S = 0.0005


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hisparsed", description="hisparse node daemon: shared host "
                                "memory and a shared prefix cache for KV pages")
    p.add_argument("--config", metavar="FILE.toml", help="TOML config (see systemd/hisparsed.toml)")
    p.add_argument("--socket", metavar="PATH", help="unix socket to listen on")
    p.add_argument("--capacity", metavar="SIZE", help="all regions together, e.g. 64GiB, 512MiB")
    p.add_argument("--shm-dir", metavar="DIR", help="where region files live (tmpfs or hugetlbfs)")
    p.add_argument("--meta-dir", metavar="DIR", help="where metadata tables and the lock live, a "
                   "directory only the daemon's user may write (default: meta/ beside the socket)")
    p.add_argument("--default-namespace-capacity", metavar="SIZE",
                   help="region size of a namespace neither the config nor its attach sizes")
    p.add_argument("--min-page-bytes", metavar="SIZE", help="refuse layouts with smaller pages (default 64)")
    p.add_argument("--max-namespaces", metavar="N", help="most namespaces at once (default 64)")
    p.add_argument("--session-pin-share", metavar="SHARE",
                   help="most of a namespace's pages one session may pin (default 0.5)")
    p.add_argument("--session-reserve-share", metavar="SHARE",
                   help="most of a namespace's pages one session may hold reserved (default 0.5)")
    p.add_argument("--peer-pin-share", metavar="SHARE", help="most of a namespace's pages every "
                   "session of one uid together may pin (default: the session share)")
    p.add_argument("--peer-reserve-share", metavar="SHARE", help="most of a namespace's pages every "
                   "session of one uid together may hold reserved (default: the session share)")
    p.add_argument("--peer-max-namespaces", metavar="N",
                   help="namespaces one uid may create that the config does not name (default 8)")
    caps = config_mod.Config()
    p.add_argument("--max-sessions", metavar="N", help=f"most sessions at once (default {caps.max_sessions})")
    p.add_argument("--max-sessions-per-connection", metavar="N", help="most sessions one connection "
                   f"may hold (default {caps.max_sessions_per_connection})")
    p.add_argument("--max-sessions-per-uid", metavar="N", help="most sessions of one peer, all its "
                   f"connections together (default {caps.max_sessions_per_uid})")
    p.add_argument("--max-connections", metavar="N", help=f"most connections at once (default {caps.max_connections})")
    p.add_argument("--max-connections-per-uid", metavar="N",
                   help=f"most connections of one peer (default {caps.max_connections_per_uid})")
    p.add_argument("--fd-headroom", metavar="N", help="descriptors of RLIMIT_NOFILE no session or "
                   f"connection may take (default {caps.fd_headroom}, or an eighth of the limit if more)")
    p.add_argument("--max-request-bytes-in-flight", metavar="SIZE", help="what connections sending "
                   "frames over 256 KiB may hold in the daemon at once (default "
                   f"{caps.max_request_bytes_in_flight >> 20}MiB)")
    p.add_argument("--lease-ttl", metavar="SECONDS", help="silence after which a session expires")
    p.add_argument("--log-level", metavar="LEVEL", help="DEBUG, INFO, WARNING, ERROR")
    p.add_argument("--admin-token-file", metavar="PATH", help="default: hisparsed.token beside the socket")
    p.add_argument("--metrics-address", metavar="PATH|HOST:PORT",
                   help="Prometheus endpoint: a unix socket path or HOST:PORT; \"\" turns it off "
                   "(default: hisparsed.metrics.sock beside the socket)")
    p.add_argument("--fresh", action="store_true", help="drop every region and table this daemon's meta dir names "
                   "(never another daemon's)")
    return p.parse_args(argv)


def _setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("hisparse")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


def _lock_state_dir(cfg: config_mod.Config) -> int:
    """One daemon per metadata directory: two would adopt the same pages.

    The lock file says who holds it (pid and socket), so the refusal of a
    second daemon names the first.
    """
    trust.private_dir(cfg.metadata_dir, "meta_dir")
    path = os.path.join(cfg.metadata_dir, LOCK_NAME)
    try:
        fd = trust.create_exclusive(path, 0o600)
    except FileExistsError:
        fd = trust.open_owned(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise HisparseError(f"another hisparsed ({holder}) holds {path}: stop it, or give this "
                            "one another --socket or --meta-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}, socket {cfg.socket}\n".encode(), 0)
    return fd


def _prepare_socket(path: str) -> None:
    directory = os.path.dirname(path)
    # Root may own it (/run/hisparsed made by systemd for the service user is
    # the user's, but a root-made parent is fine); nobody else may write it:
    # they could swap the socket for a fake daemon or read the admin token.
    trust.private_dir(directory, "socket directory", allow_root_owner=True)
    if os.path.lexists(path):
        if _answers(path):
            raise HisparseError(f"another hisparsed is serving on {path}")
        if not trust.unlink_own(path):
            raise trust.UnsafePath(f"{path} exists and is not hisparsed's: remove it or choose "
                                   "another --socket")


def _answers(path: str, timeout_s: float = 0.5) -> bool:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint_for(path))
        sock.send(protocol.encode_request(protocol.Op.PING, 1))
        return bool(sock.poll(int(timeout_s * 1000)))
    finally:
        sock.close(linger=0)


def _write_token(path: str) -> str:
    token = secrets.token_hex(32)
    trust.private_dir(os.path.dirname(path), "admin token directory", allow_root_owner=True)
    trust.write_private_file(path, token + "\n")
    return token


def _capacity_source(cfg: config_mod.Config) -> str:
    """Where the capacity in force was set, as the operator would change it."""
    if "capacity" in cfg.flag_values:
        return "--capacity"
    if "capacity" in cfg.env_values:
        return "HISPARSED_CAPACITY"
    if cfg.config_file and "capacity" in config_mod.load_file(cfg.config_file):
        return f"capacity in {cfg.config_file}"
    return "the default capacity (set capacity in a --config file, or --capacity)"


def _warn_free_shm(cfg: config_mod.Config, registry: Registry) -> None:
    try:
        st = os.statvfs(cfg.shm_dir)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    wanted = cfg.capacity_bytes - registry.allocated_bytes
    if wanted > free:
        source = _capacity_source(cfg)
        log.warning("%s (%s) leaves %s to allocate but %s has only %s free: namespaces will be "
                    "refused (CAPACITY) before the capacity is reached; lower %s or grow %s",
                    source, format_size(cfg.capacity_bytes), format_size(wanted), cfg.shm_dir,
                    format_size(free), source.split(" (")[0], cfg.shm_dir)


async def _announce_ready(endpoint: str, socket_path: str) -> None:
    """READY=1 once the bound socket answers a real ping through this loop."""
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        while True:
            await sock.send(protocol.encode_request(protocol.Op.PING, 0))
            if await sock.poll(1000):
                await sock.recv()
                break
    finally:
        sock.close(linger=0)
    notify.notify(f"READY=1\nSTATUS=serving on {socket_path}\nMAINPID={os.getpid()}")
    log.info("ready: serving on %s (export HISPARSE_SOCKET=%s)", socket_path, socket_path)


def _cluster_tier(cfg: config_mod.ClusterConfig):
    """The cluster tier (its worker starts with the loop); refuses to start without the wheel."""
    from hisparse.cluster import mooncake
    from hisparse.daemon.cluster.tier import ClusterTier

    try:
        mooncake.load()
    except mooncake.ClusterUnavailableError as exc:
        raise HisparseError(str(exc)) from None

    def backend() -> mooncake.MooncakeBackend:
        return mooncake.MooncakeBackend(
            local_hostname=cfg.local_hostname, metadata_server=cfg.metadata_server, master=cfg.master,
            protocol=cfg.protocol, rdma_devices=cfg.rdma_devices, segment_size_bytes=cfg.segment_size_bytes,
            buffer_size_bytes=cfg.buffer_size_bytes, replicas=cfg.replicas)
    return ClusterTier(cfg, backend)


def run(cfg: config_mod.Config) -> int:
    sys.setswitchinterval(GIL_SWITCH_S)
    fd_limit = raise_fd_limit()  # sessions and connections are counted against it (daemon.limits)
    log.info("RLIMIT_NOFILE %d; %d kept free (fd_headroom)", fd_limit, cfg.fd_headroom)
    # First the socket's directory: meta/, fences/ and the token go beside it.
    trust.private_dir(os.path.dirname(cfg.socket), "socket directory", allow_root_owner=True)
    lock_fd = _lock_state_dir(cfg)
    os.makedirs(cfg.shm_dir, exist_ok=True)
    trust.shared_dir(cfg.shm_dir, "shm_dir")
    regions = regiondir.open_region_dir(cfg.shm_dir, cfg.metadata_dir)
    registry = Registry(cfg, regions.path)
    adoption.adopt_all(registry)
    regiondir.reclaim_orphans(cfg.shm_dir, cfg.metadata_dir, regions)
    _warn_free_shm(cfg, registry)
    _prepare_socket(cfg.socket)
    access = AccessControl(cfg)
    access.prepare()
    registry.gid_for = access.gid_for
    for name, ns in registry.namespaces.items():  # adopted: the config may have changed the group
        give_to_group(ns.region_path, access.gid_for(name))
    fence_dir = fence_dir_for(cfg.socket)
    os.makedirs(fence_dir, mode=FENCE_DIR_MODE, exist_ok=True)
    trust.private_dir(fence_dir, "fence directory (fences/ beside the socket)", create=False)
    os.chmod(fence_dir, FENCE_DIR_MODE)  # an earlier run's 0750 let the group list the names
    sessions = SessionTable(cfg.lease_ttl_s)
    ctx = DaemonContext(cfg, registry, sessions, admin_token="", fence_dir=fence_dir, access=access)
    # Sessions of the earlier run are gone, but their processes may still be
    # copying: their pages stay fenced until each process lets go. The sweep
    # runs while the socket serves; what takes pages waits for it.
    ctx.fence_sweep = FenceSweep(sessions, fence_dir, registry)
    ctx.fence_sweep.sweep_for(BEFORE_BIND_S)
    if ctx.fence_sweep.paths:
        log.info("%d fences of the earlier run left to sweep (served meanwhile)", len(ctx.fence_sweep.paths))
    if cfg.cluster.enabled:
        ctx.cluster = _cluster_tier(cfg.cluster)
        from hisparse.daemon.cluster import drop as cluster_drop

        registry.on_drop = functools.partial(cluster_drop.dropped, ctx.cluster)
    endpoint = endpoint_for(cfg.socket)
    server = Server(ctx, endpoint)
    server.bind()
    os.chmod(cfg.socket, 0o660)
    ctx.admin_token = _write_token(cfg.token_path)
    reason = "unknown"
    try:
        try:
            import uvloop

            runner = uvloop.run
        except ImportError:  # pragma: no cover - uvloop is a dependency
            runner = asyncio.run
        reason = runner(server.serve(lambda: _announce_ready(endpoint, cfg.socket)))
    finally:
        notify.notify("STOPPING=1")
        if ctx.cluster is not None:
            ctx.cluster.stop()
        # Clients may be mid-copy: their fences stay, and the next daemon fences their pages.
        ctx.sessions.detach_all()
        registry.close()
        registry.flush()
        server.close()
        for path in (cfg.socket, cfg.token_path):
            trust.unlink_own(path)
        for name in access.keys:
            trust.unlink_own(access_key_path(cfg.socket, name))
        # The meta dir's and region dir's locks (lock_fd, regions) go with the process, not before:
        # a cluster get still in flight may write its pages until then, and a successor adopts
        # (and frees WRITING pages) only once nothing here can write one.
        log.info("stopped (%s): %d namespaces flushed", reason, len(registry.namespaces))
    return 0


def main(argv: list[str] | None = None) -> int:
    return pipes.run_main(_main, argv)


def flags_of(args: argparse.Namespace) -> dict[str, str | None]:
    """The config keys the flags set (None: not given): ``--dashed-name`` is the key ``dashed_name``."""
    return {key: getattr(args, key) for key in config_mod.flag_keys()}


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    try:
        cfg = config_mod.build(args.config, flags=flags_of(args), fresh=args.fresh)
    except HisparseError as exc:
        print(f"hisparsed: {exc}", file=sys.stderr)
        return 2
    _setup_logging(cfg.log_level)
    log.info("starting hisparsed pid %d: %s", os.getpid(), cfg.summary())
    started = time.monotonic()
    try:
        return run(cfg)
    except HisparseError as exc:
        log.error("cannot start: %s", exc)
        return 1
    except OSError as exc:  # an unwritable directory, a lock file of another user, ...
        log.error("cannot start: %s: %s", exc.filename or "", exc.strerror or exc)
        return 1
    finally:
        log.debug("ran for %.1fs", time.monotonic() - started)


if __name__ == "__main__":
    sys.exit(main())
