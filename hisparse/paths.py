"""Where the daemon listens and where clients look: one rule for both sides.

The daemon (``hisparse.daemon``) and the client (``hisparse.client``) never
import each other; both import this.
"""

from __future__ import annotations

import os
import tempfile

SYSTEM_SOCKET = "/run/hisparsed/hisparsed.sock"  # the systemd unit's RuntimeDirectory
SOCKET_ENV = "HISPARSE_SOCKET"
SOCKET_NAME = "hisparsed.sock"


def embedded_socket_path() -> str:
    """The socket of a daemon started without a config: no root, no /run needed.

    ``$XDG_RUNTIME_DIR/hisparsed/hisparsed.sock`` when that directory exists
    and is writable (a per-user tmpfs), else ``<tmp>/hisparsed-$UID/hisparsed.sock``.
    """
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime) and os.access(runtime, os.W_OK):
        return os.path.join(runtime, "hisparsed", SOCKET_NAME)
    return os.path.join(tempfile.gettempdir(), f"hisparsed-{os.getuid()}", SOCKET_NAME)


def daemon_default_socket_path() -> str:
    """The socket of a daemon that neither its flags, env nor config file place.

    ``$HISPARSE_SOCKET`` when set, so that one exported variable puts the
    daemon, ``hisparsectl`` and every client on the same socket; else the
    embedded default.
    """
    return os.environ.get(SOCKET_ENV) or embedded_socket_path()


def default_socket_path() -> str:
    """The socket a client uses when given none.

    ``$HISPARSE_SOCKET``, else the system daemon's socket if it exists, else
    the embedded default.
    """
    from_env = os.environ.get(SOCKET_ENV)
    if from_env:
        return from_env
    if os.path.exists(SYSTEM_SOCKET):
        return SYSTEM_SOCKET
    return embedded_socket_path()
