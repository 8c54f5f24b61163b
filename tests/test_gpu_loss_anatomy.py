"""``scripts/gpu_loss_anatomy.py`` and what ``docs/results/README.md`` says of its stored runs.

The section "GPU: what the losses to `static-services` are made of" quotes
``docs/results/policy-stress/gpu-loss-anatomy-sim-seed-{0,1}.json``; its table is computed here
from those files, the files' cheapest draw is rerun to the digit, and the script's own arguments
are checked.
"""
from __future__ import annotations

import json
import re
import sys

import pytest

from tests.test_results_docs import RESULTS, _section
from tests.test_simulator_scripts import ROOT

sys.path.append(str(ROOT / "scripts"))  # last: nothing of the scripts shadows a module of the tests
import gpu_loss_anatomy as anatomy  # noqa: E402

B = anatomy.BASELINE
STORED = {s: RESULTS / "policy-stress" / f"gpu-loss-anatomy-sim-seed-{s}.json" for s in (0, 1)}
HEADING = "### GPU: what the losses to `static-services` are made of"


def _ratios(t, b) -> str:
    return " / ".join(f"{x / y:.2f}" for x, y in zip(t, b))


def _row(draw: dict, sim_seed: int) -> str:
    later = "; ".join(
        f"{_ratios([p['tangram']['mean_act_s'], p['tangram']['p99_act_s']], [p[B]['mean_act_s'], p[B]['p99_act_s']])}"
        f" ({p['tangram']['restores']})" for p in draw["per_step"][1:])
    best = " / ".join(f"{v:.2f}" for v in draw["grid_best"]["ratios"])
    return (f"| {draw['seed']}, {sim_seed} | {_ratios(draw['one_step']['tangram'], draw['one_step'][B])} | "
            f"{_ratios(draw['free_restores']['tangram'], draw['free_restores'][B])} | {later} | {best} |")


def test_the_sections_table_is_the_stored_runs():
    doc = (RESULTS / "README.md").read_text()
    section = _section(doc, HEADING, "### Told each action's own duration")
    rows = [line for line in section.splitlines() if re.match(r"\| \d+, \d+ \|", line)]  # "| draw, seed |"
    want = []
    for s, path in STORED.items():
        stored = json.loads(path.read_text())
        assert stored["sim_seed"] == s and stored["steps"] == 4 and stored["grid"]["settings"] == 160
        for draw in stored["draws"]:
            assert draw["dominated_by"] == [B], draw["seed"]  # the draws the section is about
            assert draw["grid_within_tolerance"] == 0, draw["seed"]  # "no setting reaches it"
            want.append(_row(draw, s))
    assert rows == want


def test_the_stored_draws_are_every_dominated_draw_of_the_policy_stress_runs():
    """The same draws as the stored family runs name, seed by seed, at the same one-step results."""
    for s, path in STORED.items():
        family = json.loads((RESULTS / "policy-stress" / f"sim-seed-{s}.json").read_text())
        dominated = {r["seed"]: r for r in family["workloads"] if r["family"] == "gpu" and r["dominated_by"]}
        stored = {d["seed"]: d for d in json.loads(path.read_text())["draws"]}
        assert set(stored) == set(dominated)
        for seed, d in stored.items():
            assert d["one_step"]["tangram"] == dominated[seed]["results"]["tangram"]
            assert d["one_step"][B] == dominated[seed]["results"][B]


@pytest.mark.timeout(300)
def test_a_stored_draw_reruns_to_the_digit():
    """Draw 16 of simulation seed 0 (256 requests): its one-step, free-loading and four-step runs, and
    the best grid setting's."""
    stored = next(d for d in json.loads(STORED[0].read_text())["draws"] if d["seed"] == 16)
    again = anatomy.analyse([16], 0, 4, False, 0.01, jobs=1)["draws"][0]
    for key in ("one_step", "free_restores", "per_step", "dominated_by", "workload"):
        assert again[key] == stored[key], key
    setting = stored["grid_best"]["setting"]
    _, _, _, best = anatomy._one(("grid", 16, 0, "tangram", setting, 4))
    assert anatomy._ratios(best, stored["one_step"][B]) == stored["grid_best"]["ratios"]


def test_the_grid_is_every_combination_of_its_knobs():
    settings = anatomy.grid()
    assert len(settings) == 160 == len({json.dumps(g, sort_keys=True) for g in settings})
    assert {"order": "aging", "aging_k": 4.0, "affinity_k": 4.0, "gpu_factor": 0.5, "depth": 2} in settings
    # the defaults are one of the settings: the grid's best is never worse than the run as it is
    default = anatomy._spec("tangram", None).params
    spec = anatomy._spec("tangram", {"order": "aging", "aging_k": 4.0, "affinity_k": 4.0, "gpu_factor": 0.5,
                                     "depth": 2}).params
    assert spec == default


def test_the_scripts_arguments_are_checked():
    with pytest.raises(SystemExit, match="--steps: must be >= 2"):
        anatomy.main(["--steps", "1", "--draws", "16"])
    skipped = next(s for s in range(36) if anatomy.draw("gpu", s) is None)
    with pytest.raises(SystemExit, match="hold no static deployment"):
        anatomy.main(["--draws", str(skipped)])
