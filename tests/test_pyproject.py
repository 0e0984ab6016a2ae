"""The package's extras install what the code accepts, and scripts/bootstrap installs the same."""

from __future__ import annotations

import os
import re
import tomllib

from hisparse.vllm.versions import TESTED_VLLM_VERSIONS, check_vllm_version

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_vllm_extra_pins_a_version_the_adapter_accepts():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    [pin] = [req for req in extras["vllm"] if re.match(r"vllm\b", req)]
    # exactly one version, and one the adapter's start-up check lets through
    match = re.fullmatch(r"vllm==([0-9][0-9.]*)", pin)
    assert match, f"the vllm extra says {pin!r}: pin one tested version (vllm==X.Y.Z)"
    assert match.group(1) in TESTED_VLLM_VERSIONS
    assert check_vllm_version(match.group(1)) == match.group(1)
    with open(os.path.join(REPO, "scripts", "bootstrap")) as f:
        assert f'"vllm=={match.group(1)}"' in f.read(), "scripts/bootstrap installs another vLLM"
