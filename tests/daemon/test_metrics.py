"""The Prometheus endpoint of a real hisparsed, scraped during a real workload.

Every scrape is parsed with ``prometheus_client``'s own parser, and the
counters are checked against what the workload did.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import hisparse
from hisparse import client
from hisparse.ctlviews import scrape
from hisparse.protocol import ErrorCode
from tests.client.engine import chain

LAYOUT = hisparse.KVLayout(num_layers=2, block_tokens=8, row_bytes=32)  # 512-byte pages
NS = "metrics/ns"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(snap: dict, name: str, **labels: str) -> float:
    return snap[(name, tuple(sorted(labels.items())))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_counters_match_the_workload(daemon_factory, tmp_path):
    # one client storing 40 pages of a 64-page region at once: the defaults let a lone client
    d = daemon_factory(capacity="64MiB", lease_ttl=5)
    address = os.path.join(os.path.dirname(d.socket), "hisparsed.metrics.sock")  # the default
    with client.attach(NS, LAYOUT, socket=d.socket, capacity=64 * LAYOUT.page_bytes, timeout_s=5) as c:
        keys = chain("w", 40)
        pages = torch.randint(0, 256, (40, LAYOUT.page_bytes), dtype=torch.uint8)
        # scrape over and over while the workload runs: each parses, nothing goes backwards
        stop = threading.Event()
        seen: list[float] = []
        failures: list[BaseException] = []

        def scraper() -> None:
            try:
                while not stop.is_set():
                    snap = samples(scrape(address))
                    seen.append(snap.get(("hisparse_stored_pages_total", (("namespace", NS),)), 0.0))
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

        t = threading.Thread(target=scraper)
        t.start()
        try:
            assert c.store(keys[:30], pages[:30]) == 30
            assert c.lookup(keys) == 30  # 40 keys: 30 hits, 10 misses
            out = torch.zeros((30, LAYOUT.page_bytes), dtype=torch.uint8)
            assert c.load(keys[:30], out) == 30
            assert c.store(keys[30:], pages[30:]) == 10  # 64-page region: no eviction yet
            assert c.store(chain("x", 40), torch.zeros((40, LAYOUT.page_bytes), dtype=torch.uint8)) == 40
            with c.pin(keys[:5]):  # those that survived the eviction or not: count what the reply said
                snap_pinned = samples(scrape(address))
        finally:
            stop.set()
            t.join(30)
        assert not failures, failures
        assert len(seen) >= 1 and seen == sorted(seen)

        # a refused request shows up by code
        with pytest.raises(hisparse.HisparseError):
            c.request(hisparse.protocol.Op.COMMIT, keys=[keys[0]])  # nothing reserved
        stats = c.stats()
        snap = samples(scrape(address))

    ns = stats["namespaces"][NS]
    assert value(snap, "hisparse_stored_pages_total", namespace=NS) == 80 == ns["committed_total"]
    assert value(snap, "hisparse_evicted_pages_total", namespace=NS) == 16 == ns["evicted_pages"]
    assert value(snap, "hisparse_lookup_keys_total", namespace=NS, result="hit") == ns["hit_keys"]
    assert value(snap, "hisparse_lookup_keys_total", namespace=NS, result="miss") == \
        ns["lookup_keys"] - ns["hit_keys"]
    assert ns["lookup_keys"] >= 40 and ns["hit_keys"] >= 30
    assert value(snap, "hisparse_pages", namespace=NS, state="committed") == 64
    assert value(snap, "hisparse_pages", namespace=NS, state="free") == 0
    assert value(snap, "hisparse_namespace_capacity_pages", namespace=NS) == 64
    assert value(snap, "hisparse_namespace_capacity_bytes", namespace=NS) == 64 * LAYOUT.page_bytes
    assert value(snap_pinned, "hisparse_pinned_pages_now", namespace=NS) == \
        value(snap_pinned, "hisparse_pinned_pages_total", namespace=NS) - 30
    assert value(snap, "hisparse_pinned_pages_now", namespace=NS) == 0
    assert value(snap, "hisparse_sessions", namespace=NS, state="active") == 1
    assert value(snap, "hisparse_request_errors_total", code=ErrorCode.NOT_HELD.value) == 1
    # every store is reserve + commit: the latency histograms counted each request once
    assert value(snap, "hisparse_request_duration_seconds_count", op="commit") >= 3
    assert value(snap, "hisparse_request_duration_seconds_bucket", op="hello", le="+Inf") == \
        value(snap, "hisparse_request_duration_seconds_count", op="hello") >= 1
    assert value(snap, "hisparse_event_loop_lag_seconds_count") >= 0
    assert value(snap, "hisparse_capacity_bytes") == 64 << 20


def test_tcp_address_and_hisparsectl_metrics(daemon_factory):
    port = free_port()
    d = daemon_factory(extra=("--metrics-address", f"127.0.0.1:{port}"))
    with client.attach(NS, LAYOUT, socket=d.socket, capacity="1MiB", timeout_s=5) as c:
        c.store(chain("t", 3), torch.ones((3, LAYOUT.page_bytes), dtype=torch.uint8))
        r = subprocess.run([sys.executable, "-m", "hisparse.ctl", "--socket", d.socket, "metrics"],
                           capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    snap = samples(r.stdout)
    assert value(snap, "hisparse_stored_pages_total", namespace=NS) == 3
    assert samples(scrape(f"127.0.0.1:{port}"))[("hisparse_pages", (("namespace", NS), ("state", "committed")))] == 3


def test_metrics_off_and_bad_addresses(daemon_factory):
    d = daemon_factory(extra=("--metrics-address", ""))
    assert not os.path.exists(os.path.join(os.path.dirname(d.socket), "hisparsed.metrics.sock"))
    r = subprocess.run([sys.executable, "-m", "hisparse.ctl", "--socket", d.socket, "metrics"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and 'metrics_address = ""' in r.stderr
    bad = daemon_factory(extra=("--metrics-address", "localhost"), start=False)
    bad.start(wait=False)
    assert bad.proc is not None and bad.proc.wait(30) == 2
    assert "neither an absolute unix socket path nor HOST:PORT" in bad.log()


def test_a_stalled_writer_shows_as_fenced_until_it_lets_go(daemon_factory):
    from tests.rawclient import RawClient, keys_for

    d = daemon_factory(lease_ttl=1)
    address = os.path.join(os.path.dirname(d.socket), "hisparsed.metrics.sock")
    stalled = RawClient(d.socket)
    try:
        stalled.hello("fenced/ns", hisparse.KVLayout(2, 4, 16), 128 * 32)
        stalled.call(hisparse.protocol.Op.RESERVE, keys=keys_for("stall", 5))
        # silent past its lease, but its process still holds the fence: the pages stay fenced
        deadline = time.monotonic() + 30
        while True:
            snap = samples(scrape(address))
            if value(snap, "hisparse_sessions", namespace="fenced/ns", state="fenced") == 1:
                break
            assert time.monotonic() < deadline, "the expired session never showed as fenced"
            time.sleep(0.05)
        assert value(snap, "hisparse_pages", namespace="fenced/ns", state="fenced") == 5
        assert value(snap, "hisparse_sessions", namespace="fenced/ns", state="active") == 0
        assert value(snap, "hisparse_sessions_expired_total") == 1
        stalled.release_fence()  # the process lets go: the daemon frees the pages
        while True:
            snap = samples(scrape(address))
            if value(snap, "hisparse_fences_released_total") == 1:
                break
            assert time.monotonic() < deadline, "the fence was never released"
            time.sleep(0.05)
        assert value(snap, "hisparse_pages", namespace="fenced/ns", state="fenced") == 0
        assert value(snap, "hisparse_sessions", namespace="fenced/ns", state="fenced") == 0
    finally:
        stalled.close()


def test_the_grafana_dashboard_queries_metrics_the_daemon_serves(daemon_factory):
    import json
    import re

    d = daemon_factory()
    with client.attach(NS, LAYOUT, socket=d.socket, capacity="1MiB", timeout_s=5) as c:
        c.lookup(chain("g", 2))
        with pytest.raises(hisparse.HisparseError):  # one error, so the errors family has a sample
            c.request(hisparse.protocol.Op.COMMIT, keys=chain("g", 1))
        served = {name for name, _ in samples(scrape(os.path.join(os.path.dirname(d.socket),
                                                                  "hisparsed.metrics.sock")))}
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(repo, "docs", "grafana-hisparse.json")) as f:
        dashboard = json.load(f)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"]]
    queried = {m for e in exprs for m in re.findall(r"hisparse_[a-z_]+", e)}
    assert len(queried) >= 12 and queried <= served, queried - served


def test_a_scraper_that_stalls_holds_up_nobody(daemon_factory):
    from tests.conftest import ping

    d = daemon_factory()
    address = os.path.join(os.path.dirname(d.socket), "hisparsed.metrics.sock")
    stalled = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(8)]
    try:
        for s in stalled:
            s.connect(address)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        assert ping(d.socket, 5.0) is not None
        assert "hisparse_uptime_seconds" in scrape(address)
        bad = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bad.connect(address)
        bad.sendall(b"POST /metrics HTTP/1.1\r\n\r\n")
        assert bad.recv(100).startswith(b"HTTP/1.1 405")
        bad.close()
    finally:
        for s in stalled:
            s.close()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("groupadd") is None,
                    reason="a group-restricted namespace needs root and groupadd (CI has both)")
def test_the_metrics_socket_is_the_operators_view(daemon_factory, tmp_path):
    import stat

    from hisparse.paths import read_access_key
    from tests.rawclient import RawClient, keys_for

    group = "hsp-test-metrics"
    subprocess.run(["groupadd", "-f", group], check=True, capture_output=True)
    cfg = tmp_path / "restricted.toml"
    cfg.write_text(f'[namespaces."secret"]\ngroup = "{group}"\ncapacity = 12288\n')
    d = daemon_factory(extra=("--config", str(cfg)))
    address = os.path.join(os.path.dirname(d.socket), "hisparsed.metrics.sock")
    assert stat.S_IMODE(os.stat(address).st_mode) == 0o600  # the daemon's user and root only
    c = RawClient(d.socket)
    try:
        c.hello("secret", hisparse.KVLayout(3, 4, 16), access_key=read_access_key(d.socket, "secret"))
        c.store(keys_for("s", 2), [b"s" * 192, b"t" * 192])
        snap = samples(scrape(address))
    finally:
        c.close()
    # hidden from other tenants' stats, shown to the operator's scrape
    assert value(snap, "hisparse_stored_pages_total", namespace="secret") == 2
