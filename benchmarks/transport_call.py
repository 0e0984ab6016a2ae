"""transport_call: ``Transport.call(ping)`` against a real hisparsed, and a bare DEALER beside it.

One caller, then ``--threads`` callers sharing the transport; alternating
turns with the bare DEALER (one caller) so both see the same machine noise.
The difference of the single-caller p50s is what the client's transport
adds to each call; the client process's CPU time per call (all its
threads) is its cost with less of the machine's noise in it.

    python benchmarks/transport_call.py [--calls N] [--threads 8]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import percentile, running_daemon  # noqa: E402
from hisparse import protocol  # noqa: E402
from hisparse.client.transport import Transport  # noqa: E402
from hisparse.protocol import Op  # noqa: E402


def bare_pings(sock: zmq.Socket, n: int) -> list[float]:
    out, clock = [], time.perf_counter
    for i in range(n):
        t0 = clock()
        sock.send(protocol.encode_request(Op.PING, i))
        protocol.decode_reply(sock.recv()).result()
        out.append(clock() - t0)
    return out


def transport_pings(transport: Transport, n: int) -> list[float]:
    out, clock, call = [], time.perf_counter, transport.call
    for _ in range(n):
        t0 = clock()
        call(Op.PING, 10.0)
        out.append(clock() - t0)
    return out


def threaded(transport: Transport, n: int, threads: int) -> tuple[list[float], float]:
    results: list[list[float]] = [[] for _ in range(threads)]
    workers = [threading.Thread(target=lambda i=i: results[i].extend(
        transport_pings(transport, n // threads))) for i in range(threads)]
    started = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return [x for r in results for x in r], time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--threads", type=int, default=8)
    args = ap.parse_args(argv)
    with running_daemon("64MiB") as path:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect("ipc://" + path)
        transport = Transport(path)
        bare_pings(sock, 500)
        transport_pings(transport, 500)  # warm up
        bare: list[float] = []
        single: list[float] = []
        many: list[float] = []
        busy = 0.0
        cpu = [0.0, 0.0, 0.0]
        while len(single) < args.calls:
            for i, run in enumerate((lambda: bare_pings(sock, 200), lambda: transport_pings(transport, 200))):
                c0 = time.process_time()
                (bare if i == 0 else single).extend(run())
                cpu[i] += time.process_time() - c0
            c0 = time.process_time()
            got, spent = threaded(transport, 400, args.threads)
            cpu[2] += time.process_time() - c0
            many += got
            busy += spent
        transport.close()
        sock.close(linger=0)
    print(f"ping, {args.calls} calls each; load average {os.getloadavg()[0]:.1f}")
    for i, (name, s) in enumerate((("bare DEALER", bare), ("Transport, 1 thread", single),
                                   (f"Transport, {args.threads} threads", many))):
        print(f"{name:24} p50 {percentile(s, 50) * 1e6:7.1f} us  p99 {percentile(s, 99) * 1e6:7.1f} us"
              f"  client CPU {cpu[i] / len(s) * 1e6:6.1f} us/call")
    print(f"Transport adds {(percentile(single, 50) - percentile(bare, 50)) * 1e6:.1f} us at p50; "
          f"{args.threads} threads: {len(many) / busy:.0f} calls/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
