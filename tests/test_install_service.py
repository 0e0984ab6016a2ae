"""scripts/install-service and uninstall-service, staged into a temporary root.

The staged venv is a real one (pip installs this checkout and its
dependencies), its daemon serves a real ping, and the staged unit passes
``systemd-analyze verify``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from tests.conftest import ping

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALL = os.path.join(REPO, "scripts", "install-service")
UNINSTALL = os.path.join(REPO, "scripts", "uninstall-service")


def run(*cmd: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=300, env=env)


def clean_env() -> dict[str, str]:
    """No PYTHONPATH: the staged venv must run on what it installed."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def staged_daemon_answers(venv_bin: str, run_dir: str, shm: str | None) -> None:
    sock = os.path.join(run_dir, "hisparsed.sock")
    made_shm = shm is None
    if shm is None:
        shm = tempfile.mkdtemp(prefix="hisparse-test-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    proc = subprocess.Popen([os.path.join(venv_bin, "hisparsed"), "--socket", sock, "--shm-dir", shm,
                             "--capacity", "16MiB"], env=clean_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not (os.path.exists(sock) and ping(sock, 0.2)):
            assert proc.poll() is None and time.monotonic() < deadline, "the staged hisparsed did not start"
            time.sleep(0.05)
        r = run(os.path.join(venv_bin, "hisparsectl"), "--socket", sock, "ping", env=clean_env())
        assert r.returncode == 0 and f"pid {proc.pid}" in r.stdout, r.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
        if made_shm:
            shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.slow
def test_install_into_a_temporary_root_then_uninstall(tmp_path):
    root = tmp_path / "root"
    r = run(INSTALL, "--root", str(root), "--python", sys.executable)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "systemd-analyze verify: ok" in r.stdout  # the script fails (set -e) if verify does

    unit = (root / "etc/systemd/system/hisparsed.service").read_text()
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    binary = exec_start.split("=", 1)[1].split()[0]
    assert binary == "/opt/hisparse/venv/bin/hisparsed"
    assert os.access(f"{root}{binary}", os.X_OK)
    doc = next(line for line in unit.splitlines() if line.startswith("Documentation="))
    assert os.path.isfile(str(root) + doc.removeprefix("Documentation=file://"))
    # every doc file deploy.md names is in the doc folder, the Grafana dashboard too
    named = set(re.findall(r"`docs/([\w.-]+\.(?:md|json))`", open(os.path.join(REPO, "docs/deploy.md")).read()))
    assert "grafana-hisparse.json" in named
    assert named <= set(os.listdir(root / "opt/hisparse/doc")), named - set(os.listdir(root / "opt/hisparse/doc"))
    assert (root / "etc/hisparse/hisparsed.toml").read_text() == \
        open(os.path.join(REPO, "systemd/hisparsed.toml")).read()
    assert os.readlink(root / "usr/local/bin/hisparsectl") == "/opt/hisparse/venv/bin/hisparsectl"

    # the tmpfiles entry, applied to the staged root with its own users
    tmpfiles = shutil.which("systemd-tmpfiles")
    run_dir, shm_dir = str(tmp_path / "run"), None
    if tmpfiles is not None:
        (root / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\nhisparse:x:990:990::/nonexistent:/usr/sbin/nologin\n")
        (root / "etc/group").write_text("root:x:0:\nhisparse:x:990:\n")
        r = run(tmpfiles, f"--root={root}", "--create", "hisparse.conf")  # found under the root
        assert r.returncode == 0, r.stderr
        for made in ("run/hisparsed", "dev/shm/hisparse"):
            st = os.stat(root / made)
            assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o750, 990, 990), made
            os.chown(root / made, os.geteuid(), 990)  # the daemon runs as their owner: here, this user
        run_dir, shm_dir = str(root / "run/hisparsed"), str(root / "dev/shm/hisparse")
    # the staged venv's daemon serves from what tmpfiles made (it refuses unsafe directories)
    staged_daemon_answers(str(root / "opt/hisparse/venv/bin"), run_dir, shm_dir)

    # a second install keeps an edited config and puts the shipped one beside it
    (root / "etc/hisparse/hisparsed.toml").write_text('capacity = "1TiB"\n')
    r = run(INSTALL, "--root", str(root), "--python", sys.executable, "--pip-arg", "--no-deps")
    assert r.returncode == 0, r.stderr
    assert (root / "etc/hisparse/hisparsed.toml").read_text() == 'capacity = "1TiB"\n'
    assert (root / "etc/hisparse/hisparsed.toml.new").exists()

    r = run(UNINSTALL, "--root", str(root))
    assert r.returncode == 0, r.stderr
    assert not (root / "opt/hisparse").exists()
    assert not (root / "etc/systemd/system/hisparsed.service").exists()
    assert not (root / "usr/local/bin/hisparsectl").is_symlink()
    assert (root / "etc/hisparse/hisparsed.toml").exists()  # kept without --purge
    r = run(UNINSTALL, "--root", str(root), "--purge")
    assert r.returncode == 0 and not (root / "etc/hisparse").exists()


def test_an_old_python_is_refused_before_anything_is_installed(tmp_path):
    old = shutil.which("python3.10") or "/bin/false"  # false: as refused as a 3.10 would be
    r = run(INSTALL, "--root", str(tmp_path / "root"), "--python", old)
    assert r.returncode == 1 and "needs Python 3.11 or newer" in r.stderr
    assert not (tmp_path / "root").exists()


def test_the_unit_names_what_the_install_puts_there():
    unit = open(os.path.join(REPO, "systemd/hisparsed.service")).read()
    assert "ExecStart=/opt/hisparse/venv/bin/hisparsed --config /etc/hisparse/hisparsed.toml" in unit
    assert "Documentation=file:///opt/hisparse/doc/deploy.md" in unit
    assert os.path.isfile(os.path.join(REPO, "docs/deploy.md"))  # what install-service copies there
