"""publish_largest: what the daemon's loop spends on the largest requests, in-process.

The daemon's own request path (``server.dispatch``: decode, validate, the
handler, encode) runs in this process on a real context (a region of
64-byte pages in shared memory, a session holding its fence): a reserve of
16,384 keys of mixed lengths, then their publish under 16,384 other keys,
every other turn with ``pin``. The baseline, in the same run, is
``protocol.decode_request`` of the same frames: what is left above it is
the handler's per-key work, all of it on the loop.

    python benchmarks/publish_largest.py [--turns N]
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import os
import random
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import call  # noqa: E402
from hisparse import KVLayout, protocol  # noqa: E402
from hisparse.daemon import config  # noqa: E402
from hisparse.daemon.handlers import DaemonContext  # noqa: E402
from hisparse.daemon.namespaces import Registry  # noqa: E402
from hisparse.daemon.dispatch import dispatch  # noqa: E402
from hisparse.daemon.sessions import SessionTable  # noqa: E402
from hisparse.local import shm_base  # noqa: E402
from hisparse.protocol import Op  # noqa: E402
from hisparse.shm.fence import fence_dir_for  # noqa: E402

N = protocol.MAX_KEYS_PER_REQUEST
LAYOUT = KVLayout(1, 1, 64)  # 64-byte pages: 4 x 16,384 of them in 4 MiB


def timed_ms(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return 1e3 * (time.perf_counter() - t0), out


async def measure(turns: int) -> None:
    run_dir = tempfile.mkdtemp(prefix="hisparse-bench-")
    shm_dir = tempfile.mkdtemp(prefix="hisparse-bench-", dir=shm_base())
    try:
        cfg = config.build(env={}, flags={"socket": os.path.join(run_dir, "hisparsed.sock"), "shm_dir": shm_dir,
                                          "capacity": "64MiB", "metrics_address": "",
                                          "session_reserve_share": "1", "session_pin_share": "1"})
        os.makedirs(cfg.metadata_dir, exist_ok=True)
        ctx = DaemonContext(cfg, Registry(cfg), SessionTable(cfg.lease_ttl_s), admin_token="x")
        hello = await call(ctx, Op.HELLO, namespace="bench/publish", layout=LAYOUT,
                           capacity_bytes=LAYOUT.page_bytes * N * 4, client="benchmarks/publish_largest")
        fence_fd = os.open(os.path.join(fence_dir_for(cfg.socket), hello["fence"]), os.O_RDONLY)
        fcntl.flock(fence_fd, fcntl.LOCK_SH)  # reserve needs the session's fence held
        session, rng = hello["session"], random.Random(20)
        print(f"{'turn':<6}{'reserve ms':>11}{'decode ms':>10}{'publish ms':>11}{'decode ms':>10}  pin")
        for turn in range(turns):
            keys = [rng.randbytes(rng.randint(4, protocol.MAX_KEY_BYTES)) for _ in range(N)]
            as_keys = [rng.randbytes(rng.randint(4, protocol.MAX_KEY_BYTES)) for _ in range(N)]
            pin = turn % 2 == 1
            reserve = protocol.encode_request(Op.RESERVE, 1, session=session, keys=keys)
            publish = protocol.encode_request(Op.PUBLISH, 2, session=session, keys=keys, as_keys=as_keys, pin=pin)
            reserve_ms, _ = timed_ms(lambda: dispatch(ctx, reserve, b"bench"))
            publish_ms, reply = timed_ms(lambda: dispatch(ctx, publish, b"bench"))
            pages = protocol.decode_reply(reply).result()["pages"]  # type: ignore[arg-type]
            assert sum(p >= 0 for p in pages) == N, "every key published"
            decode_reserve_ms, _ = timed_ms(lambda: protocol.decode_request(reserve))
            decode_publish_ms, _ = timed_ms(lambda: protocol.decode_request(publish))
            print(f"{turn:<6}{reserve_ms:>11.1f}{decode_reserve_ms:>10.1f}{publish_ms:>11.1f}"
                  f"{decode_publish_ms:>10.1f}  {pin}  (publish/decode {publish_ms / decode_publish_ms:.0f}x)")
            if pin:
                await call(ctx, Op.UNPIN, session=session, pages=pages)
        os.close(fence_fd)
        ctx.registry.flush()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=4, help="reserve + publish turns (odd ones pin)")
    asyncio.run(measure(ap.parse_args(argv).turns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
