"""The main job end to end, at a small size: real service, real processes, real pytest."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_runs_every_policy_interleaved_and_reports_the_shared_shape(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "tangram.cli", "demo", "--trajectories", "2", "--turns", "1", "--gap-s", "0.1",
         "--repeats", "2", "--project-cores", "32", "--project-trajectories", "48", "--out", str(out), "--json"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["workload"] == "coding" and doc["reference"] == "tangram" and doc["repeats"] == 2
    ray = importlib.util.find_spec("ray") is not None
    assert list(doc["policies"]) == (["tangram", "ray-tasks", "trajectory"] if ray else ["tangram", "trajectory"])
    for name, p in doc["policies"].items():
        assert len(p["runs"]) == 2 and p["failed"] == 0
        for run in p["runs"]:
            assert run["actions"] == 4 and run["mean_reward"] == 1.0  # the shipped suite really passed
        for key in ("mean_act_s", "p50_act_s", "p99_act_s", "step_time_s"):
            lo, hi = p["spread"][key]
            assert lo <= p[key] <= hi and [r[key] for r in p["runs"]] in ([lo, hi], [hi, lo])
        assert 0 < p["mean_act_s"] and p["step_time_s"] > 0
    assert doc["policies"]["trajectory"]["reward_mean_dop"] == 1.0  # a 1-core pod runs its reward on 1 core
    assert set(doc["ratios"]) == set(doc["policies"]) - {"tangram"}
    r = doc["ratios"]["trajectory"]
    assert r["mean_act"] == round(doc["policies"]["trajectory"]["mean_act_s"] / doc["policies"]["tangram"]["mean_act_s"], 3)
    assert set(r["within_spread"]) == {"mean_act", "p50_act", "p99_act", "step_time"}
    proj = doc["projection"]
    assert proj["simulated"] and proj["cores"] == 32 and proj["trajectories"] == 48
    assert set(proj["policies"]) == set(doc["policies"])
    assert doc["machine"]["cores"] >= 1 and doc["machine"]["parallel_speedup"] > 0
    png = out / "demo.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "interleaved runs" in proc.stdout and "lower is better" in proc.stdout and "SIMULATED" in proc.stdout
    assert "machine:" in proc.stderr and "ideal" in proc.stderr  # the machine was measured first


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
