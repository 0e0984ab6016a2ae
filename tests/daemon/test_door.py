"""The door watch: shuts the socket file's mode from its own thread when descriptors run out."""

from __future__ import annotations

import os
import stat
import threading

from hisparse.daemon.front.door import DoorWatch
from tests.waiting import wait_for


def test_the_watch_shuts_the_door_past_its_threshold_without_the_loop(tmp_path):
    path = tmp_path / "s.sock"
    path.touch()
    path.chmod(0o660)
    shut = threading.Event()
    watch = DoorWatch(str(path), 1 << 30, shut.set)  # (it holds a descriptor of its own)
    probe = os.open(os.devnull, os.O_RDONLY)
    os.close(probe)  # the lowest free descriptor now
    watch.threshold = probe + 64  # other threads of this process may take a few meanwhile
    held: list[int] = []
    try:
        watch.start()
        assert not shut.wait(0.1) and stat.S_IMODE(path.stat().st_mode) == 0o660  # room: open
        held = [os.open(os.devnull, os.O_RDONLY) for _ in range(80)]  # a flood fills the table
        wait_for(shut.is_set, "the watch to shut the door", timeout_s=30)
        assert stat.S_IMODE(path.stat().st_mode) == 0 and not watch.watching
    finally:
        watch.close()
        for fd in held:
            os.close(fd)
