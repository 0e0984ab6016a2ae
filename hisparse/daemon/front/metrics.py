"""The Prometheus endpoint: what the daemon knows, in ``prometheus_client``'s text format.

Served on ``metrics_address`` (a unix socket path, mode 0600, or
``HOST:PORT``) by a small HTTP responder on the daemon's own event loop. A
scraper sees what ``stats`` would show it: group-restricted namespaces only
when the kernel says it is the daemon's user or root (``SO_PEERCRED`` on the
unix socket); over TCP nobody is known, so only open namespaces show. A scrape costs the loop
one snapshot (the ``stats`` reply's numbers plus a copy of ``OpStats``: no
per-page work); the exposition text is rendered in a worker thread from that
frozen copy, so neither rendering nor a slow scraper holds up a request.

Families (every one prefixed ``hisparse_``; label ``namespace`` where per
namespace): pages by state, pinned pages, capacity, lookups and looked-up
keys by result (hit/miss), stored (committed), reserved, aborted, evicted
and pinned page counters, sessions by state, expired sessions, request
latency per op, errors by code, event-loop lag, region bytes; and the caps
(``limits.py``): each cap's value and its refusals (label ``cap``: the
config key), open connections and sessions, descriptors in use against the
budget and the limit, request bytes in flight.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from hisparse.daemon.ops.handlers import DaemonContext, handle_stats
from hisparse.daemon.ops.opstats import Histogram, OpStats
from hisparse.errors import HisparseError

log = logging.getLogger(__name__)

REQUEST_HEAD_TIMEOUT_S = 5.0
MAX_REQUEST_HEAD_BYTES = 8192


@dataclass(frozen=True)
class Snapshot:
    stats: dict[str, Any]  # the ``stats`` reply
    sessions: dict[tuple[str, str], int]  # (namespace, state) -> count
    opstats: OpStats


SESSION_STATES = ("active", "silent", "fenced")


def session_state(last_seen_s: float, now_s: float, lease_ttl_s: float) -> str:
    """``active``, or ``silent`` once past half the lease (stalled, or about to expire)."""
    return "active" if now_s - last_seen_s <= lease_ttl_s / 2 else "silent"


def take_snapshot(ctx: DaemonContext, sees_all: bool = True) -> Snapshot:
    """On the event loop: O(namespaces + sessions), no per-page work.

    Session states: ``active`` and ``silent`` are live sessions; ``fenced`` are
    ended ones whose pages stay fenced until their process lets go.
    ``sees_all`` False: group-restricted namespaces are left out, as ``stats``
    leaves them out for a session that is neither theirs nor the admin's.
    """
    stats = handle_stats(ctx, None, None)  # no session: no per-session rows (they read /proc/locks)
    if not sees_all and ctx.access is not None:
        stats["namespaces"] = {n: v for n, v in stats["namespaces"].items() if not ctx.access.restricted(n)}
    now_s = ctx.sessions.now()
    ttl_s = ctx.sessions.lease_ttl_s
    sessions: dict[tuple[str, str], int] = {}
    for name in stats["namespaces"]:
        for state in SESSION_STATES:
            sessions[(name, state)] = 0
    for s in ctx.sessions.sessions.values():
        if s.namespace is None or s.namespace.name not in stats["namespaces"]:
            continue
        key = (s.namespace.name, session_state(s.last_seen_s, now_s, ttl_s))
        sessions[key] = sessions.get(key, 0) + 1
    for z in ctx.sessions.zombies.values():
        if z.namespace.name not in stats["namespaces"]:
            continue
        key = (z.namespace.name, "fenced")
        sessions[key] = sessions.get(key, 0) + 1
    return Snapshot(stats, sessions, ctx.opstats.copy())


def _buckets(h: Histogram) -> list[tuple[str, float]]:
    out, total = [], 0
    for bound_ns, count in zip((*h.bounds_ns, None), h.counts):
        total += count
        out.append(("+Inf" if bound_ns is None else repr(bound_ns / 1e9), float(total)))
    return out


# (stats key, metric name, help) of the per-namespace counters.
_NS_COUNTERS = (
    ("lookups", "lookups", "lookup requests"),
    ("reserved_total", "reserved_pages", "pages reserved for a store (each store reserves, copies, commits)"),
    ("committed_total", "stored_pages", "pages committed: stores completed"),
    ("aborted_pages", "aborted_pages", "reservations aborted or expired, never visible"),
    ("evicted_pages", "evicted_pages", "committed pages evicted (LRU) to make room"),
    ("pins", "pinned_pages", "pages pinned: every load pins what it copies, a sparse tier for a request's life"),
)
_PAGE_STATES = (("free", "free_pages"), ("writing", "writing_pages"), ("committed", "committed_pages"),
                ("fenced", "fenced_pages"))


class SnapshotCollector:
    """Yields the families of one frozen snapshot (a fresh registry per scrape)."""

    def __init__(self, snap: Snapshot) -> None:
        self.snap = snap

    def collect(self) -> Iterator[Metric]:
        stats, d = self.snap.stats, self.snap.stats["daemon"]
        info = InfoMetricFamily("hisparse_daemon", "the daemon's version and pid")
        info.add_metric([], {"version": str(d["version"]), "pid": str(d["pid"])})
        yield info
        yield GaugeMetricFamily("hisparse_uptime_seconds", "since the daemon started", value=d["uptime_s"])
        yield GaugeMetricFamily("hisparse_capacity_bytes", "all regions together may not exceed this",
                                value=d["capacity_bytes"])
        yield GaugeMetricFamily("hisparse_allocated_bytes", "bytes of all regions created",
                                value=d["allocated_bytes"])
        yield GaugeMetricFamily("hisparse_lease_ttl_seconds", "a session silent this long expires",
                                value=d["lease_ttl_s"])
        yield CounterMetricFamily("hisparse_sessions_expired", "sessions whose lease expired",
                                  value=d["sessions_expired"])
        yield CounterMetricFamily("hisparse_fences_released", "ended sessions whose fenced pages "
                                  "were freed once their process let go",
                                  value=d.get("fenced_sessions_released", 0))
        yield CounterMetricFamily("hisparse_replies_dropped", "replies dropped: the client stopped "
                                  "reading or went away", value=d.get("replies_dropped", 0))
        yield GaugeMetricFamily("hisparse_replies_queued_bytes", "replies waiting for slow readers",
                                value=d.get("replies_queued_bytes", 0))
        yield from self._caps(d)
        yield from self._namespaces(stats["namespaces"])
        yield from self._requests()

    def _caps(self, d: dict[str, Any]) -> Iterator[Metric]:
        if "caps" not in d:  # no transport (an in-process context): nothing is capped
            return
        limit = GaugeMetricFamily("hisparse_cap_limit", "each cap's value (a config key; fd_headroom: "
                                  "as configured, the daemon keeps an eighth of the limit if more)",
                                  labels=["cap"])
        refusals = CounterMetricFamily("hisparse_cap_refusals", "sessions, connections and large "
                                       "requests refused by each cap (QUOTA_EXCEEDED naming it)",
                                       labels=["cap"])
        for cap, value in sorted(d["caps"].items()):
            limit.add_metric([cap], value)
            refusals.add_metric([cap], d["cap_refusals"].get(cap, 0))
        yield from (limit, refusals)
        yield GaugeMetricFamily("hisparse_connections_open", "connections admitted and open now",
                                value=d["connections"])
        yield GaugeMetricFamily("hisparse_sessions_open", "sessions open now, engines' and control "
                                "ones (what max_sessions counts)", value=d["sessions"] + d["control_sessions"])
        yield GaugeMetricFamily("hisparse_file_descriptors", "descriptors in use (an upper estimate)",
                                value=d["fds_in_use"])
        yield GaugeMetricFamily("hisparse_file_descriptors_budget", "descriptors the daemon lets "
                                "sessions and connections take: the limit less the headroom",
                                value=d["fd_budget"])
        yield GaugeMetricFamily("hisparse_file_descriptors_limit", "RLIMIT_NOFILE", value=d["fd_limit"])
        yield GaugeMetricFamily("hisparse_request_bytes_in_flight", "what connections sending large "
                                "frames may have the daemon hold now (max_request_bytes_in_flight)",
                                value=d["request_bytes_in_flight"])
        yield GaugeMetricFamily("hisparse_requests_in_slices", "large writes being served a slice "
                                "per turn now", value=d["requests_in_slices"])
        yield CounterMetricFamily("hisparse_request_slices", "slices of large writes served after "
                                  "their first", value=d["request_slices"])

    def _namespaces(self, namespaces: dict[str, dict[str, Any]]) -> Iterator[Metric]:
        label = ["namespace"]
        pages = GaugeMetricFamily("hisparse_pages", "pages by state", labels=["namespace", "state"])
        pinned = GaugeMetricFamily("hisparse_pinned_pages_now", "committed pages pinned now", labels=label)
        cap_pages = GaugeMetricFamily("hisparse_namespace_capacity_pages", "pages in the region", labels=label)
        cap_bytes = GaugeMetricFamily("hisparse_namespace_capacity_bytes", "bytes of the region", labels=label)
        committed_bytes = GaugeMetricFamily("hisparse_committed_bytes", "bytes of committed pages",
                                            labels=label)
        keys = CounterMetricFamily("hisparse_lookup_keys", "keys looked up, by result (hit: committed)",
                                   labels=["namespace", "result"])
        counters = {metric: CounterMetricFamily(f"hisparse_{metric}", help_, labels=label)
                    for _, metric, help_ in _NS_COUNTERS}
        for name, ns in sorted(namespaces.items()):
            for state, key in _PAGE_STATES:
                pages.add_metric([name, state], ns[key])
            pinned.add_metric([name], ns["pinned_pages"])
            cap_pages.add_metric([name], ns["num_pages"])
            cap_bytes.add_metric([name], ns["size_bytes"])
            committed_bytes.add_metric([name], ns["committed_bytes"])
            keys.add_metric([name, "hit"], ns["hit_keys"])
            keys.add_metric([name, "miss"], ns["lookup_keys"] - ns["hit_keys"])
            for key, metric, _ in _NS_COUNTERS:
                counters[metric].add_metric([name], ns[key])
        sessions = GaugeMetricFamily(
            "hisparse_sessions", "namespace sessions by state: active, silent (past half the lease), "
            "fenced (ended, pages held until its process lets go)",
            labels=["namespace", "state"])
        for (name, state), count in sorted(self.snap.sessions.items()):
            sessions.add_metric([name, state], count)
        yield from (pages, pinned, cap_pages, cap_bytes, committed_bytes, keys, *counters.values(), sessions)

    def _requests(self) -> Iterator[Metric]:
        ops = self.snap.opstats
        latency = HistogramMetricFamily("hisparse_request_duration_seconds",
                                        "time the daemon spent on a request, by op", labels=["op"])
        for op, h in sorted(ops.latency.items()):
            latency.add_metric([op], _buckets(h), h.sum_ns / 1e9)
        yield latency
        errors = CounterMetricFamily("hisparse_request_errors", "error replies by code", labels=["code"])
        for code, count in sorted(ops.errors.items()):
            errors.add_metric([code], count)
        yield errors
        lag = HistogramMetricFamily("hisparse_event_loop_lag_seconds",
                                    "how late the loop's periodic timer fired")
        lag.add_metric([], _buckets(ops.loop_lag), ops.loop_lag.sum_ns / 1e9)
        yield lag
        yield GaugeMetricFamily("hisparse_event_loop_lag_last_seconds", "the latest lag measured",
                                value=ops.loop_lag_last_ns / 1e9)


def render(snap: Snapshot) -> bytes:
    """The exposition text of one snapshot; safe in any thread."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snap))  # type: ignore[arg-type]
    return generate_latest(registry)


# -- the endpoint --

def parse_address(address: str) -> tuple[str, int] | str:
    """``/path/to.sock`` -> the path; ``HOST:PORT`` (``[::1]:PORT``) -> (host, port)."""
    if address.startswith("/"):
        return address
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is neither an absolute unix socket path nor HOST:PORT")
    return host.strip("[]"), int(port)


class MetricsServer:
    """HTTP ``GET /metrics`` on the daemon's loop; one snapshot per scrape."""

    def __init__(self, ctx: DaemonContext, address: str) -> None:
        self.ctx = ctx
        self.address = address
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        target = parse_address(self.address)
        if isinstance(target, str):
            _claim_unix_path(target)
            self._server = await asyncio.start_unix_server(self._serve_one, target)
            # only the daemon's user and root may connect; _sees_all checks the scraper anyway
            os.chmod(target, 0o600)
        else:
            self._server = await asyncio.start_server(self._serve_one, target[0], target[1])
        log.info("metrics on %s", self.address)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            if self.address.startswith("/"):
                try:
                    os.unlink(self.address)
                except FileNotFoundError:
                    pass

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_HEAD_TIMEOUT_S)
            parts = head[:MAX_REQUEST_HEAD_BYTES].split(b"\r\n", 1)[0].split()
            method = parts[0] if parts else b""
            path = parts[1].split(b"?", 1)[0] if len(parts) > 1 else b""
            if method not in (b"GET", b"HEAD"):
                await _respond(writer, 405, b"text/plain", b"GET /metrics\n")
            elif path not in (b"/metrics", b"/"):
                await _respond(writer, 404, b"text/plain", b"GET /metrics\n")
            else:
                snap = take_snapshot(self.ctx, _sees_all(writer))
                started_s = time.perf_counter()
                body = await asyncio.get_running_loop().run_in_executor(None, render, snap)
                log.debug("metrics: %d bytes rendered in %.1f ms", len(body),
                          1e3 * (time.perf_counter() - started_s))
                await _respond(writer, 200, CONTENT_TYPE_LATEST.encode(), b"" if method == b"HEAD" else body)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError):
            pass  # a scraper that went away or never spoke HTTP
        except Exception:
            log.error("error serving metrics; serving on", exc_info=True)
        finally:
            writer.close()


def _sees_all(writer: asyncio.StreamWriter) -> bool:
    """Whether the scraper may see restricted namespaces: the daemon's user or root, by the kernel's word."""
    sock = writer.get_extra_info("socket")
    if sock is None or sock.family != socket.AF_UNIX:
        return False  # TCP: anyone on the host (or beyond) may have connected
    try:
        _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                       struct.calcsize("3i")))
    except OSError:
        return False
    return uid in (0, os.geteuid())


async def _respond(writer: asyncio.StreamWriter, status: int, content_type: bytes, body: bytes) -> None:
    reason = {200: b"OK", 404: b"Not Found", 405: b"Method Not Allowed"}[status]
    writer.write(b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                 % (status, reason, content_type, len(body)) + body)
    await writer.drain()


def _claim_unix_path(path: str) -> None:
    """Remove a socket a dead daemon left; refuse one that a live process serves."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)
        return
    finally:
        probe.close()
    raise HisparseError(f"metrics_address {path}: another process serves on it")
