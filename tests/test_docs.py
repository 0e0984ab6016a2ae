"""The user docs agree with the code and with each other."""

from __future__ import annotations

import argparse
import glob
import os
import re

from hisparse import ctl
from hisparse.daemon.conf import config
from hisparse.protocol import ADMIN_OPS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_DOCS = [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))),
             os.path.join(REPO, "systemd", "hisparsed.toml")]


def read(*path: str) -> str:
    with open(os.path.join(REPO, *path)) as f:
        return f.read()


def test_no_user_doc_speaks_of_issue_numbers():
    for path in USER_DOCS:
        found = re.findall(r"(?i)\bissue\s*#?\d+|\(item \d+\)", read(path))
        assert not found, f"{os.path.relpath(path, REPO)} refers to {found}: say what it means instead"


def test_design_lists_every_admin_op_and_the_shipped_host_pool_adapter():
    design = read("docs", "design.md")
    for op in ADMIN_OPS:
        assert f"`{op.value}`" in design.split("## Wire protocol", 1)[1].split("\n## ", 1)[0], op
    assert "later adapter" not in design and "hisparse.vllm.hisparse_connector" in design
    assert "/tmp/hisparsed-$UID/hisparsed.sock" in design and "$XDG_RUNTIME_DIR/hisparsed" in design


def test_readme_and_deploy_name_what_sighup_reloads():
    toml_key = {field: key for key, (field, _) in config._KEYS.items()}
    for path in (("README.md",), ("docs", "deploy.md")):
        text = " ".join(read(*path).split())
        sentence = text[text.index("(SIGHUP)"):][:400]
        for field in config.RELOADABLE:
            assert f"`{toml_key[field]}`" in sentence, (path, field, sentence)


def test_readme_synopsis_has_every_hisparsed_flag(capsys):
    from hisparse.daemon import main

    synopsis = read("README.md").split("## Command line", 1)[1].split("```", 2)[1]
    try:
        main.parse_args(["--help"])
    except SystemExit:
        pass
    flags = set(re.findall(r"(--[a-z][a-z-]+)", capsys.readouterr().out)) - {"--help"}
    assert flags and all(flag in synopsis for flag in flags), sorted(f for f in flags if f not in synopsis)


def test_readme_synopsis_has_every_hisparsectl_flag():
    readme = read("README.md")
    synopsis = readme.split("## Command line", 1)[1].split("```", 2)[1]
    parser = ctl._parser()
    flags = [a.option_strings for a in parser._actions if a.option_strings and a.dest != "help"]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags += [a.option_strings for a in sub._actions if a.option_strings and a.dest != "help"]
    for options in flags:
        assert any(o in synopsis for o in options), f"README's synopsis lacks {options}"
