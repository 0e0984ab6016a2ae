"""The scripts a newcomer runs first say what they do: ``scripts/test --help``."""

from __future__ import annotations

import os
import re
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_scripts_test_help_is_its_own_usage():
    for flag in ("--help", "-h"):
        r = subprocess.run([os.path.join(REPO, "scripts", "test"), flag], capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("usage: scripts/test [PYTEST-ARGUMENTS...]")
        assert "scripts/test tests/daemon -k fence" in r.stdout and "goes to pytest" in r.stdout
        assert "bootstrap" in r.stdout and r.stderr == ""  # it said what it does, and ran nothing


def test_the_readme_says_how_to_run_a_subset_and_ci_runs_its_test_command():
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    setup = readme.split("## Set up", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```\n(.*?)^```", setup, re.S | re.M)
    assert [b.strip() for b in blocks] == ["scripts/bootstrap && .venv/bin/hisparsed", "scripts/test"]
    assert "scripts/test tests/daemon -k fence" in setup and "pip install ." in setup
    with open(os.path.join(REPO, ".ci", "run")) as f:
        assert f.read().rstrip().endswith("exec scripts/test")
