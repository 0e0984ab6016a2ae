"""The README's python snippets run as written against a quick-start daemon.

The daemon is the one ``hisparsed`` starts without a config (8 GiB in all),
here on a temporary socket and shm directory; each snippet runs in its own
interpreter with ``HISPARSE_SOCKET`` exported, as the README tells a user to.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from hisparse.daemon.conf.config import Config
from hisparse.layout import format_size

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_snippets() -> list[str]:
    with open(os.path.join(REPO, "README.md")) as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), re.S | re.M)


def test_the_readme_has_no_reference_outside_the_repository():
    text = open(os.path.join(REPO, "README.md")).read()
    assert "../" not in text and "/work/" not in text
    for path in re.findall(r"`((?:docs|scripts|systemd|docker|benchmarks)/[\w./-]+)`", text):
        assert os.path.exists(os.path.join(REPO, path)), f"README names {path}, which is not in the repository"


def test_python_snippets_run_as_written(daemon_factory):
    snippets = python_snippets()
    assert snippets, "the README has no python snippet"
    d = daemon_factory(capacity=format_size(Config().capacity_bytes).replace(" ", "").replace(".0", ""))
    env = {**os.environ, "HISPARSE_SOCKET": d.socket}
    for snippet in snippets:
        # the snippet, then a look at what it left in the daemon
        check = ("\nimport json\nfrom hisparse.ctl import Control\nfrom hisparse import protocol\n"
                 "ctl = Control(__import__('os').environ['HISPARSE_SOCKET'])\n"
                 "print(json.dumps(ctl.call(protocol.Op.STATS)['namespaces']))\nctl.close()\n")
        r = subprocess.run([sys.executable, "-c", snippet + check], env=env, capture_output=True,
                           text=True, timeout=120, cwd=REPO)
        assert r.returncode == 0, f"README snippet failed:\n{snippet}\n{r.stderr}"
    stats = __import__("json").loads(r.stdout.splitlines()[-1])
    ns = stats["glm-5.3/fp8_ds_mla/tp8"]
    assert ns["committed_pages"] == 4 and ns["page_bytes"] == 78 * 64 * 656
