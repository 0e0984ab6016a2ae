"""Helpers shared by the benchmark programs: a private daemon, the daemon's request path
in-process, and percentiles."""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from hisparse import KVLayout
from hisparse.local import shm_base, start_daemon

PEER = b"bench"  # the peer identity of in-process requests


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


@contextmanager
def running_daemon(capacity: str = "1GiB", *extra: str) -> Iterator[str]:
    """A real hisparsed on a temporary socket; yields the socket path."""
    with start_daemon(capacity, extra=extra) as daemon:
        yield daemon.socket


async def call(ctx: Any, op: Any, **fields: Any) -> dict:
    """One request through the daemon's own ``dispatch``; work it hands off the loop is awaited."""
    from hisparse import protocol
    from hisparse.daemon.front.dispatch import dispatch, finish

    reply = dispatch(ctx, protocol.encode_request(op, 1, **fields), PEER)
    if isinstance(reply, tuple):  # work off the loop (hello creating a region)
        rid, deferred = reply
        await asyncio.wait([deferred.future])
        reply = finish(ctx, rid, deferred, deferred.future)
    return protocol.decode_reply(reply).result()


@asynccontextmanager
async def committed_keys_in_process(namespace: str, layout: KVLayout, client: str, num_keys: int,
                                    **flags: Any) -> AsyncIterator[tuple[Any, bytes]]:
    """The daemon's request path in this process, no socket: a real ``DaemonContext`` (config
    ``flags`` over a 512 MiB capacity, a region in shared memory, a session holding its fence,
    ``num_keys`` committed keys). Yields the context and a lookup frame of those keys."""
    from hisparse import protocol
    from hisparse.daemon.conf import config
    from hisparse.daemon.ops.handlers import DaemonContext
    from hisparse.daemon.store.namespaces import Registry
    from hisparse.daemon.store.sessions import SessionTable
    from hisparse.protocol import Op
    from hisparse.shm.fence import fence_dir_for

    run_dir = tempfile.mkdtemp(prefix="hisparse-bench-")
    shm_dir = tempfile.mkdtemp(prefix="hisparse-bench-", dir=shm_base())
    fence_fd = -1
    try:
        cfg = config.build(env={}, flags={"socket": os.path.join(run_dir, "hisparsed.sock"),
                                          "shm_dir": shm_dir, "capacity": "512MiB", "metrics_address": "",
                                          **flags})
        os.makedirs(cfg.metadata_dir, exist_ok=True)
        ctx = DaemonContext(cfg, Registry(cfg), SessionTable(cfg.lease_ttl_s), admin_token="x")
        hello = await call(ctx, Op.HELLO, namespace=namespace, layout=layout, capacity_bytes=256 << 20,
                           client=client)
        fence_fd = os.open(os.path.join(fence_dir_for(cfg.socket), hello["fence"]), os.O_RDONLY)
        fcntl.flock(fence_fd, fcntl.LOCK_SH)  # reserve needs the session's fence held
        keys = [os.urandom(36) for _ in range(num_keys)]
        session = hello["session"]
        await call(ctx, Op.RESERVE, session=session, keys=keys)
        await call(ctx, Op.COMMIT, session=session, keys=keys)
        yield ctx, protocol.encode_request(Op.LOOKUP, 7, session=session, keys=keys)
        ctx.registry.flush()
    finally:
        if fence_fd >= 0:
            os.close(fence_fd)
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
