"""SIGTERM completes whatever the connection churn (issue 38, item 9).

libzmq sends each monitor event with a blocking send while it holds the
router's monitor lock. Once the daemon's loop stops reading events (after
SIGTERM, while a namespace's region is still being allocated), a thousand
connects and closes by any local peer used to fill the monitor's pipe:
``disable_monitor()`` then waited on that lock forever, and the daemon never
exited nor removed its socket and token files.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import zmq

from hisparse import protocol
from hisparse.layout import KVLayout
from hisparse.protocol import Op
from tests.conftest import ping

# Each churner connects and closes a plain unix socket in a loop (every one is an
# accept and a disconnect event in the daemon) until the stop file appears.
CHURN = """
import os, socket, sys
path, stop, count = sys.argv[1], sys.argv[2], 0
while not os.path.exists(stop):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        count += 1
    except OSError:
        pass
    s.close()
    if count % 100 == 0:
        with open(stop + ".count." + str(os.getpid()), "w") as f:
            f.write(str(count))
"""
CHURNERS = 2
EXIT_BOUND_S = 90.0  # generous: the region's allocation and the flush on a busy 2-core box


def _churned(stop: str) -> int:
    total = 0
    directory = os.path.dirname(stop)
    for name in os.listdir(directory):
        if name.startswith(os.path.basename(stop) + ".count."):
            try:
                with open(os.path.join(directory, name)) as f:
                    total += int(f.read() or 0)
            except (OSError, ValueError):
                pass
    return total


def test_sigterm_under_connection_churn_exits_and_cleans_up(daemon_factory, tmp_path):
    daemon = daemon_factory(capacity="2GiB")
    token = os.path.join(os.path.dirname(daemon.socket), "hisparsed.token")
    assert os.path.exists(token)
    stop = str(tmp_path / "stop")
    churners = [subprocess.Popen([sys.executable, "-c", CHURN, daemon.socket, stop])
                for _ in range(CHURNERS)]
    creator = zmq.Context.instance().socket(zmq.DEALER)
    creator.setsockopt(zmq.LINGER, 0)
    try:
        deadline = time.monotonic() + 60
        while _churned(stop) < 1000:  # the churn is on before SIGTERM arrives
            assert time.monotonic() < deadline, "the churners never connected"
            time.sleep(0.01)
        assert ping(daemon.socket, 5.0) is not None
        # A 1 GiB namespace, allocated off the loop: SIGTERM waits for it while the
        # loop no longer reads connection events, and the churn goes on meanwhile.
        layout = KVLayout(num_layers=64, block_tokens=64, row_bytes=1024)
        creator.connect("ipc://" + daemon.socket)
        creator.send(protocol.encode_request(Op.HELLO, 1, namespace="churn/1gib", layout=layout,
                                             capacity_bytes=1 << 30, client="churn test"))
        time.sleep(0.05)
        churned_at_term = _churned(stop)
        daemon.proc.send_signal(signal.SIGTERM)
        try:
            code = daemon.proc.wait(EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            churned = _churned(stop) - churned_at_term
            daemon.proc.send_signal(signal.SIGKILL)  # by pid: the daemon this test started
            daemon.proc.wait(10)
            raise AssertionError(f"hisparsed did not exit within {EXIT_BOUND_S}s of SIGTERM "
                                 f"({churned} connects since):\n{daemon.log()[-3000:]}")
        assert code == 0, daemon.log()[-3000:]
        assert "stopped (SIGTERM)" in daemon.log()
        assert not os.path.exists(daemon.socket)
        assert not os.path.exists(token)
    finally:
        open(stop, "w").close()
        for proc in churners:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        creator.close(linger=0)
