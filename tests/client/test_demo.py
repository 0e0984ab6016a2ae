"""``hisparse demo`` end to end: its own daemon, two engine processes, a table."""

from __future__ import annotations

from hisparse import cli


def test_demo_engines_share_a_prefix(capsys):
    rc = cli.main(["demo", "--layers", "4", "--block-tokens", "16", "--row-bytes", "64",
                   "--prefix-pages", "6", "--suffix-pages", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("engine"))
    header = lines[at].split()
    rows = {line.split()[0]: line.split() for line in lines[at + 1:at + 3]}
    assert header[:5] == ["engine", "pid", "lookups", "keys", "hits"]
    # A finds nothing and stores its 8 blocks; B hits the 6 shared ones and stores its 2
    assert rows["A"][3:5] == ["8", "0"] and rows["B"][3:5] == ["8", "6"]
    assert "yes" in rows["A"] and "yes" in rows["B"]
    assert "the daemon holds 10 pages" in out


def test_bandwidth_benchmark_runs_and_prints_its_ratio():
    import subprocess
    import sys

    from tests.client.engine import REPO

    done = subprocess.run([sys.executable, "benchmarks/bandwidth.py", "--size", "4MiB", "--reps", "2",
                           "--layout", "8,64,656"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("ratio store ") and " load " in last, done.stdout


def test_pieces_benchmark_runs_both_ways_and_prints_its_ratio():
    import re
    import subprocess
    import sys

    from tests.client.engine import REPO

    done = subprocess.run([sys.executable, "benchmarks/pieces.py", "--size", "40MiB", "--reps", "2",
                           "--layout", "8,64,656"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert re.search(r", [2-8] pieces,", lines[0]), lines[0]  # 40 MiB: the call went in pieces
    assert lines[-1].startswith("ratio whole/pieces: store ") and " load " in lines[-1], done.stdout


def test_rpc_processes_benchmark_runs_and_prints_its_ratios():
    import subprocess
    import sys

    from tests.client.engine import REPO

    done = subprocess.run([sys.executable, "benchmarks/rpc_processes.py", "--processes", "2",
                           "--requests", "200", "--batch", "20"],
                          cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    rows = {line.split()[1]: line.split() for line in lines if line.split()[0] == "2"}
    assert {"hisparsed", "python", "bare", "ratio"} <= set(rows), done.stdout
    # every server answered all 2 x 200 lookups: its rate is a positive number
    assert all(float(line.split()[-3]) > 0 for line in lines[2:5]), done.stdout
    assert any(line.startswith("        2 ratio hisparsed/echo: p50 ") for line in lines), done.stdout


def test_loop_stages_benchmark_times_every_stage_of_the_live_loop():
    import subprocess
    import sys

    from tests.client.engine import REPO

    done = subprocess.run([sys.executable, "benchmarks/loop_stages.py", "--requests", "500",
                           "--inflight", "1,4"], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split() for line in done.stdout.strip().splitlines()[2:10]}
    assert set(rows) == {"read", "queue", "decode", "lookup", "encode", "dispatch", "send", "loop"}
    # each stage was timed in the live daemon at both depths: a positive time per request
    for stage in ("read", "decode", "lookup", "encode", "dispatch", "send"):
        warm, one, _, four, _ = map(float, rows[stage][1:])
        assert warm > 0 and one > 0 and four > 0, done.stdout
    assert float(rows["loop"][1]) >= float(rows["dispatch"][2]) > float(rows["decode"][2]), done.stdout
