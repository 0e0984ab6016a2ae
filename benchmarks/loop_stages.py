"""loop_stages: what each stage of a 64-key lookup costs in the live daemon's loop, vs warm.

The real hisparsed runs in a process of its own, with a timer around each
stage of its request path (installed before it starts): reading a request
(``ConnectionGuard.recv``), the fair queue (``put`` and ``round``),
``dispatch`` and, inside it, decoding, the index lookup and encoding the
reply, and the send (``Outbox.send``); ``loop`` is the reader callback
whole. A raw DEALER keeps 1, then 8, requests in flight.

The baseline, measured in this process in the same run, is the same code
warm: each stage called back to back on a real daemon context (and a
ROUTER's reads and sends over ``ipc://`` with the requests already queued).
The ratio live/warm is what serving one request among others' work costs
over the code's own cost: caches emptied by the client and libzmq's thread
between requests, and the wake-ups. Each timer adds about 0.2 us, nested
ones to their parent too.

    python benchmarks/loop_stages.py [--requests N] [--inflight 1,8]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter

import zmq
import zmq.backend

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import PEER, committed_keys_in_process  # noqa: E402
from benchmarks.rpc import KEYS, call, pipelined  # noqa: E402
from hisparse import KVLayout, protocol  # noqa: E402
from hisparse.client.fence import Fence  # noqa: E402
from hisparse.local import shm_base  # noqa: E402
from hisparse.protocol import Op  # noqa: E402
from hisparse.shm.fence import fence_dir_for  # noqa: E402

STAGES = ("read", "queue", "decode", "lookup", "encode", "dispatch", "send", "loop")
LAYOUT = KVLayout(8, 64, 128)  # small pages: a lookup costs the same at any page size


def _timed(owner, name: str, stage: str, spent: Counter, inside: Counter) -> None:
    real = getattr(owner, name)
    now = time.perf_counter_ns

    def timed(*args, **kwargs):
        inside[stage] += 1
        started = now()
        try:
            return real(*args, **kwargs)
        finally:
            spent[stage] += now() - started
            inside[stage] -= 1

    setattr(owner, name, timed)


def daemon_process(argv: list[str], control) -> None:
    """hisparsed's own ``main`` with a timer on each stage; ``control`` resets and reports."""
    import hisparse.protocol as wire
    from hisparse.daemon.front import connections
    from hisparse.daemon.front import fairness
    from hisparse.daemon.store import index
    from hisparse.daemon import main
    from hisparse.daemon.front import outbox
    from hisparse.daemon.front import server

    spent: Counter = Counter()
    inside: Counter = Counter()  # calls begun and not yet ended, by stage
    for owner, name, stage in ((connections.ConnectionGuard, "recv", "read"),
                               (fairness.FairQueue, "put", "queue"), (fairness.FairQueue, "round", "queue"),
                               (wire, "decode_request", "decode"), (index.NamespaceIndex, "lookup", "lookup"),
                               (wire, "encode_ok", "encode"), (server, "dispatch", "dispatch"),
                               (outbox.Outbox, "send", "send"), (server.Server, "_on_readable", "loop")):
        _timed(owner, name, stage, spent, inside)

    def answer() -> None:
        while True:
            command = control.recv()
            deadline = time.monotonic() + 5.0
            while inside["loop"] and time.monotonic() < deadline:
                time.sleep(0.001)  # the reader callback that sent the last reply is still ending
            if command == "reset":
                spent.clear()
            control.send(dict(spent))

    threading.Thread(target=answer, daemon=True).start()
    sys.exit(main.main(argv))


def warm_stages(n: int) -> dict[str, float]:
    """Microseconds per call of each stage, back to back in this process."""
    from hisparse.daemon.front.dispatch import dispatch
    from hisparse.daemon.ops.handlers import ns_of

    def per_call(fn, reps: int = n) -> float:
        for _ in range(min(reps, 1000)):
            fn()
        started = time.perf_counter_ns()
        for _ in range(reps):
            fn()
        return (time.perf_counter_ns() - started) / reps / 1e3

    async def in_process() -> dict[str, float]:
        async with committed_keys_in_process("bench/stages", LAYOUT, "loop_stages", KEYS) as (ctx, frame):
            req = protocol.decode_request(frame)
            index = ns_of(ctx.sessions.get(req.session, PEER)).index
            return {"decode": per_call(lambda: protocol.decode_request(frame)),
                    "lookup": per_call(lambda: index.lookup(req.keys)),
                    "encode": per_call(lambda: protocol.encode_ok(7, {"count": KEYS})),
                    "dispatch": per_call(lambda: dispatch(ctx, frame, PEER))}

    out = asyncio.run(in_process())
    out.update(_warm_socket(n))
    return out


def _warm_socket(n: int) -> dict[str, float]:
    """A ROUTER's read of a queued request and send of its reply, back to back over ipc://."""
    context = zmq.Context()
    where = tempfile.mkdtemp()
    router, dealer = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    router.bind(f"ipc://{where}/warm.sock")
    dealer.connect(f"ipc://{where}/warm.sock")
    frame = protocol.encode_request(Op.LOOKUP, 7, session=1, keys=[os.urandom(36) for _ in range(KEYS)])
    reply = protocol.encode_ok(7, {"count": KEYS})
    recv, send = zmq.backend.Socket.recv.__get__(router), zmq.backend.Socket.send.__get__(router)
    more, last = int(zmq.SNDMORE | zmq.NOBLOCK), int(zmq.NOBLOCK)
    read_ns = send_ns = 0
    for _ in range(max(1, n // 500)):
        for _ in range(500):
            dealer.send(frame)
        time.sleep(0.05)  # libzmq's thread has queued them all (RCVHWM 1000): reads never wait
        started = time.perf_counter_ns()
        got = [(recv(), recv()) for _ in range(500)]
        read_ns += time.perf_counter_ns() - started
        started = time.perf_counter_ns()
        for identity, _ in got:
            send(identity, more)
            send(reply, last)
        send_ns += time.perf_counter_ns() - started
        for _ in range(500):
            dealer.recv()
    count = max(1, n // 500) * 500
    router.close(0)
    dealer.close(0)
    context.term()
    shutil.rmtree(where, ignore_errors=True)
    return {"read": read_ns / count / 1e3, "send": send_ns / count / 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20_000, help="lookups per depth")
    ap.add_argument("--inflight", default="1,8", help="requests in flight, comma-separated")
    args = ap.parse_args(argv)
    run_dir, shm_dir = tempfile.mkdtemp(prefix="hisparse-"), tempfile.mkdtemp(prefix="hisparse-", dir=shm_base())
    path = os.path.join(run_dir, "hisparsed.sock")
    spawn = mp.get_context("spawn")
    ours, theirs = spawn.Pipe()
    daemon = spawn.Process(target=daemon_process, args=(
        ["--socket", path, "--shm-dir", shm_dir, "--capacity", "512MiB", "--log-level", "WARNING"],
        theirs))
    daemon.start()
    live: dict[int, dict[str, float]] = {}
    try:
        from hisparse.client.transport import wait_for_daemon

        wait_for_daemon(path, 30.0)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect("ipc://" + path)
        keys = [os.urandom(36) for _ in range(KEYS)]
        hello = call(sock, Op.HELLO, namespace="bench/stages", layout=LAYOUT, capacity_bytes=256 << 20,
                     client="benchmarks/loop_stages")
        fence = Fence(os.path.join(fence_dir_for(path), hello["fence"]))  # reserve needs it held
        call(sock, Op.RESERVE, session=hello["session"], keys=keys)
        call(sock, Op.COMMIT, session=hello["session"], keys=keys)
        frame = protocol.encode_request(Op.LOOKUP, 7, session=hello["session"], keys=keys)
        for depth in [int(d) for d in args.inflight.split(",")]:
            pipelined(sock, frame, 2000, depth)  # warm up
            ours.send("reset")
            ours.recv()
            got, _ = pipelined(sock, frame, args.requests, depth)
            ours.send("report")
            live[depth] = {stage: ns / len(got) / 1e3 for stage, ns in ours.recv().items()}
        sock.close(linger=0)
        fence.retire()
    finally:
        daemon.terminate()
        daemon.join(15)
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
    warm = warm_stages(args.requests)

    print(f"64-key lookup, {args.requests} per depth, one connection, raw DEALER; us per request, "
          f"inclusive (dispatch holds decode, lookup and encode; loop holds all); "
          f"load average {os.getloadavg()[0]:.1f}")
    depths = list(live)
    print(f"{'stage':10}{'warm':>8}" + "".join(f"{f'{d} in flight':>14}{'ratio':>7}" for d in depths))
    for stage in STAGES:
        row = f"{stage:10}{warm[stage]:8.2f}" if stage in warm else f"{stage:10}{'':>8}"
        for d in depths:
            value = live[d].get(stage, 0.0)
            row += f"{value:14.2f}" + (f"{value / warm[stage]:7.2f}" if stage in warm else f"{'':>7}")
        print(row)
    for d in depths:
        stages = live[d]
        own = stages.get("loop", 0.0) - sum(stages.get(s, 0.0) for s in ("read", "queue", "dispatch", "send"))
        print(f"{d} in flight: the loop's own work (wake-up, checks, turns) {own:.2f} us of "
              f"{stages.get('loop', 0.0):.2f}; dispatch live/warm {stages['dispatch'] / warm['dispatch']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
