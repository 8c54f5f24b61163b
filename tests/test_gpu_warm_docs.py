"""What ``docs/results/README.md`` says of the GPU warm start is its stored runs, and they are this code's.

Section "A warm start for GPU nodes": the GPU family with ``policy_stress.py --warm-start`` on four
simulation seeds (``policy-stress/gpu-warm-start-sim-seed-*.json``) against the default runs, and the
built-ins without and with it (``policy-stress/gpu-warm-start-builtins.json``).
"""
from __future__ import annotations

import copy
import json
import re
from dataclasses import replace

import pytest

from tangram.simulator import simulate
from tangram.simulator.policies import policy_spec
from tangram.simulator.workload import builtin_raw, parse_workload
from tests.test_results_docs import RESULTS, _section

STRESS = RESULTS / "policy-stress"
DEFAULT_RUNS = {0: "sim-seed-0.json", 1: "sim-seed-1.json", 2: "gpu-sim-seed-2.json", 3: "gpu-sim-seed-3.json"}
HEADING = "### A warm start for GPU nodes"
MEASURES = ("mean_act_s", "p99_act_s", "step_time_s")


def _cell(summary: dict) -> str:
    over = summary["tangram_over_best"]
    means = " / ".join(f"{over[m]['geomean']:.3f}" for m in MEASURES)
    worst = " / ".join(f"{over[m]['max']:.2f}" for m in MEASURES[:2])
    return f"{summary['losing_like_for_like']} ({summary['dominated_workloads']}); {means}; {worst}"


def _section_text() -> str:
    return _section((RESULTS / "README.md").read_text(), HEADING, "### Told each action's own duration")


def test_the_family_table_is_the_stored_runs():
    rows = [line for line in _section_text().splitlines() if re.match(r"\| \d \|", line)]
    want = []
    for s, name in DEFAULT_RUNS.items():
        warm = json.loads((STRESS / f"gpu-warm-start-sim-seed-{s}.json").read_text())
        default = json.loads((STRESS / name).read_text())
        assert warm["warm_start"] is True and warm["sim_seed"] == default["sim_seed"] == s
        # the same draws, the same baselines' runs: only tangram's differ
        pairs = zip([r for r in warm["workloads"] if r["family"] == "gpu"],
                    [r for r in default["workloads"] if r["family"] == "gpu"])
        for w, d in pairs:
            assert w["workload"] == d["workload"]
            assert {n: v for n, v in w["results"].items() if n != "tangram"} == \
                   {n: v for n, v in d["results"].items() if n != "tangram"}
        want.append(f"| {s} | {_cell(default['summary']['gpu'])} | {_cell(warm['summary']['gpu'])} |")
    assert rows == want


def _label(key: str) -> str:
    name, batch = key.split("@")
    return f"| `{name}` {int(batch):,} |"


def test_the_builtins_table_is_the_stored_runs():
    stored = json.loads((STRESS / "gpu-warm-start-builtins.json").read_text())["points"]
    lines = {line.split(" | ")[0] + " |": line for line in _section_text().splitlines() if line.startswith("| `")}
    for key, run in stored.items():
        cold, warm = run["cold"], run["warm"]
        assert cold[2] == warm[2]  # "the steps do not move"
        want = (f"{_label(key)} {cold[0]:.2f} / {cold[1]:.2f} | {warm[0]:.2f} / {warm[1]:.2f} | {warm[4]} |")
        assert lines[_label(key)] == want, key
    assert len(lines) == len(stored)


@pytest.mark.timeout(120)
def test_a_stored_builtin_point_reruns_to_the_digit():
    stored = json.loads((STRESS / "gpu-warm-start-builtins.json").read_text())["points"]["mopd-skewed@256"]
    raw = copy.deepcopy(builtin_raw("mopd-skewed"))
    raw["trajectories"] = 256
    wl = parse_workload(raw, source="mopd-skewed")
    for key, warm in (("cold", False), ("warm", True)):
        s = simulate(wl, replace(policy_spec("tangram"), gpu_warm=warm), seed=0).summary
        assert [s[m] for m in MEASURES] + [s["gpu_restores"], s.get("gpu_warm_loads")] == stored[key], key
