"""A watch on the descriptor table from outside the event loop: closes the door in time.

libzmq accepts connections on its own I/O thread, as fast as peers connect,
and aborts the whole process when ``accept`` meets EMFILE. The connection
guard (``daemon.connections``) closes the door (the socket file's mode to 0)
when it reads the accept events, but it reads them on the event loop, which a
busy batch or a loaded machine delays; a flood of connects can use up the
headroom meanwhile. This thread does not wait for the loop: every
``INTERVAL_S`` (``FAR_INTERVAL_S`` while more than ``FAR_FDS`` below the
budget) it asks the kernel for the lowest free descriptor (a ``dup``, closed
at once). The kernel hands out the lowest free number, so once a
flood has filled the holes that number is the count in use; at the budget
the door is shut from here, and the guard, on the
loop, reopens it only after a real count says there is room again.

Its cost is one ``dup`` + ``close`` per interval and a brief hold of the GIL
(50 a second on a daemon far from its limit).
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

INTERVAL_S = 0.002
FAR_INTERVAL_S = 0.02  # while more than FAR_FDS below the threshold
FAR_FDS = 4096  # more connections than a flood completes in FAR_INTERVAL_S
MODE_LOCK = threading.Lock()  # the socket file's mode and its ACL (front.uid_door) change under it


class DoorWatch:
    def __init__(self, path: str, threshold: int, on_closed) -> None:
        self.path = path
        self.threshold = threshold  # lowest free descriptor at which the door shuts
        self.on_closed = on_closed  # called (from this thread) after it shut the door
        self.watching = True  # the guard clears it while the door is shut
        self._stop = threading.Event()
        self._probe = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="hisparsed-door", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        interval_s = INTERVAL_S
        while not self._stop.wait(interval_s):
            if not self.watching:
                continue
            try:
                fd = os.dup(self._probe)
            except OSError:  # EMFILE itself: shut at once
                fd = self.threshold
            else:
                os.close(fd)
            interval_s = INTERVAL_S if fd + FAR_FDS >= self.threshold else FAR_INTERVAL_S
            if fd >= self.threshold and self.watching:
                self.watching = False
                try:
                    with MODE_LOCK:
                        os.chmod(self.path, 0)
                except OSError:
                    log.exception("could not close the socket to new connections")
                    continue
                log.warning("closed the socket to new connections: descriptor %d is the lowest "
                            "free (door watch)", fd)
                self.on_closed()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(1.0)
        os.close(self._probe)
