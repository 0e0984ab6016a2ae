"""Stats name the processes that really hold a fence: a forked helper that outlives its engine.

An flock belongs to the open file description, which fork shares; /proc/locks
keeps naming the process that took it, even once it is dead. The daemon
finds the holders in /proc/<pid>/fdinfo (see hisparse.daemon.policy.proclocks).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from hisparse.ctl import Control
from hisparse.protocol import Op
from tests.waiting import wait_for

ENGINE = textwrap.dedent("""
    import os, sys, time
    from hisparse import KVLayout
    from hisparse.protocol import Op
    from tests.rawclient import RawClient, keys_for
    c = RawClient(sys.argv[1])
    c.hello("ns", KVLayout(3, 4, 16), 192 * 16)  # locks the session's fence (LOCK_SH)
    c.call(Op.RESERVE, keys=keys_for("mid-copy", 2))  # pages the helper may still write
    child = os.fork()  # the helper shares the locked open file description
    if child == 0:
        time.sleep(120)
        os._exit(0)
    print(os.getpid(), child, flush=True)
    time.sleep(120)
""")


def sessions(socket: str) -> list[dict]:
    """The session rows hisparsectl stats --json shows (its own client, in this process)."""
    ctl = Control(socket)
    try:
        return [s for s in ctl.call(Op.STATS)["sessions"] if s["namespace"] == "ns"]
    finally:
        ctl.close()


def test_a_forked_helper_that_outlives_its_engine_is_named_as_the_holder(daemon_factory):
    d = daemon_factory(lease_ttl=1.0)
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, d.socket], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    child = 0
    try:
        engine_pid, child = map(int, engine.stdout.readline().split())
        wait_for(lambda: [s["pids"] for s in sessions(d.socket)] == [sorted([engine_pid, child])],
                 "both processes named while both hold the fence")
        engine.send_signal(signal.SIGKILL)
        engine.wait(10)
        # the session expires; its fence stays locked by the helper, which stats must name
        wait_for(lambda: [(s["state"], s["pids"]) for s in sessions(d.socket)] == [("fenced", [child])],
                 "the fenced session naming its live holder, not the dead engine")
        human = subprocess.run([sys.executable, "-m", "hisparse.ctl", "--socket", d.socket, "sessions"],
                               capture_output=True, text=True, check=True, timeout=30).stdout
        # the client column says "test pid <engine>": the pids column follows the state
        pids_column = human.splitlines()[1].split(" fenced ")[1].split()[0]
        assert pids_column == str(child), human
        os.kill(child, signal.SIGKILL)
        child = 0
        wait_for(lambda: sessions(d.socket) == [], "the fence released once the helper is gone")
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait(10)
        if child:
            os.kill(child, signal.SIGKILL)
