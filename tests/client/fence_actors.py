"""Processes that stall at the worst moment: ``python -m tests.client.fence_actors ROLE ...``.

Each role attaches with ``hisparse.client.attach``, prints JSON lines as it
goes (``{"at": ...}``), and may stop itself with SIGSTOP at a chosen point,
so a test can let its lease run out, restart the daemon, or let others churn
the region before it sends SIGCONT. Page bytes are ``page_for(key)``, so every
process checks every page without the bytes being passed around.

Roles:
- ``stall-writer``: store keys; the copy stops itself halfway (after half the
  pages of a run are written) and resumes on SIGCONT.
- ``stall-reader``: pin keys, stop, then on SIGCONT report what the pin says
  and what the pinned pages hold.
- ``soak-writer`` / ``soak-reader`` / ``soak-churn``: loops for the soak test,
  each reporting every wrong page it ever saw; they run until ``--until`` exists.
- ``soak-threads``: two threads of one client store and load the same chains
  at once, with a short ``--timeout`` that daemon stalls run past.
- ``soak-forker``: pins a chain, forks a child that reads the pinned pages
  under a hold of its own and exits with the number of wrong pages.
- ``pin-owner``: pin keys, report the session's fence file, wait to be killed.
- ``fork-holder``: a worker that holds ``--fence`` (``hisparse.client.fence.hold``)
  and forks a child that holds it too and exits (``--variant after``: forked
  between two holds; ``during``: forked while a thread is inside ``hold``).
  It reports ``holding`` while a hold that must still count is in place, and
  lets go when a line arrives on stdin.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import numpy as np

from hisparse import client
from hisparse.client.backends import cpu
from hisparse.errors import HisparseError, LeaseExpired
from tests.client.engine import actor_parser, bad_pages, chain, page_for, pages_for


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def stop_self(at: str) -> None:
    emit(at=at)
    os.kill(os.getpid(), signal.SIGSTOP)  # a GC pause, swap, a debugger: not dead


def _stall_in_copies() -> None:
    """The first scatter copies half its pages, stops this process, then copies the rest."""
    real = cpu.CpuBackend.scatter
    state = {"stalled": False}

    def scatter(self, region, page_ids, pages, rows):
        if state["stalled"] or len(page_ids) < 2:
            return real(self, region, page_ids, pages, rows)
        state["stalled"] = True
        half = len(page_ids) // 2
        real(self, region, page_ids[:half], pages, rows[:half])
        stop_self("stalled-mid-copy")
        real(self, region, page_ids[half:], pages, rows[half:])

    cpu.CpuBackend.scatter = scatter  # type: ignore[method-assign]


def stall_writer(c: client.Client, args: argparse.Namespace) -> None:
    keys = chain(args.seed, args.count)
    _stall_in_copies()
    try:
        written = c.store(keys, pages_for(keys, c.layout.page_bytes))
    except HisparseError as exc:
        emit(at="done", error=type(exc).__name__)
        return
    out = np.zeros((len(keys), c.layout.page_bytes), dtype=np.uint8)
    loaded = c.load(keys, out)
    emit(at="done", written=written, loaded=loaded, bad=bad_pages(keys[:loaded], out, c.layout.page_bytes))


def stall_reader(c: client.Client, args: argparse.Namespace) -> None:
    keys = chain(args.seed, args.count)
    pin = c.pin(keys)
    pages = pin.page_ids.tolist()
    view_ok = [bool(np.array_equal(pin.view(i).numpy().reshape(-1), page_for(k, c.layout.page_bytes)))
               for i, k in enumerate(keys[:pin.count])]
    emit(at="pinned", count=pin.count, pages=pages, view_ok=view_ok)
    stop_self("stalled-holding-pin")
    held = pin.held
    try:
        pin.view(0)
        view_error = None
    except LeaseExpired as exc:
        view_error = type(exc).__name__
    # What the pinned pages hold now, read straight from the region (still fenced: ours).
    raw = pin._session.region.pages_view()
    intact = [bool(np.array_equal(raw[:, p, :].reshape(-1), page_for(k, c.layout.page_bytes)))
              for p, k in zip(pages, keys)]
    pin.release()
    emit(at="resumed", held=held, view_error=view_error, intact=intact)


def _until(args: argparse.Namespace) -> bool:
    return os.path.exists(args.until)


def soak_writer(c: client.Client, args: argparse.Namespace) -> None:
    n, bad, rounds, errors = args.count, 0, 0, 0
    while not _until(args):
        keys = chain(f"{args.seed}/{rounds % args.chains}", n)
        try:
            c.store(keys, pages_for(keys, c.layout.page_bytes))
            out = np.zeros((n, c.layout.page_bytes), dtype=np.uint8)
            m = c.load(keys, out)
            bad += len(bad_pages(keys[:m], out, c.layout.page_bytes))
        except HisparseError:
            errors += 1  # the daemon restarting: typed errors are fine, wrong bytes are not
        rounds += 1
    emit(at="done", rounds=rounds, bad=bad, errors=errors)


def soak_reader(c: client.Client, args: argparse.Namespace) -> None:
    bad, reads, errors, r = 0, 0, 0, 0  # r: pins taken
    rng = np.random.default_rng(os.getpid())
    while not _until(args):
        keys = chain(f"{args.seed}/{int(rng.integers(0, args.chains))}", args.count)
        r += 1
        try:
            with c.pin(keys) as pin:
                for i in range(pin.count):
                    if not pin.held:  # lost while stalled: never read through it
                        break
                    got = pin.view(i).numpy().reshape(-1)
                    if not pin.held:  # lost during the read: discard, as the contract says
                        break
                    reads += 1
                    if not np.array_equal(got, page_for(keys[i], c.layout.page_bytes)):
                        bad += 1
        except LeaseExpired:
            pass
        except HisparseError:
            errors += 1
        time.sleep(0.001)
    emit(at="done", pins=r, reads=reads, bad=bad, errors=errors)


def soak_churn(c: client.Client, args: argparse.Namespace) -> None:
    rounds, bad, errors = 0, 0, 0
    while not _until(args):
        keys = chain(f"churn/{os.getpid()}/{rounds}", args.count)
        try:
            c.store(keys, pages_for(keys, c.layout.page_bytes))
            out = np.zeros((len(keys), c.layout.page_bytes), dtype=np.uint8)
            m = c.load(keys, out)
            bad += len(bad_pages(keys[:m], out, c.layout.page_bytes))
        except HisparseError:
            errors += 1
        rounds += 1
    emit(at="done", rounds=rounds, bad=bad, errors=errors)


def soak_threads(c: client.Client, args: argparse.Namespace) -> None:
    import threading

    pb = c.layout.page_bytes
    totals = {"rounds": 0, "bad": 0, "errors": 0}
    lock = threading.Lock()

    def loop(t: int) -> None:
        rng = np.random.default_rng(os.getpid() * 2 + t)
        while not _until(args):
            keys = chain(f"{args.seed}/threads/{int(rng.integers(0, 4))}", args.count)
            try:
                c.store(keys, pages_for(keys, pb))  # the other thread may store the same keys
                out = np.zeros((len(keys), pb), dtype=np.uint8)
                m = c.load(keys, out)
                bad = len(bad_pages(keys[:m], out, pb))
                with lock:
                    totals["rounds"] += 1
                    totals["bad"] += bad
            except HisparseError:
                with lock:
                    totals["errors"] += 1  # timeouts while the daemon is stopped
                time.sleep(0.01)

    threads = [threading.Thread(target=loop, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    emit(at="done", **totals)


def soak_forker(c: client.Client, args: argparse.Namespace) -> None:
    from hisparse.client.fence import hold

    pb = c.layout.page_bytes
    forks, bad, errors = 0, 0, 0
    while not _until(args):
        keys = chain(f"{args.seed}/fork/{forks % 4}", args.count)
        try:
            c.store(keys, pages_for(keys, pb))
            with c.pin(keys) as pin:
                session, pages = pin._session, pin.page_ids.tolist()
                child = os.fork()
                if child == 0:  # reads the pinned pages under a hold of its own
                    wrong = 0
                    try:
                        with hold(session.fence_path, "soak read"):
                            view = session.region.pages_view()
                            wrong = sum(not np.array_equal(view[:, p, :].reshape(-1), page_for(k, pb))
                                        for p, k in zip(pages, keys))
                    except LeaseExpired:
                        pass  # the session was lost: nothing read
                    except BaseException:
                        wrong = 100
                    os._exit(min(wrong, 100))
                _, status = os.waitpid(child, 0)
                forks += 1
                bad += os.waitstatus_to_exitcode(status)
        except HisparseError:
            errors += 1
    emit(at="done", forks=forks, bad=bad, errors=errors)


def pin_owner(c: client.Client, args: argparse.Namespace) -> None:
    pin = c.pin(chain(args.seed, args.count))
    emit(at="pinned", count=pin.count, fence=c.session.fence_path)
    while True:
        signal.pause()  # until SIGKILLed: the owner dies holding its pins


def fork_holder(args: argparse.Namespace) -> None:
    from hisparse.client.fence import hold

    go_r, go_w = os.pipe()  # worker -> child
    in_r, in_w = os.pipe()  # child -> worker
    if args.variant == "after":
        with hold(args.fence):
            pass  # the worker's cache has this fence open now, unlocked
        child = os.fork()
        if child == 0:
            os.read(go_r, 1)  # the worker holds now
            with hold(args.fence):
                pass
            os._exit(0)
        with hold(args.fence):
            os.write(go_w, b"g")
            os.waitpid(child, 0)
            emit(at="holding", who="worker")  # the child held and exited: the worker still holds
            sys.stdin.readline()
        emit(at="released")
        return
    import threading

    inside, leave = threading.Event(), threading.Event()

    def holder() -> None:
        with hold(args.fence):
            inside.set()
            leave.wait()

    thread = threading.Thread(target=holder)
    thread.start()
    inside.wait()
    child = os.fork()  # a thread of the worker is inside hold() now
    if child == 0:
        with hold(args.fence):
            os.write(in_w, b"i")
            os.read(go_r, 1)
        os._exit(0)
    os.read(in_r, 1)  # the child holds
    leave.set()  # the worker's own hold ends: the child's must still count
    thread.join()
    emit(at="holding", who="child")
    sys.stdin.readline()
    os.write(go_w, b"g")
    os.waitpid(child, 0)
    emit(at="released")


ROLES = {"stall-writer": stall_writer, "stall-reader": stall_reader, "soak-writer": soak_writer,
         "soak-reader": soak_reader, "soak-churn": soak_churn, "pin-owner": pin_owner,
         "soak-threads": soak_threads, "soak-forker": soak_forker}


def main(argv: list[str] | None = None) -> int:
    p = actor_parser(sorted([*ROLES, "fork-holder"]), count=4)
    p.add_argument("--until", default="/nonexistent")
    p.add_argument("--chains", type=int, default=32, help="soak: distinct chains written and read")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--fence", default=None, help="fork-holder: the fence file to hold")
    p.add_argument("--variant", choices=("after", "during"), default="after")
    args = p.parse_args(argv)
    if args.role == "fork-holder":  # no session of its own: it holds another process's fence
        fork_holder(args)
        return 0
    with client.attach(args.namespace, args.layout, socket=args.socket, capacity=args.capacity,
                       timeout_s=args.timeout, name=f"test-{args.role}") as c:
        emit(at="attached")
        ROLES[args.role](c, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
