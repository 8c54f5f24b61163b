"""``scripts/knob_grid.py`` and the CPU family's grid that ``docs/results/README.md`` quotes.

The section "CPU: the dominated draws under 144 settings of the knobs" quotes
``docs/results/policy-stress/cpu-knob-grid-sim-seed-{0,1}.json``; its table is computed here from
those files and the cheapest draw's closest setting is rerun to the digit.
"""
from __future__ import annotations

import json
import re
import sys

import pytest

from tangram.simulator.policies import policy_spec
from tests.test_results_docs import RESULTS, _section
from tests.test_simulator_scripts import ROOT

sys.path.append(str(ROOT / "scripts"))  # last: nothing of the scripts shadows a module of the tests
import knob_grid  # noqa: E402

STORED = {s: RESULTS / "policy-stress" / f"cpu-knob-grid-sim-seed-{s}.json" for s in (0, 1)}
HEADING = "### CPU: the dominated draws under 144 settings of the knobs"


def test_the_grids_hold_the_defaults_and_every_combination():
    default = policy_spec("tangram").params
    for family, size in (("gpu", 160), ("cpu", 144)):
        settings = knob_grid.grid(family)
        assert len(settings) == size == len({json.dumps(g, sort_keys=True) for g in settings})
        assert sum(1 for g in settings if knob_grid.spec_for(g).params == default) == 1, family


def test_a_factor_sets_its_types_cap_and_keeps_the_others():
    caps = knob_grid.spec_for({"cpu_factor": 0.5}).params.offered_load_caps
    assert dict(caps) == {"gpu": 0.5, "cpu": 0.5}
    assert dict(knob_grid.spec_for({"gpu_factor": 0.0}).params.offered_load_caps) == {}
    assert dict(knob_grid.spec_for({"gpu_factor": 2.0, "depth": 3}).params.offered_load_caps) == {"gpu": 2.0}


def test_the_scripts_arguments_are_checked(tmp_path):
    stored = str(RESULTS / "policy-stress" / "sim-seed-0.json")
    with pytest.raises(SystemExit, match="not in"):
        knob_grid.main(["--family", "cpu", "--stored", stored, "--draws", "99"])
    undominated = next(r["seed"] for r in json.loads((RESULTS / "policy-stress" / "sim-seed-0.json").read_text())
                       ["workloads"] if r["family"] == "cpu" and not r["dominated_by"])
    with pytest.raises(SystemExit, match="nothing to reach"):
        knob_grid.main(["--family", "cpu", "--stored", stored, "--draws", str(undominated)])
    changed = tmp_path / "changed.json"
    changed.write_text(json.dumps({**json.loads((RESULTS / "policy-stress" / "sim-seed-0.json").read_text()),
                                   "params": {"order": "fcfs"}}))
    with pytest.raises(SystemExit, match="settings changed"):
        knob_grid.main(["--family", "cpu", "--stored", str(changed)])
    # the GPU family's stored runs from before the warm start was the default: their baselines ran cold
    with pytest.raises(SystemExit, match="before the warm start was the default"):
        knob_grid.main(["--family", "gpu", "--stored", stored])


def _row(d: dict, sim_seed: int) -> str:
    default = " / ".join(f"{x / y:.2f}" for x, y in zip(d["tangram"], d["ref"]))
    best = " / ".join(f"{x / y:.2f}" for x, y in zip(d["best"], d["ref"]))
    g = d["best_setting"]
    order = "FCFS" if g["order"] == "fcfs" else f"aging {g['aging_k']:g}"
    arrivals = g["arrival_gap"] if g["expect_arrivals"] else "off"
    setting = (f"{order}, depth {g['depth']}, look-ahead {g['lookahead']}, arrivals {arrivals}, "
               f"CPU cap {g['cpu_factor']:g}")
    return (f"| {d['seed']}, {sim_seed} | {', '.join(f'`{n}`' for n in d['dominated_by'])} | {default} | {best} | "
            f"{setting} | {d['within_tolerance']} | {d['at_or_below_every_baseline']} |")


def test_the_sections_table_is_the_stored_runs():
    doc = (RESULTS / "README.md").read_text()
    section = _section(doc, HEADING, "### A DoP cap from the offered load")
    rows = [line for line in section.splitlines() if re.match(r"\| \d+, \d+ \|", line)]
    want = []
    for s, path in STORED.items():
        grid = json.loads(path.read_text())
        family = json.loads((RESULTS / "policy-stress" / f"sim-seed-{s}.json").read_text())
        stored = {r["seed"]: r for r in family["workloads"] if r["family"] == "cpu" and r["dominated_by"]}
        assert grid["sim_seed"] == s and grid["settings"] == 144
        assert {d["seed"] for d in grid["draws"]} == set(stored)  # every dominated draw of the stored run
        for d in grid["draws"]:
            # the closest setting's ratios against the nearest of the dominating baselines on each measure
            refs = [stored[d["seed"]]["results"][n] for n in d["dominated_by"]]
            d["ref"] = [min(r[k] for r in refs) for k in range(3)]
            want.append(_row(d, s))
    assert rows == want


@pytest.mark.timeout(120)
def test_the_closest_setting_of_a_stored_draw_reruns_to_the_digit():
    grid = json.loads(STORED[0].read_text())
    cheapest = next(d for d in grid["draws"] if d["seed"] == 2)
    _, _, again = knob_grid._run(("cpu", 2, 0, 0, cheapest["best_setting"]))
    assert again == cheapest["best"]
    _, _, default = knob_grid._run(("cpu", 2, 0, 0, None))
    assert default == cheapest["tangram"]
