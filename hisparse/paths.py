"""Where the daemon listens and where clients look: one rule for both sides.

The daemon (``hisparse.daemon``) and the client (``hisparse.client``) never
import each other; both import this.
"""

from __future__ import annotations

import hashlib
import os
import tempfile

SYSTEM_SOCKET = "/run/hisparsed/hisparsed.sock"  # the systemd unit's RuntimeDirectory
SOCKET_ENV = "HISPARSE_SOCKET"
SOCKET_NAME = "hisparsed.sock"
ACCESS_DIR_NAME = "access"  # beside the socket: one key file per group-restricted namespace


def namespace_tag(namespace: str) -> str:
    """A file-name-safe name for a namespace: 20 hex digits of its SHA-256."""
    return hashlib.sha256(namespace.encode()).hexdigest()[:20]


def access_key_path(socket_path: str, namespace: str) -> str:
    """The key file of a group-restricted namespace (mode 0640, owned by its group).

    Whoever can read it may attach: the kernel vouches that the reader is in
    the namespace's group (or is the daemon's user, or root).
    """
    return os.path.join(os.path.dirname(os.path.abspath(socket_path)), ACCESS_DIR_NAME,
                        f"{namespace_tag(namespace)}.key")


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
    path = embedded_socket_path()
    problem = unsafe_directory(os.path.dirname(path))
    if problem:
        from hisparse.errors import PermissionDenied

        raise PermissionDenied(f"{os.path.dirname(path)} {problem}: another user could stand in for "
                               "hisparsed there; remove it, or set HISPARSE_SOCKET")
    return path


def unsafe_directory(directory: str) -> str | None:
    """Why a per-user socket directory may not be trusted, or None (also when it does not exist).

    Trusted: a real directory owned by this user or root that no one else may write.
    """
    import stat

    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid not in (os.geteuid(), 0):
        return f"is owned by uid {st.st_uid}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def read_access_key(socket_path: str, namespace: str) -> str | None:
    """The namespace's access key when this process may read it; None otherwise (open namespaces)."""
    try:
        with open(access_key_path(socket_path, namespace)) as f:
            return f.read().strip() or None
    except OSError:
        return None
