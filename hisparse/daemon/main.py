"""``hisparsed``: the node daemon's entry point.

Start-up order: config -> lock the metadata directory -> adopt (or, with
``--fresh``, remove) regions an earlier run left -> bind the socket ->
write the admin token -> serve. READY=1 goes to systemd only once a real
ping over the bound socket has been answered by the running loop.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import logging
import os
import secrets
import sys
import time

import zmq
import zmq.asyncio

from hisparse import protocol
from hisparse.daemon import config as config_mod
from hisparse.daemon import notify
from hisparse.daemon.handlers import DaemonContext
from hisparse.daemon.namespaces import Registry
from hisparse.daemon.server import Server, endpoint_for
from hisparse.daemon.sessions import SessionTable
from hisparse.errors import HisparseError
from hisparse.shm.fence import FENCE_DIR_MODE, fence_dir_for

log = logging.getLogger("hisparse.daemon")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hisparsed", description="hisparse node daemon: shared host "
                                "memory and a shared prefix cache for KV pages")
    p.add_argument("--config", metavar="FILE.toml", help="TOML config (see systemd/hisparsed.toml)")
    p.add_argument("--socket", metavar="PATH", help="unix socket to listen on")
    p.add_argument("--capacity", metavar="SIZE", help="all regions together, e.g. 64GiB, 512MiB")
    p.add_argument("--shm-dir", metavar="DIR", help="where region files live (tmpfs or hugetlbfs)")
    p.add_argument("--meta-dir", metavar="DIR", help="where metadata tables live (default: shm dir)")
    p.add_argument("--default-namespace-capacity", metavar="SIZE",
                   help="region size of a namespace neither the config nor its attach sizes")
    p.add_argument("--lease-ttl", metavar="SECONDS", help="silence after which a session expires")
    p.add_argument("--log-level", metavar="LEVEL", help="DEBUG, INFO, WARNING, ERROR")
    p.add_argument("--admin-token-file", metavar="PATH", help="default: hisparsed.token beside the socket")
    p.add_argument("--fresh", action="store_true", help="drop every region an earlier run left")
    return p.parse_args(argv)


def _setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("hisparse")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


def _lock_state_dir(cfg: config_mod.Config) -> int:
    """One daemon per metadata directory: two would adopt the same pages."""
    os.makedirs(cfg.metadata_dir, exist_ok=True)
    fd = os.open(os.path.join(cfg.metadata_dir, "hisparsed.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise HisparseError(f"another hisparsed holds {cfg.metadata_dir}/hisparsed.lock") from None
    return fd


def _prepare_socket(path: str) -> None:
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        os.makedirs(directory, mode=0o755, exist_ok=True)
    if os.path.exists(path):
        if _answers(path):
            raise HisparseError(f"another hisparsed is serving on {path}")
        os.unlink(path)  # left by a daemon that died


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
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(token + "\n")
    os.replace(tmp, path)
    return token


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
    from hisparse.daemon.cluster import ClusterTier

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
    lock_fd = _lock_state_dir(cfg)
    os.makedirs(cfg.shm_dir, exist_ok=True)
    registry = Registry(cfg)
    registry.adopt_all()
    _prepare_socket(cfg.socket)
    fence_dir = fence_dir_for(cfg.socket)
    os.makedirs(fence_dir, mode=FENCE_DIR_MODE, exist_ok=True)
    sessions = SessionTable(cfg.lease_ttl_s)
    # Sessions of the earlier run are gone, but their processes may still be
    # copying: their pages stay fenced until each process lets go.
    adopted, removed = sessions.adopt_fences(fence_dir, registry)
    if adopted or removed:
        log.info("fences of the earlier run: %d still held (their pages stay fenced), %d released",
                 adopted, removed)
    ctx = DaemonContext(cfg, registry, sessions, admin_token="", fence_dir=fence_dir)
    if cfg.cluster.enabled:
        ctx.cluster = _cluster_tier(cfg.cluster)
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
        registry.flush()
        server.close()
        for path in (cfg.socket, cfg.token_path):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        os.close(lock_fd)
        log.info("stopped (%s): %d namespaces flushed", reason, len(registry.namespaces))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    flags = {"socket": args.socket, "capacity": args.capacity, "shm_dir": args.shm_dir,
             "meta_dir": args.meta_dir, "lease_ttl": args.lease_ttl, "log_level": args.log_level,
             "default_namespace_capacity": args.default_namespace_capacity,
             "admin_token_file": args.admin_token_file}
    try:
        cfg = config_mod.build(args.config, flags=flags, fresh=args.fresh)
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
