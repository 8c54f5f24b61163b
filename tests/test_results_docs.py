"""The stored load sweep and the documents that quote it say what this code does.

``docs/results/load-sweep-all/`` is the sweep the project's claims rest on (README,
``docs/results/README.md``). A change to the policy that moves a schedule must come with a
rerun of it; these tests say so when it does not, on the sweep's cheapest points.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tangram.simulator.sim import Simulation
from tangram.simulator.workload import builtin_names, load_workload

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
SWEEP = RESULTS / "load-sweep-all"
MEASURES = ("mean_act_s", "p99_act_s", "step_time_s")
RERUN = ("rerun the sweeps (`python scripts/replicate_paper.py --quick --only load_sweep --sweep-batches "
         "256 512 1024 2048 4096 --seed S --out DIR`, or per workload with --sweep-workloads W --merge) and "
         "update the documents that quote them")


def _table_rows(markdown: str) -> dict[tuple[str, str], str]:
    """The load sweep's table rows (``| workload | batch | ...``), by workload and batch."""
    rows = {}
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 4 and cells[2].isdigit():
            rows[(cells[1], cells[2])] = line
    return rows


def test_the_results_table_is_the_sweeps_own():
    """docs/results/README.md's first table copies the rows the sweep wrote (load_sweep.md)."""
    written = _table_rows((SWEEP / "load_sweep.md").read_text())
    assert len(written) == 30  # six workloads at five batches
    doc = (RESULTS / "README.md").read_text()
    start = doc.index("## The load sweep on one code version")
    quoted = _table_rows(doc[start:doc.index("### Where tangram loses here", start)])
    assert quoted.keys() == written.keys()
    stale = [key for key in written if quoted[key] != written[key]]
    assert not stale, f"docs/results/README.md quotes other numbers than load_sweep.md for {stale}"


# the sweep of seed 0 and its reruns on seeds 1 and 2 (load-sweep-seeds/)
SWEEPS = ((SWEEP, 0), (RESULTS / "load-sweep-seeds" / "seed-1", 1), (RESULTS / "load-sweep-seeds" / "seed-2", 2))


@pytest.mark.parametrize("workload", builtin_names())
@pytest.mark.parametrize("where, seed", SWEEPS, ids=lambda v: getattr(v, "name", str(v)))
def test_the_stored_sweep_is_this_codes(where, seed, workload):
    """Each stored sweep's tangram run at batch 256, rerun now on its seed, gives the stored measures."""
    stored = json.loads((where / "results.json").read_text())
    assert stored["seed"] == seed
    rows = {r["batch"]: r for r in stored["load_sweep"]["workloads"][workload]["rows"]}
    expected = rows[256]["results"]["tangram"]
    got = Simulation(load_workload(workload).with_batch(256), "tangram", seed=seed).run().summary
    for m in MEASURES:
        assert got[m] == pytest.approx(expected[m], rel=1e-9), f"{where.name}, {workload} at 256, {m}: {RERUN}"
