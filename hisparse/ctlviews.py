"""What ``hisparsectl`` prints: tables from a ``stats`` reply, and a metrics scrape.

Pure formatting (no socket) except ``scrape``, which fetches the daemon's
Prometheus text over HTTP from a unix socket path or ``HOST:PORT``.
"""

from __future__ import annotations

import http.client
import socket
from collections.abc import Sequence
from typing import Any

from hisparse.layout import format_size


def table(header: Sequence[str], rows: Sequence[Sequence[str]], *, left: int = 1) -> list[str]:
    """Aligned columns: the first ``left`` columns left-justified, the rest right."""
    all_rows = [tuple(header), *(tuple(r) for r in rows)]
    widths = [max(len(r[i]) for r in all_rows) for i in range(len(header))]
    return ["  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in all_rows]


def format_duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def daemon_lines(stats: dict[str, Any]) -> list[str]:
    d = stats["daemon"]
    return [
        f"hisparsed {d['version']} pid {d['pid']} up {format_duration(d['uptime_s'])}, "
        f"{d['sessions']} sessions, {d.get('fenced_sessions', 0)} fenced, lease ttl {d['lease_ttl_s']:g}s",
        f"regions: capacity {format_size(d['capacity_bytes'])}, "
        f"used {format_size(d['allocated_bytes'])}, free {format_size(d['unallocated_bytes'])}, "
        f"evictions {d['evicted_pages']}",
        *format_caps(d),
        format_cluster(d.get("cluster") or {"backend": "none"}),
    ]


def format_caps(d: dict[str, Any]) -> list[str]:
    """What the caps count now, and their refusals by key ([] when the stats carry none)."""
    caps = d.get("caps")
    if not caps:
        return []
    refused = ", ".join(f"{key} {n}" for key, n in d.get("cap_refusals", {}).items() if n) or "none"
    return [f"caps: {d['connections']}/{caps['max_connections']} connections, "
            f"{d['sessions'] + d['control_sessions']}/{caps['max_sessions']} sessions, "
            f"{d['fds_in_use']}/{d['fd_budget']} descriptors (RLIMIT_NOFILE {d['fd_limit']}), "
            f"{format_size(d['request_bytes_in_flight'])}/{format_size(caps['max_request_bytes_in_flight'])}"
            f" large requests in flight; refused: {refused}"
            + (f"; socket shut to uid {', '.join(map(str, d['uids_shut_out']))} (a storm of its refused "
               "connections)" if d.get("uids_shut_out") else "")]


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
    header = ("namespace", "pages", "committed", "bytes", "pinned", "writing", "free", "hit rate",
              "evicted", "sessions")
    rows = [(name, str(ns["num_pages"]), str(ns["committed_pages"]), format_size(ns["committed_bytes"]),
             str(ns["pinned_pages"]), str(ns["writing_pages"]), str(ns["free_pages"]),
             f"{100 * ns['hit_rate']:.1f}%", str(ns["evicted_pages"]), str(ns["sessions"]))
            for name, ns in sorted(stats["namespaces"].items())]
    lines = [*daemon_lines(stats), ""]
    lines += table(header, rows) if rows else ["(no namespaces)"]
    if stats.get("sessions"):
        lines += ["", "sessions (fenced: ended, pages kept until its processes exit or let go;"
                  " hisparsectl evict-session HANDLE frees them now):", format_sessions(stats)]
    return "\n".join(lines)


def format_namespaces(stats: dict[str, Any]) -> str:
    header = ("namespace", "layers x tokens x row", "page", "pages", "region", "committed", "free",
              "hit rate", "sessions")
    rows = []
    for name, ns in sorted(stats["namespaces"].items()):
        lay = ns["layout"]
        rows.append((name, f"{lay['num_layers']} x {lay['block_tokens']} x {lay['row_bytes']} B",
                     format_size(ns["page_bytes"]), str(ns["num_pages"]), format_size(ns["size_bytes"]),
                     format_size(ns["committed_bytes"]), str(ns["free_pages"]),
                     f"{100 * ns['hit_rate']:.1f}%", str(ns["sessions"])))
    return "\n".join(table(header, rows)) if rows else "(no namespaces)"


def format_sessions(stats: dict[str, Any]) -> str:
    """Live and fenced sessions (the rows an admin session's ``stats`` reply carries)."""
    header = ("session", "namespace", "client", "state", "pids", "age", "idle", "reserved", "pinned",
              "fenced")
    rows = [(s["handle"], s["namespace"], s["client"] or "anonymous", s["state"],
             ",".join([str(p) for p in s["pids"]] + [f"{p}?" for p in s.get("pids_unverified", [])]) or "-",
             format_duration(s["age_s"]),
             format_duration(s["idle_s"]), str(s["reserved_pages"]), str(s["pinned_pages"]),
             str(s["fenced_pages"]))
            for s in sorted(stats.get("sessions", []), key=lambda s: (s["namespace"], s["state"], -s["age_s"]))]
    return "\n".join(table(header, rows, left=4)) if rows else "(no sessions)"


def format_top(stats: dict[str, Any], previous: dict[str, Any] | None, interval_s: float) -> str:
    """The ``top`` screen: daemon lines, then per namespace rates since ``previous``."""

    def rate(name: str, key: str) -> str:
        if previous is None or name not in previous["namespaces"]:
            return "-"
        delta = stats["namespaces"][name][key] - previous["namespaces"][name][key]
        return f"{delta / interval_s:.0f}"

    header = ("namespace", "used", "of", "pinned", "hit rate", "lookup keys/s", "stores/s",
              "pins/s", "evictions/s", "sessions")
    rows = []
    for name, ns in sorted(stats["namespaces"].items()):
        rows.append((name, format_size(ns["committed_bytes"]), format_size(ns["size_bytes"]),
                     str(ns["pinned_pages"]), f"{100 * ns['hit_rate']:.1f}%", rate(name, "lookup_keys"),
                     rate(name, "committed_total"), rate(name, "pins"), rate(name, "evicted_pages"),
                     str(ns["sessions"])))
    d = stats["daemon"]
    errors = "-"
    if previous is not None:
        errors = f"{(d['errors'] - previous['daemon']['errors']) / interval_s:.1f}"
    lines = [*daemon_lines(stats),
             f"requests {d['requests']}, errors {d['errors']} ({errors}/s); refresh every {interval_s:g}s",
             ""]
    lines += table(header, rows) if rows else ["(no namespaces)"]
    return "\n".join(lines)


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout_s: float) -> None:
        super().__init__("localhost", timeout=timeout_s)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.unix_path)
        self.sock = sock


def scrape(address: str, timeout_s: float = 5.0) -> str:
    """``GET /metrics`` from a unix socket path or ``HOST:PORT``: the exposition text.

    Raises ``OSError`` when nothing answers there.
    """
    if address.startswith("/"):
        conn: http.client.HTTPConnection = _UnixHTTPConnection(address, timeout_s)
    else:
        host, _, port = address.rpartition(":")
        conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout_s)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        body = resp.read().decode()
        if resp.status != 200:
            raise OSError(f"metrics endpoint {address} answered {resp.status} {resp.reason}")
        return body
    finally:
        conn.close()
