"""Whether a daemon can answer on a socket path: the endpoint, and what is wrong when none listens.

The transport asks when a request cannot go out (``zmq.Again`` on a socket
with ``ZMQ_IMMEDIATE``): a missing file, a file left by a stopped daemon,
or a socket the caller may not connect to each fail the call at once, with
the next step to take; a daemon that listens but is not connected yet is
waited for. ``hisparsectl`` asks the same before it reports a daemon down.
"""

from __future__ import annotations

import os
import socket

from hisparse.errors import DaemonUnavailable, HisparseError, InvalidArgument, PermissionDenied

__all__ = ["START_HINT", "UNIX_PATH_MAX", "endpoint_for", "listener_problem"]

START_HINT = "start it with `hisparsed` (or `systemctl start hisparsed`)"
UNIX_PATH_MAX = 107  # sun_path is 108 bytes with its NUL


def endpoint_for(socket_path: str) -> str:
    """``ipc://`` endpoint of a socket path; a path too long for a unix socket is refused here."""
    if socket_path.startswith("ipc://"):
        socket_path = socket_path[len("ipc://"):]
    if not socket_path:
        raise InvalidArgument("empty socket path")
    if len(os.fsencode(socket_path)) > UNIX_PATH_MAX:
        raise InvalidArgument(f"socket path is {len(os.fsencode(socket_path))} bytes, over the "
                              f"{UNIX_PATH_MAX} a unix socket allows: {socket_path}")
    return "ipc://" + socket_path


def listener_problem(socket_path: str) -> HisparseError | None:
    """Why no daemon can answer on ``socket_path`` right now, or None if one listens there."""
    if not os.path.exists(socket_path):
        return DaemonUnavailable(f"no hisparsed socket at {socket_path}: is the daemon running? "
                                 f"{START_HINT}, or pass socket=/HISPARSE_SOCKET for another")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(socket_path)
    except PermissionError:
        return PermissionDenied(f"may not connect to {socket_path}: join the daemon's group "
                                "(usermod -aG hisparse $USER) or run as its user")
    except ConnectionRefusedError:
        return DaemonUnavailable(f"nothing listens on {socket_path} (a stopped daemon leaves its "
                                 f"socket): {START_HINT}")
    except OSError as exc:
        return DaemonUnavailable(f"cannot connect to {socket_path}: {exc.strerror or exc}")
    finally:
        probe.close()
    return None
