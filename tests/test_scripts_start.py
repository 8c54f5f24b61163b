"""Every script under scripts/ starts (a syntax or import error in a benchmark is found here, not by
the next person who runs it), and the throwaway services the benchmarks start keep their state in a
directory of their own that is gone afterwards."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p.name for p in (REPO / "scripts").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_answers_help(script):
    r = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--help"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage:" in r.stdout


def test_bench_api_quota_short_run_keeps_its_state_to_itself(tmp_path):
    # the default state directory would be $XDG_STATE_HOME/tangram/<key>: the benchmark must not use it
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "xdg"), "TMPDIR": str(tmp_path / "tmp")}
    env.pop("TANGRAM_STATE_DIR", None)
    (tmp_path / "tmp").mkdir()
    r = subprocess.run([sys.executable, "scripts/bench_api_quota.py", "--runs", "1", "--callers", "6",
                        "--concurrency", "2", "--quota", "4", "--period-s", "1", "--latency-s", "0.01", "0.02"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert [run["books"] for run in out["runs"]] == ["adaptive", "conservative"]
    for run in out["runs"]:
        assert run["failed"] == 0 and run["caller_429s"] == 0 and run["upstream_429s_sent"] == 0, out
        assert run["peak_concurrency"] <= 2 and run["max_arrivals_in_any_period"] <= 4, out
    assert not (tmp_path / "xdg").exists()
    assert list((tmp_path / "tmp").iterdir()) == []
