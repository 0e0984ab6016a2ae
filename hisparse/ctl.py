"""``hisparsectl``: ping, stats, clear, drop and evict-session on a running hisparsed.

``clear``, ``drop`` and ``evict-session`` read the admin token the daemon wrote beside its socket
(``hisparsed.token``, readable only by the daemon's user and root).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from hisparse import protocol
from hisparse.client.transport import Transport
from hisparse.errors import DaemonUnavailable, HisparseError
from hisparse.layout import format_size
from hisparse.paths import default_socket_path


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
        if op not in protocol.SESSIONLESS_OPS:
            if self.session is None:
                self.session = self.call(protocol.Op.HELLO, client=f"hisparsectl pid {os.getpid()}",
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
    path = token_file or os.path.join(os.path.dirname(os.path.abspath(socket_path)), "hisparsed.token")
    try:
        with open(path) as f:
            return f.read().strip()
    except PermissionError:
        raise HisparseError(f"cannot read the admin token {path}: run as the daemon's user or root") from None
    except FileNotFoundError:
        raise HisparseError(f"no admin token at {path}: is hisparsed running on {socket_path}?") from None


def format_cluster(c: dict[str, Any]) -> str:
    """One line for the cluster tier (``[cluster]``), or that there is none."""
    if c.get("backend", "none") == "none":
        return "cluster: off"
    line = (f"cluster: {c['backend']} at {c['master']} ({c['protocol']}) {c['state']}, "
            f"{c['write_policy']}, queue {c['queue_depth']}/{c['queue_pages']}, "
            f"put {c['put_pages']} pages ({format_size(c['put_bytes'])}), dropped {c['dropped_pages']}, "
            f"promoted {c['promoted_pages']}, refused {c['refused_pages']}")
    return line + (f"; last error: {c['last_error']}" if c["state"] != "up" and c["last_error"] else "")


def format_stats(stats: dict[str, Any]) -> str:
    d = stats["daemon"]
    lines = [
        f"hisparsed {d['version']} pid {d['pid']} up {d['uptime_s']:.0f}s, "
        f"{d['sessions']} sessions, lease ttl {d['lease_ttl_s']}s",
        f"regions: capacity {format_size(d['capacity_bytes'])}, "
        f"used {format_size(d['allocated_bytes'])}, free {format_size(d['unallocated_bytes'])}, "
        f"evictions {d['evicted_pages']}",
        format_cluster(d.get("cluster") or {"backend": "none"}),
        "",
    ]
    header = ("namespace", "pages", "committed", "bytes", "pinned", "writing", "free", "hit rate",
              "evicted", "sessions")
    rows = [header]
    for name, ns in sorted(stats["namespaces"].items()):
        rows.append((name, str(ns["num_pages"]), str(ns["committed_pages"]),
                     format_size(ns["committed_bytes"]), str(ns["pinned_pages"]),
                     str(ns["writing_pages"]), str(ns["free_pages"]),
                     f"{100 * ns['hit_rate']:.1f}%", str(ns["evicted_pages"]), str(ns["sessions"])))
    if len(rows) == 1:
        lines.append("(no namespaces)")
        return "\n".join(lines)
    lines += _table(rows)
    sessions = stats.get("sessions") or []
    if sessions:
        lines += ["", "sessions (fenced: ended, pages kept until its processes exit or let go;"
                  " `hisparsectl evict-session HANDLE` frees them now):"]
        srows = [("handle", "state", "namespace", "pids", "age", "idle", "reserved", "pinned",
                  "fenced", "client")]
        for s in sorted(sessions, key=lambda s: (s["state"], s["namespace"], s["handle"])):
            srows.append((s["handle"], s["state"], s["namespace"],
                          ",".join(map(str, s["pids"])) or "-", f"{s['age_s']:.0f}s",
                          f"{s['idle_s']:.0f}s", str(s["reserved_pages"]), str(s["pinned_pages"]),
                          str(s["fenced_pages"]), s["client"][:40]))
        lines += _table(srows)
    return "\n".join(lines)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                      enumerate(zip(r, widths))).rstrip() for r in rows]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hisparsectl", description="control a running hisparsed")
    p.add_argument("--socket", metavar="PATH", help="default: $HISPARSE_SOCKET, /run/hisparsed/"
                   "hisparsed.sock, or the embedded default")
    p.add_argument("--token-file", metavar="PATH", help="default: hisparsed.token beside the socket")
    p.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("ping", help="is the daemon up")
    st = sub.add_parser("stats", help="per-namespace and region counters")
    st.add_argument("--json", action="store_true", help="machine-readable")
    cl = sub.add_parser("clear", help="drop every committed page of a namespace")
    cl.add_argument("namespace")
    dr = sub.add_parser("drop", help="remove a namespace and its region; its memory goes back "
                        "to the daemon's capacity")
    dr.add_argument("namespace")
    dr.add_argument("--force", action="store_true", help="also end the sessions attached to it")
    ev = sub.add_parser("evict-session", help="free a live or fenced session's pages now "
                        "(its process, if alive, may still write into them: your call)")
    ev.add_argument("handle", help="the 8-hex-digit handle `stats` shows")
    args = p.parse_args(argv)
    socket_path = args.socket or default_socket_path()
    try:  # the daemon's user and root see every namespace; others the open ones
        quiet_token: str | None = read_token(socket_path, args.token_file)
    except HisparseError:
        quiet_token = None
    ctl = Control(socket_path, args.timeout, quiet_token)
    try:
        if args.command == "ping":
            r = ctl.call(protocol.Op.PING)
            print(f"hisparsed {r['version']} (protocol {r['protocol']}) pid {r['pid']} "
                  f"up {r['uptime_s']:.1f}s on {socket_path}")
        elif args.command == "stats":
            stats = ctl.call(protocol.Op.STATS)
            print(json.dumps(stats, indent=2, sort_keys=True) if args.json else format_stats(stats))
        elif args.command == "clear":
            token = read_token(socket_path, args.token_file)
            r = ctl.call(protocol.Op.CLEAR, namespace=args.namespace, token=token)
            print(f"cleared {args.namespace!r}: {r['freed_pages']} pages freed, "
                  f"{r['doomed_pages']} freed when their pins are released")
        elif args.command == "drop":
            token = read_token(socket_path, args.token_file)
            r = ctl.call(protocol.Op.DROP, namespace=args.namespace, token=token,
                         force=True if args.force else None)
            print(f"dropped {args.namespace!r}: {format_size(r['freed_bytes'])} back to the capacity, "
                  f"{r['ended_sessions']} sessions ended")
        elif args.command == "evict-session":
            token = read_token(socket_path, args.token_file)
            r = ctl.call(protocol.Op.EVICT_SESSION, target=args.handle, token=token)
            print(f"evicted session {args.handle}: {r['freed_pages']} fenced pages freed, "
                  f"{r['released_pins']} pins released")
        return 0
    except HisparseError as exc:
        print(f"hisparsectl: {exc}", file=sys.stderr)
        return 1
    finally:
        ctl.close()


if __name__ == "__main__":
    sys.exit(main())
