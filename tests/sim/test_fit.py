"""A refused setup comes with changes that run: each suggested flag set, added to the command, plans."""

from __future__ import annotations

import re

import pytest

from hisparse.sim import plan_cli


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = plan_cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def suggestions(err: str) -> list[list[str]]:
    """The flag sets after "Add ... or ...", each as argv."""
    added = re.search(r"Add (.*?)(?: \(|$)", err.strip()).group(1)  # type: ignore[union-attr]
    return [option.split() for option in added.split(" or ")]


@pytest.mark.parametrize("argv", [("--gpu", "h100"), ("--model", "deepseek-v3.2", "--gpu", "h100"),
                                  ("--gpu", "h100", "--gpus", "16"), ("--tp", "4"), ("--gpus", "12")])
def test_every_suggestion_for_a_refused_setup_plans(capsys, argv):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == "" and "Traceback" not in err
    options = suggestions(err)
    assert options, err
    for option in options:
        # the closed form only (no sweep): what the refusal was about
        rc, out, err2 = run(capsys, *argv, *option, "--concurrency", "1", "--json")
        assert rc == 0, f"{argv} + {option} suggested by:\n{err}\nfails with:\n{err2}"


def test_more_gpus_is_suggested_with_the_replicas_that_use_them(capsys):
    rc, _, err = run(capsys, "--gpu", "h100")
    assert rc == 2 and "--gpus 16 --dp 2" in err
    rc, _, err = run(capsys, "--gpu", "h100", "--gpus", "16")
    assert rc == 2 and "tp*dp = 8*1 != 16 GPUs" in err and "--tp 8 --dp 2" in err
