"""``hisparsectl``: inspect and control a running hisparsed.

``clear``, ``drop`` and ``evict-session`` read the admin token the daemon wrote beside its socket
(``hisparsed.token``, readable only by the daemon's user and root).

Exit codes, for scripts: 0 done; 1 the daemon refused or failed the request;
2 bad usage; 3 no daemon (no socket file, nothing listening on it, or no
answer within ``--timeout``); 4 permission denied (the socket, the admin
token missing or unreadable, or a wrong token); 141 its output pipe was
closed early (``| head``), as for any tool SIGPIPE ends.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from hisparse import ctlviews, pipes, protocol
from hisparse.client.transport import Transport, listener_problem
from hisparse.errors import DaemonUnavailable, HisparseError, LeaseExpired, PermissionDenied
from hisparse.layout import format_size
from hisparse.paths import default_socket_path

EXIT_OK = 0
EXIT_REFUSED = 1  # the daemon answered with an error
EXIT_USAGE = 2  # argparse's own code
EXIT_NO_DAEMON = 3
EXIT_PERMISSION = 4


class Control:
    """A one-shot admin connection: hello without a namespace, then requests.

    Requests go through the client's ``Transport`` (timeouts, stale replies
    dropped); this class only adds the admin session.
    """

    def __init__(self, socket_path: str, timeout_s: float = 5.0, token: str | None = None) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.token = token  # shown at hello: stats then list group-restricted namespaces too
        self._transport = Transport(os.path.abspath(socket_path))
        self.session: int | None = None

    def call(self, op: protocol.Op, **fields: Any) -> dict[str, Any]:
        try:
            return self._call(op, **fields)
        except LeaseExpired:
            # An admin session silent past the lease (``top`` with a long
            # interval, a daemon restart): open a new one, once.
            self.session = None
            return self._call(op, **fields)

    def _call(self, op: protocol.Op, **fields: Any) -> dict[str, Any]:
        if op not in protocol.SESSIONLESS_OPS:
            if self.session is None:
                self.session = self._call(protocol.Op.HELLO, client=f"hisparsectl pid {os.getpid()}",
                                          token=self.token)["session"]
            fields["session"] = self.session
        try:
            return self._transport.call(op, self.timeout_s, **fields)
        except DaemonUnavailable:
            raise DaemonUnavailable(f"no answer from hisparsed on {self.socket_path} "
                                    f"within {self.timeout_s:.1f}s") from None

    def close(self) -> None:
        if self.session is not None:
            try:
                self.call(protocol.Op.BYE)
            except HisparseError:
                pass
        self._transport.close()


def read_token(socket_path: str, token_file: str | None) -> str:
    """The admin token, or ``PermissionDenied`` (exit 4) naming the file and what to do."""
    path = token_file or os.path.join(os.path.dirname(os.path.abspath(socket_path)), "hisparsed.token")
    try:
        with open(path) as f:
            return f.read().strip()
    except PermissionError:
        raise PermissionDenied(f"cannot read the admin token {path}: run as the daemon's user or root") from None
    except FileNotFoundError:
        if token_file:
            raise PermissionDenied(f"no admin token at {path} (--token-file): give the file hisparsed "
                                   "wrote (its admin_token_file; default hisparsed.token beside its "
                                   "socket)") from None
        raise PermissionDenied(f"no admin token at {path}, where hisparsed on {socket_path} writes it "
                               "by default: if its config sets admin_token_file, pass that file with "
                               "--token-file") from None
    except OSError as exc:
        raise PermissionDenied(f"cannot read the admin token {path}: {exc.strerror or exc}") from None


def positive_seconds(text: str) -> float:
    """argparse type: a number of seconds above 0 (else a usage error, exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, not {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hisparsectl", description="inspect and control a running hisparsed",
        epilog="exit codes: 0 done, 1 refused by the daemon, 2 bad usage, 3 no daemon, "
               "4 permission denied (socket, admin token), 141 output pipe closed (| head)")
    p.add_argument("--socket", metavar="PATH", help="default: $HISPARSE_SOCKET, /run/hisparsed/"
                   "hisparsed.sock, or the embedded default")
    p.add_argument("--token-file", metavar="PATH", help="default: hisparsed.token beside the socket")
    p.add_argument("--timeout", type=positive_seconds, default=5.0, metavar="SECONDS",
                   help="wait this long for an answer (default 5)")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("ping", help="is the daemon up")
    st = sub.add_parser("stats", help="per-namespace and region counters")
    st.add_argument("--json", action="store_true", help="machine-readable: the whole stats reply")
    sub.add_parser("namespaces", help="each namespace's layout, region size and use")
    sub.add_parser("sessions", help="open sessions: client, age, silence, reservations, pins")
    top = sub.add_parser("top", help="a refreshing view of use and rates (Ctrl-C quits)")
    top.add_argument("--interval", type=positive_seconds, default=2.0, metavar="SECONDS",
                     help="seconds between screens, above 0 (default 2)")
    top.add_argument("--count", type=int, default=0, metavar="N",
                     help="stop after N screens (default: until interrupted)")
    me = sub.add_parser("metrics", help="the Prometheus text the metrics endpoint serves")
    me.add_argument("--address", metavar="PATH|HOST:PORT",
                    help="default: the daemon's metrics_address, asked over the socket")
    cl = sub.add_parser("clear", help="drop every committed page of a namespace")
    cl.add_argument("namespace")
    dr = sub.add_parser("drop", help="remove a namespace and its region; its memory goes back "
                        "to the daemon's capacity (refused while engines are attached; one "
                        "that attaches later creates it again, empty)")
    dr.add_argument("namespace")
    dr.add_argument("--force", action="store_true", help="also end the sessions attached to it (their "
                    "clients re-attach and re-create the namespace at their next request)")
    ev = sub.add_parser("evict-session", help="free a live or fenced session's pages now "
                        "(its process, if alive, may still write into them: your call)")
    ev.add_argument("handle", help="the 8-hex-digit handle that hisparsectl sessions shows")
    return p


def _top(ctl: Control, interval_s: float, count: int) -> None:
    previous = None
    shown = 0
    clear = sys.stdout.isatty()
    while True:
        stats = ctl.call(protocol.Op.STATS)
        screen = ctlviews.format_top(stats, previous, interval_s)
        print(("\x1b[H\x1b[2J" if clear else "") + screen + ("" if clear else "\n"), flush=True)
        previous = stats
        shown += 1
        if count and shown >= count:
            return
        time.sleep(interval_s)


def _metrics(ctl: Control, address: str | None) -> None:
    if address is None:
        address = ctl.call(protocol.Op.STATS)["daemon"].get("metrics_address", "")
        if not address:
            raise HisparseError("this hisparsed serves no metrics (metrics_address = \"\"); "
                                "set metrics_address in its config, or pass --address")
    try:
        sys.stdout.write(ctlviews.scrape(address, ctl.timeout_s))
    except PermissionError:
        raise PermissionDenied(f"may not connect to the metrics socket {address}: join the "
                               "daemon's group") from None
    except OSError as exc:
        raise DaemonUnavailable(f"no metrics from {address}: {exc}") from None


def _run(ctl: Control, args: argparse.Namespace, socket_path: str) -> None:
    if args.command == "ping":
        r = ctl.call(protocol.Op.PING)
        print(f"hisparsed {r['version']} (protocol {r['protocol']}) pid {r['pid']} "
              f"up {r['uptime_s']:.1f}s on {socket_path}")
    elif args.command == "stats":
        stats = ctl.call(protocol.Op.STATS)
        print(json.dumps(stats, indent=2, sort_keys=True) if args.json else ctlviews.format_stats(stats))
    elif args.command == "namespaces":
        print(ctlviews.format_namespaces(ctl.call(protocol.Op.STATS)))
    elif args.command == "sessions":
        print(ctlviews.format_sessions(ctl.call(protocol.Op.STATS)))
    elif args.command == "top":
        _top(ctl, args.interval, args.count)
    elif args.command == "metrics":
        _metrics(ctl, args.address)
    elif args.command == "clear":
        token = read_token(socket_path, args.token_file)
        r = ctl.call(protocol.Op.CLEAR, namespace=args.namespace, token=token)
        print(f"cleared {args.namespace!r}: {r['freed_pages']} pages freed, "
              f"{r['doomed_pages']} freed when their pins are released")
    elif args.command == "drop":
        token = read_token(socket_path, args.token_file)
        r = ctl.call(protocol.Op.DROP, namespace=args.namespace, token=token,
                     force=True if args.force else None)
        ended = r["ended_sessions"]
        print(f"dropped {args.namespace!r}: {format_size(r['freed_bytes'])} back to the capacity, "
              f"{ended} sessions ended" + (" (their clients re-create the namespace, empty, at "
                                           "their next request: stop those engines to keep it "
                                           "gone)" if ended else ""))
    elif args.command == "evict-session":
        token = read_token(socket_path, args.token_file)
        r = ctl.call(protocol.Op.EVICT_SESSION, target=args.handle, token=token)
        print(f"evicted session {args.handle}: {r['freed_pages']} fenced pages freed, "
              f"{r['released_pins']} pins released")


def main(argv: list[str] | None = None) -> int:
    return pipes.run_main(_main, argv)


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    socket_path = args.socket or default_socket_path()
    problem = listener_problem(socket_path)  # fail fast, before ZeroMQ would wait out the timeout
    if problem is not None:
        print(f"hisparsectl: {problem}", file=sys.stderr)
        return exit_code(problem)
    try:  # the daemon's user and root see every namespace; others the open ones
        quiet_token: str | None = read_token(socket_path, args.token_file)
    except HisparseError as exc:
        if args.token_file:  # asked for by name: a missing or unreadable one is an error
            print(f"hisparsectl: {exc}", file=sys.stderr)
            return exit_code(exc)
        quiet_token = None
    try:
        ctl = Control(socket_path, args.timeout, quiet_token)
    except HisparseError as exc:
        print(f"hisparsectl: {exc}", file=sys.stderr)
        return exit_code(exc)
    try:
        _run(ctl, args, socket_path)
        return EXIT_OK
    except HisparseError as exc:
        print(f"hisparsectl: {exc}", file=sys.stderr)
        return exit_code(exc)
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        ctl.close()


def exit_code(exc: HisparseError) -> int:
    if isinstance(exc, DaemonUnavailable):
        return EXIT_NO_DAEMON
    if isinstance(exc, PermissionDenied):
        return EXIT_PERMISSION
    return EXIT_REFUSED


if __name__ == "__main__":
    sys.exit(main())
