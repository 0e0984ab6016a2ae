"""Without torch (or matplotlib), torch-only paths raise ``MissingExtra`` naming the extra.

Each check runs in a fresh interpreter where ``sys.modules[name] = None``
makes ``import name`` fail exactly as it does where the package is not
installed; everything else is real: the daemon, the socket, the region.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

ENGINE = textwrap.dedent("""
    import sys
    sys.modules["torch"] = None  # as if torch were not installed
    import numpy as np
    import hisparse
    from hisparse import client

    layout = hisparse.KVLayout(num_layers=2, block_tokens=4, row_bytes=16)
    keys = [bytes([i]) * 32 for i in range(3)]
    pages = np.arange(3 * layout.page_bytes, dtype=np.uint64).astype(np.uint8).reshape(3, -1)
    with client.attach("extras/ns", layout, socket=sys.argv[1], capacity="1MiB") as c:
        assert c.store(keys, pages) == 3            # numpy needs no torch
        out = np.zeros_like(pages)
        assert c.load(keys, out) == 3 and (out == pages).all()
        failures = []
        with c.pin(keys) as p:
            try:
                p.view(0)
            except hisparse.MissingExtra as exc:
                failures.append(str(exc))
        try:
            c.layer_rows(0)
        except hisparse.MissingExtra as exc:
            failures.append(str(exc))
        try:
            c.store([b"x" * 32], [[0] * layout.page_bytes])
        except hisparse.MissingExtra as exc:
            failures.append(str(exc))
    for module in ("hisparse.kernels", "hisparse.client.sparse"):
        try:
            __import__(module)
        except ImportError as exc:  # MissingExtra is an ImportError too
            assert isinstance(exc, hisparse.MissingExtra), type(exc)
            failures.append(str(exc))
    print("\\n".join(failures))
""")


def test_torch_only_paths_name_the_engine_extra(hisparsed):
    r = subprocess.run([sys.executable, "-c", ENGINE, hisparsed.socket], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 5, r.stdout
    for line, what in zip(lines, ("Pin.view()", "Client.layer_rows()", "pages other than a numpy array",
                                  "hisparse.kernels", "hisparse.client.sparse")):
        assert line.startswith(what) and "needs torch" in line and "pip install 'hisparse[engine]'" in line


def test_plan_plot_without_matplotlib_still_prints_the_table(tmp_path):
    pytest.importorskip("torch")
    path = tmp_path / "plan.png"
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from hisparse import cli\n"
            f"sys.exit(cli.main(['plan', '--concurrency', '32', '--plot', {str(path)!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "pip install 'hisparse[plot]'" in r.stderr and "Traceback" not in r.stderr
    assert any(line.split()[:1] == ["32"] for line in r.stdout.splitlines())  # the table is there
    assert not path.exists()
