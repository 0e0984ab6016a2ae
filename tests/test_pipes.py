"""Every command ends quietly when its reader goes away first (``| head -1``): no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hisparse.pipes import EXIT_BROKEN_PIPE


def run_into_a_closed_pipe(*argv: str) -> tuple[int, str]:
    """Run a command whose stdout's reader has already gone: every write meets EPIPE."""
    p = subprocess.Popen([sys.executable, "-m", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # type: ignore[union-attr]
    try:
        err = p.stderr.read().decode()  # type: ignore[union-attr]
        return p.wait(60), err
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("argv", [
    ("hisparse.ctl", "stats"), ("hisparse.ctl", "stats", "--json"),
    ("hisparse.ctl", "top", "--interval", "0.1"),  # would otherwise refresh forever
])
def test_hisparsectl_into_a_closed_pipe(hisparsed, argv):
    rc, err = run_into_a_closed_pipe(argv[0], "--socket", hisparsed.socket, *argv[1:])
    assert rc == EXIT_BROKEN_PIPE and err == "", err


@pytest.mark.parametrize("argv", [
    ("hisparse.cli", "plan", "--scenario", "glm5-1m"), ("hisparse.cli", "--help"),
    ("hisparse.daemon.main", "--help"), ("hisparse.ctl", "--help"),
])
def test_hisparse_and_hisparsed_into_a_closed_pipe(argv):
    rc, err = run_into_a_closed_pipe(*argv)
    assert rc in (0, EXIT_BROKEN_PIPE) and "Traceback" not in err and "BrokenPipe" not in err, err
