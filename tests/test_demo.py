"""The main job end to end, at a small size: real service, real processes, real pytest."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_runs_both_policies_and_writes_chart(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "tangram.cli", "demo", "--trajectories", "2", "--turns", "1", "--gap-s", "0.1",
         "--out", str(out), "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    for policy in ("tangram", "trajectory"):
        s = doc[policy]
        assert s["actions"] == 4 and s["failed"] == 0
        assert s["mean_reward"] == 1.0  # the shipped suite really passed in every trajectory
        assert 0 < s["mean_act_s"] <= s["p99_act_s"] + 1e-9
        assert s["step_time_s"] > 0
    assert doc["trajectory"]["reward_mean_dop"] == 1.0  # a 1-core pod runs its reward on 1 core
    assert doc["ratios"]["mean_act"] > 0
    png = out / "demo.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "policy" in proc.stdout and "mean ACT" in proc.stdout  # the table was printed


def test_demo_rejects_bad_sizes():
    proc = subprocess.run([sys.executable, "-m", "tangram.cli", "demo", "--trajectories", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--trajectories" in (proc.stderr + proc.stdout)


def test_demo_rejects_more_cores_than_this_machine_has():
    import os

    too_many = len(os.sched_getaffinity(0)) + 1
    proc = subprocess.run([sys.executable, "-m", "tangram.cli", "demo", "--cores", str(too_many)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert f"--cores {too_many}" in proc.stderr and "may use only" in proc.stderr


def test_every_option_of_the_user_facing_commands_says_what_it_does():
    from tangram.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name in ("demo", "serve", "tune"):
        parser = sub.choices[name]
        assert parser.description, name
        for action in parser._actions:
            assert action.help, f"tangram {name} {action.option_strings} has no help text"
