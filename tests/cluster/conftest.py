"""Two "nodes" on one machine: a real mooncake_master and two hisparsed with their own dirs.

Each daemon runs its cluster tier (the real Mooncake client and transfer
engine, TCP on loopback) and lends the cluster a memory segment of its own,
as one hisparsed per node would. Processes are started and stopped by pid.
Every test that needs the cluster is skipped, with the reason, where the
Mooncake wheel cannot be loaded.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from hisparse.cluster import mooncake
from hisparse.ctl import Control
from hisparse.protocol import Op


try:
    mooncake.load()
    SKIP_REASON = ""
except mooncake.ClusterUnavailableError as exc:
    SKIP_REASON = str(exc)

# test modules here set ``pytestmark = requires_mooncake``
requires_mooncake = pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_for(what: str, ready, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached in {timeout_s:.0f} s")
        time.sleep(0.02)


@dataclass
class Master:
    """A real ``mooncake_master`` with its HTTP metadata server, restartable on the same ports."""

    rpc_port: int
    meta_port: int
    metrics_port: int
    log_path: str
    proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.meta_port}/metadata"

    def start(self) -> Master:
        binary = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [binary, "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                 f"--http_metadata_server_port={self.meta_port}", "--rpc_address=127.0.0.1",
                 f"--rpc_port={self.rpc_port}", "--metrics_host=127.0.0.1",
                 f"--metrics_port={self.metrics_port}", "--enable_metric_reporting=false",
                 "--default_kv_lease_ttl=500"],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **mooncake.QUIET_ENV})
        wait_for("mooncake_master", lambda: listening(self.rpc_port) and listening(self.meta_port))
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def master(tmp_path) -> Iterator[Master]:
    m = Master(free_port(), free_port(), free_port(), str(tmp_path / "mooncake_master.log")).start()
    yield m
    m.kill()


def cluster_env(master: Master, **extra: str) -> dict[str, str]:
    env = {"HISPARSED_CLUSTER_BACKEND": "mooncake", "HISPARSED_CLUSTER_MASTER": master.address,
           "HISPARSED_CLUSTER_METADATA_SERVER": master.metadata,
           "HISPARSED_CLUSTER_LOCAL_HOSTNAME": "127.0.0.1",
           "HISPARSED_CLUSTER_SEGMENT_SIZE": "64MiB", "HISPARSED_CLUSTER_TIMEOUT": "5",
           **mooncake.QUIET_ENV}
    env.update({f"HISPARSED_CLUSTER_{k.upper()}": v for k, v in extra.items()})
    return env


@pytest.fixture
def planter(master) -> Iterator:
    """A bare Mooncake client of the test's own: puts values straight into the cluster."""
    import numpy as np

    store = mooncake.load().MooncakeDistributedStore()
    assert store.setup("127.0.0.1", master.metadata, 0, 16 << 20, "tcp", "", master.address) == 0
    buf = np.zeros(1 << 20, dtype=np.uint8)
    assert store.register_buffer(buf.ctypes.data, buf.nbytes) == 0

    def plant(key: str, value: bytes) -> None:
        buf[:len(value)] = np.frombuffer(value, dtype=np.uint8)
        assert store.batch_put_from([key], [buf.ctypes.data], [len(value)]) == [0]

    plant.store = store  # type: ignore[attr-defined]
    yield plant
    store.close()


@pytest.fixture
def nodes(daemon_factory, master):
    """``nodes(n, capacity=..., **cluster_keys)``: n daemons on the master, each its own dirs."""
    def make(n: int = 2, capacity: str = "128MiB", **extra: str):
        made = [daemon_factory(capacity=capacity, lease_ttl=5, env=cluster_env(master, **extra),
                               extra=("--default-namespace-capacity", "32MiB"))
                for _ in range(n)]
        for d in made:  # connected, its segment mounted: a put may land in it
            wait_for("the cluster tier up", lambda: cluster_state(d.socket) == "up")
        return made
    return make


def cluster_stats(socket_path: str) -> dict:
    """The daemon's cluster tier counters (``stats``' ``daemon.cluster``)."""
    ctl = Control(socket_path)
    try:
        return ctl.call(Op.STATS)["daemon"]["cluster"]
    finally:
        ctl.close()


def cluster_state(socket_path: str) -> str:
    return str(cluster_stats(socket_path)["state"])
