"""Tenants against each other (issue 20, attacks 4-8): a well-behaved engine's stores during each.

    python benchmarks/hostile.py --tenants-only [--seconds 3]

The well-behaved engine (``hisparse.client``, this process's uid) stores and
loads 8-page prefixes of its namespace in a loop; each attack runs beside it
in forked children that drop to another uid (``ATTACKER_UID``) when this runs
as root, as a hostile tenant would (without root they keep this uid: one uid
is one tenant to the daemon, so the engine then shares the attacker's quota).
Each row: the engine's store p50/p99 and pages stored per store (of 8), against
the idle row measured in the same run, and what the attack got.

- 4 fences: list ``fences/``; lock a leaked fence of a dead session (``LOCK_SH``)
  and time until the daemon frees its pages anyway;
- 5 quota: 8 sessions of one process store and pin everything, publish pinned;
- 6 squat: one connection creates 4 KiB namespaces until refused; then the
  config's namespace is attached;
- 7 metrics: scrape the TCP endpoint for the restricted namespace's name;
- 8 silent zero: the attacker pins its share; the engine's stores that come up
  short, and what their replies said (``shortfall``).
"""

from __future__ import annotations

# Imported before any fork: urllib needs this codec, and an attacker child, once it runs
# as ATTACKER_UID, may not be able to read the stdlib's directory to import it then.
import encodings.idna  # noqa: F401
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np

from hisparse import KVLayout, client
from hisparse.local import env_with_package, shm_base
from hisparse.protocol import Op
from hisparse.shm.fence import fence_dir_for

ATTACKER_UID = 4301
LAYOUT = KVLayout(num_layers=2, block_tokens=8, row_bytes=64)  # 1 KiB pages
PAGES = 64
SHARED = "shared"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def tenant_daemon(metrics_port: int) -> Iterator[tuple[str, subprocess.Popen]]:
    """A daemon other users of its group can reach, with a config namespace and a restricted one."""
    run_dir = tempfile.mkdtemp(prefix="hisparse-ten-", dir="/tmp")
    shm_dir = tempfile.mkdtemp(prefix="hisparse-ten-", dir=shm_base())
    os.chmod(run_dir, 0o711)
    os.chmod(shm_dir, 0o711)
    group = __import__("grp").getgrgid(os.getegid()).gr_name
    cfg = os.path.join(run_dir, "h.toml")
    with open(cfg, "w") as f:
        f.write(f'[namespaces."config-ns"]\ncapacity = {PAGES * LAYOUT.page_bytes}\n'
                f'[namespaces."secret-ns"]\ngroup = "{group}"\ncapacity = {PAGES * LAYOUT.page_bytes}\n')
    sock = os.path.join(run_dir, "hisparsed.sock")
    proc = subprocess.Popen([sys.executable, "-m", "hisparse.daemon.main", "--socket", sock, "--shm-dir",
                             shm_dir, "--capacity", "64MiB", "--config", cfg, "--max-namespaces", "16",
                             "--metrics-address", f"127.0.0.1:{metrics_port}", "--log-level", "WARNING"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env_with_package())
    try:
        from hisparse.client.transport import wait_for_daemon

        wait_for_daemon(sock, 30)
        yield sock, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)


@contextmanager
def attacker(fn: Callable[[], Any]) -> Iterator[dict]:
    """``fn`` in a forked child (another uid when root); yields its result while the child holds on."""
    read, write = os.pipe()
    hold_r, hold_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        os.close(hold_w)
        try:
            if os.geteuid() == 0:
                os.setgroups([0])
                os.setgid(0)
                os.setuid(ATTACKER_UID)
            out = {"ok": fn()}
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out = {"error": f"{type(exc).__name__}: {exc}"}
        os.write(write, json.dumps(out).encode() + b"\n")
        os.read(hold_r, 1)
        os._exit(0)
    os.close(write)
    os.close(hold_r)
    try:
        with os.fdopen(read) as f:
            yield json.loads(f.readline() or '{"error": "silent child"}')
    finally:
        os.close(hold_w)
        os.waitpid(pid, 0)


class Raw:
    """A bare protocol session for the attacker (no heartbeat, no fence bookkeeping)."""

    def __init__(self, sock: str, namespace: str | None = SHARED, lock: bool = True) -> None:
        import zmq

        from hisparse import protocol

        self.protocol = protocol
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect("ipc://" + sock)
        self.rid = 0
        self.fence_fd = None
        self.body = self.call(Op.HELLO, namespace=namespace, layout=LAYOUT if namespace else None,
                              capacity_bytes=PAGES * LAYOUT.page_bytes if namespace else None,
                              client="attacker")
        self.session = self.body.get("session")
        self.fence_path = os.path.join(fence_dir_for(sock), self.body.get("fence") or "-")
        if lock and self.body.get("fence"):
            self.lock()

    def lock(self) -> None:
        self.fence_fd = os.open(self.fence_path, os.O_RDONLY | os.O_CLOEXEC)
        fcntl.flock(self.fence_fd, fcntl.LOCK_SH)

    def request(self, op: Op, **fields: Any):
        self.rid += 1
        if op not in (Op.HELLO, Op.PING):
            fields.setdefault("session", self.session)
        self.sock.send(self.protocol.encode_request(op, self.rid, **fields))
        if not self.sock.poll(30_000):
            raise TimeoutError(op.value)
        return self.protocol.decode_reply(self.sock.recv())

    def call(self, op: Op, **fields: Any) -> dict:
        return self.request(op, **fields).result()

    def store(self, keys: list[bytes]) -> int:
        reply = self.request(Op.RESERVE, keys=keys)
        if reply.ok is None:
            return 0
        mine = [k for k, s in zip(keys, reply.ok["slots"]) if s >= 0]
        if mine:
            self.call(Op.COMMIT, keys=mine)
        return len(mine)


def _keys(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i}".encode().ljust(32, b".") for i in range(n)]


class Engine:
    """The well-behaved engine: store then load 8-page prefixes, one after the other."""

    def __init__(self, sock: str) -> None:
        self.client = client.attach(SHARED, LAYOUT, socket=sock, capacity=PAGES * LAYOUT.page_bytes)
        self.round = 0

    def run(self, seconds: float) -> dict[str, float]:
        times, stored, loaded = [], [], []
        pages = np.random.default_rng(0).integers(0, 256, (8, LAYOUT.page_bytes), dtype=np.uint8)
        out = np.empty_like(pages)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.round += 1
            keys = _keys(f"engine{self.round}", 8)
            t0 = time.perf_counter()
            n = self.client.store(keys, pages)
            times.append(time.perf_counter() - t0)
            stored.append(n)
            try:
                loaded.append(self.client.load(keys, out))
            except Exception:  # noqa: BLE001 - a refused load counts as none
                loaded.append(0)
        return {"p50_ms": 1e3 * float(np.percentile(times, 50)), "p99_ms": 1e3 * float(np.percentile(times, 99)),
                "stored": float(np.mean(stored)), "loaded": float(np.mean(loaded)), "stores": len(times)}


def _hog(sock: str) -> dict:
    sessions = [Raw(sock) for _ in range(8)]
    keys = _keys("hog", PAGES)
    for i in range(0, PAGES, 8):
        sessions[0].store(keys[i:i + 8])
    pinned = refused = 0
    for n, s in enumerate(sessions):
        reply = s.request(Op.PIN, keys=keys[8 * n:8 * n + 8])
        pinned += reply.ok["count"] if reply.ok else 0
        refused += reply.ok is None
    spare = sessions[-1]
    slots = spare.request(Op.RESERVE, keys=_keys("placeholder", 4))
    publish = f"reserve refused: {slots.error_code}"
    if slots.ok and slots.ok["slots"]:
        held = [k for k, s in zip(_keys("placeholder", 4), slots.ok["slots"]) if s >= 0]
        publish = spare.request(Op.PUBLISH, keys=held, as_keys=_keys("late", len(held)), pin=True).error_code or "ok"
    return {"pinned": pinned, "refused_pins": refused, "publish_pin": publish}


def _squat(sock: str) -> dict:
    s = Raw(sock, None)
    made, refusal = 0, ""
    for i in range(64):
        reply = s.request(Op.HELLO, namespace=f"squat-{i}", layout=LAYOUT, capacity_bytes=4096, client="squat")
        if reply.ok is None:
            refusal = reply.error_code or ""
            break
        made += 1
    return {"created": made, "refused_with": refusal}


def _list_and_lock(sock: str, leaked: str) -> dict:
    try:
        listed = f"listed {len(os.listdir(fence_dir_for(sock)))}"
    except PermissionError:
        listed = "denied"
    fd = os.open(leaked, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    return {"list": listed, "locked_leaked": True}


def _scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {"secret_visible": "secret-ns" in text, "shared_visible": f'"{SHARED}"' in text}


def _row(name: str, m: dict[str, float], note: str) -> str:
    return (f"{name:<22} {m['p50_ms']:>8.2f} {m['p99_ms']:>8.2f} {m['stored']:>7.2f} {m['loaded']:>7.2f} "
            f"{m['stores']:>7d}  {note}")


def run(seconds: float) -> None:
    port = _free_port()
    who = f"uid {ATTACKER_UID}" if os.geteuid() == 0 else "this uid (not root: one tenant)"
    with tenant_daemon(port) as (sock, proc):
        engine = Engine(sock)
        secret = client.attach("secret-ns", LAYOUT, socket=sock)  # a member of its group works in it
        print(f"tenant attacks (4-8) as {who}; engine stores 8-page prefixes of a {PAGES}-page region; "
              f"{seconds:.0f}s a scenario")
        print(f"{'scenario':<22} {'store p50':>8} {'p99 ms':>8} {'stored':>7} {'loaded':>7} {'stores':>7}  attack")
        print(_row("idle", engine.run(seconds), ""))
        with attacker(lambda: _hog(sock)) as got:
            print(_row("5 quota bypass", engine.run(seconds), json.dumps(got.get("ok", got))))
        with attacker(lambda: _hog(sock)) as got:
            probe = Raw(sock)  # the engine's uid, as the engine's next large store would be
            short = probe.call(Op.RESERVE, keys=_keys("probe", PAGES))
            probe.call(Op.ABORT, keys=_keys("probe", PAGES), missing_ok=True)
            os.close(probe.fence_fd)
            probe.call(Op.BYE)
            why = short.get("shortfall") or {}
            print(_row("8 silent zero", engine.run(seconds),
                       f"a {PAGES}-key reserve got {len(short['slots'])}, shortfall by "
                       f"{why.get('by')} ({why.get('limit')})"))
        dead = Raw(sock, lock=False)  # locked after the fork: the attacker inherits no lock of its own
        with attacker(lambda: _list_and_lock(sock, dead.fence_path)) as got:
            dead.lock()
            dead.store(_keys("dead", 8))
            dead.call(Op.PIN, keys=_keys("dead", 8))
            os.close(dead.fence_fd)
            dead.call(Op.BYE)
            t0 = time.monotonic()
            admin = Raw(sock, None)
            while admin.call(Op.STATS)["daemon"]["fenced_sessions"] and time.monotonic() - t0 < 30:
                time.sleep(0.02)
            freed = time.monotonic() - t0
            print(_row("4 fence locks", engine.run(seconds),
                       f"{json.dumps(got.get('ok', got))}; dead session's pages freed in {freed:.2f}s"))
        with attacker(lambda: _squat(sock)) as got:
            m = engine.run(seconds)
            t0 = time.perf_counter()
            ok = client.attach("config-ns", LAYOUT, socket=sock)
            attach_ms = 1e3 * (time.perf_counter() - t0)
            ok.close()
            print(_row("6 namespace squat", m, f"{json.dumps(got.get('ok', got))}; config-ns attached "
                                               f"in {attach_ms:.1f} ms"))
        with attacker(lambda: _scrape(port)) as got:
            print(_row("7 metrics over TCP", engine.run(seconds), json.dumps(got.get("ok", got))))
        secret.close()
        engine.client.close()
