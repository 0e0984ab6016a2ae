"""hisparsed's start-up warnings name the setting the operator actually used."""

from __future__ import annotations

import os
import shutil
import tempfile

from tests.conftest import Daemon, _shm_base

TOO_MUCH = "4096TiB"  # more than any shm_dir holds: the start-up log must warn


def start(tmp_path, name: str, args: list[str], env: dict[str, str] | None = None) -> str:
    """Start hisparsed with ``args`` (no --capacity unless given), stop it, return its log."""
    shm = tempfile.mkdtemp(prefix="hisparse-test-", dir=_shm_base())
    sock = tmp_path / name / "hisparsed.sock"
    os.makedirs(sock.parent)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("HISPARSED_") and k != "NOTIFY_SOCKET"}
    d = Daemon(str(sock), shm, args, {**full_env, **(env or {})}, str(tmp_path / f"{name}.log"))
    try:
        d.start()
        assert d.stop() == 0
    finally:
        d.kill()
        shutil.rmtree(shm, ignore_errors=True)
    return d.log()


def warning(log: str) -> str:
    return next(line for line in log.splitlines() if "to allocate but" in line)


def test_the_capacity_warning_names_where_the_capacity_came_from(tmp_path):
    config = tmp_path / "hisparsed.toml"
    config.write_text(f'capacity = "{TOO_MUCH}"\n')
    line = warning(start(tmp_path, "file", ["--config", str(config)]))
    assert f"capacity in {config}" in line and "--capacity" not in line
    line = warning(start(tmp_path, "flag", ["--config", str(config), "--capacity", TOO_MUCH]))
    assert "--capacity (" in line and "lower --capacity" in line
    line = warning(start(tmp_path, "env", [], env={"HISPARSED_CAPACITY": TOO_MUCH}))
    assert "HISPARSED_CAPACITY" in line and "--capacity" not in line
