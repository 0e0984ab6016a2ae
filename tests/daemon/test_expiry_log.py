"""An engine that exits without close() is routine: its lease expiry is one INFO line."""

from __future__ import annotations

import subprocess
import sys
import time

EXIT_WITHOUT_CLOSE = """
import os, sys
import numpy as np
import hisparse
from hisparse import client
c = client.attach("expiry/ns", hisparse.KVLayout(2, 4, 16), socket=sys.argv[1], capacity="1MiB")
c.store([b"k" * 32], np.zeros((1, 128), dtype=np.uint8))
os._exit(0)  # no close(), no bye: as a crashed or killed engine leaves
"""


def test_a_client_that_exited_is_expired_at_info(daemon_factory):
    d = daemon_factory(lease_ttl=1)
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", EXIT_WITHOUT_CLOSE, d.socket], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
    deadline = time.monotonic() + 30
    while d.log().count("lease expired") < 2:
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.05)
    expiries = [line for line in d.log().splitlines() if "lease expired" in line]
    assert len(expiries) == 2 and all(" INFO " in line for line in expiries), expiries
    assert " WARNING " not in d.log()
