"""The stored load sweeps and the documents that quote them say what this code does.

``docs/results/load-sweep-all/`` (seed 0) and ``docs/results/load-sweep-seeds/`` (seeds 1 and
2) are the sweeps the project's claims rest on (README, ``docs/results/README.md``, whose two
tables of them are checked against the stored results here, as is its table of the random
families' dominated draws against ``docs/results/policy-stress/``). A change
to the policy that moves a schedule must come with a rerun of them; these tests say so when it
does not, on the sweeps' cheapest points (batch 256 on every seed, 512 on seed 0): a change
that moves only larger batches, or only the baselines, passes them.
"""
from __future__ import annotations

import json
import re
import sys
from functools import cache
from pathlib import Path

import pytest

from tangram.simulator.sim import Simulation
from tangram.simulator.workload import builtin_names, load_workload
from tests.test_simulator_scripts import ROOT

sys.path.append(str(ROOT / "scripts"))  # last: nothing of the scripts shadows a module of the tests
import policy_stress as stress  # noqa: E402

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
SWEEP = RESULTS / "load-sweep-all"
MEASURES = ("mean_act_s", "p99_act_s", "step_time_s")
# the sweep of seed 0, its reruns on seeds 1 and 2, and the batches rerun here of each
SWEEPS = ((SWEEP, 0, (256, 512)), (RESULTS / "load-sweep-seeds" / "seed-1", 1, (256,)),
          (RESULTS / "load-sweep-seeds" / "seed-2", 2, (256,)))
POINTS = [(where, seed, batch) for where, seed, batches in SWEEPS for batch in batches]


@cache
def _stored(where: Path) -> dict:
    """A sweep's results.json, read once for every test below."""
    return json.loads((where / "results.json").read_text())


def _rerun(where: Path, seed: int) -> str:
    out = where.relative_to(RESULTS.parent.parent)
    return (f"rerun the sweep (`python scripts/replicate_paper.py --quick --only load_sweep --sweep-batches "
            f"256 512 1024 2048 4096 --seed {seed} --out {out}`) and update the documents that quote it")


def _table_rows(markdown: str) -> dict[tuple[str, str], str]:
    """The load sweep's table rows (``| workload | batch | ...``), by workload and batch."""
    rows = {}
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 4 and cells[2].isdigit():
            rows[(cells[1], cells[2])] = line
    return rows


def _section(doc: str, heading: str, next_heading: str) -> str:
    assert heading in doc and next_heading in doc, f"docs/results/README.md: no {heading!r} / {next_heading!r}"
    start = doc.index(heading)
    return doc[start:doc.index(next_heading, start)]


def test_the_results_table_is_the_sweeps_own():
    """docs/results/README.md's first table copies the rows the sweep wrote (load_sweep.md)."""
    written = _table_rows((SWEEP / "load_sweep.md").read_text())
    assert len(written) == 30, "load_sweep.md: expected six workloads at five batches"
    doc = (RESULTS / "README.md").read_text()
    quoted = _table_rows(_section(doc, "## The load sweep on one code version", "### Where tangram loses here"))
    assert quoted.keys() == written.keys(), "the table's (workload, batch) rows are not load_sweep.md's"
    stale = [key for key in written if quoted[key] != written[key]]
    assert not stale, f"docs/results/README.md quotes other numbers than load_sweep.md for {stale}"


def _losses(row: dict) -> str:
    """The seeds table's cell for one point, from the losses the sweep recorded (replicate_paper's
    ``sweep_row``): each measure where tangram is above the best baseline that did all its work,
    its ratio to it, and that baseline (those tied, by name)."""
    parts = []
    for m in MEASURES:
        fair = [loss for loss in row["losses"] if loss["measure"] == m and loss["policy"] != "tangram:fcfs"
                and not loss["baseline_failed"]]
        if fair:
            best = min(loss["baseline"] for loss in fair)
            who = ", ".join(loss["policy"] for loss in fair if loss["baseline"] == best)
            parts.append((m.split("_")[0], fair[0]["tangram"] / best, who))
    cells = []
    for i, (name, ratio, who) in enumerate(parts):
        shared = i + 1 < len(parts) and parts[i + 1][2] == who  # the next measure names the same baseline
        cells.append(f"{name} {ratio:.3f}x" + ("" if shared else f" ({who})"))
    return ", ".join(cells) or "nothing"


def test_the_seeds_table_is_the_stored_sweeps():
    """The table of "The same sweep on seeds 1 and 2" is computed from the three sweeps' results:
    every point that loses on a seed, and nothing else."""
    sweeps = [_stored(where)["load_sweep"]["workloads"] for where, _, _ in SWEEPS]
    expected = []
    for workload, runs in sweeps[0].items():
        for i, row in enumerate(runs["rows"]):
            cells = [_losses(sweep[workload]["rows"][i]) for sweep in sweeps]
            if any(c != "nothing" for c in cells):
                expected.append(f"| `{workload}` | {row['batch']:,} | " + " | ".join(cells) + " |")
    doc = (RESULTS / "README.md").read_text()
    section = _section(doc, "### The same sweep on seeds 1 and 2", "## Random workloads")
    quoted = [line for line in section.splitlines() if line.startswith("| `")]
    assert quoted == expected


# the points of the three sweeps where a baseline that did all its work is at or below tangram
# on every measure, and where docs/results/README.md says so ("Where tangram loses here, and why")
AHEAD_EVERYWHERE = [(0, "mopd+search", 256, "api-naive"), (0, "mopd+search", 256, "api-retry"),
                    (2, "mopd+search", 256, "api-naive"), (2, "mopd+search", 256, "api-retry")]


def test_a_baseline_is_ahead_of_tangram_on_every_measure_only_where_the_docs_say():
    """At every point of the three sweeps (90) but those named in ``AHEAD_EVERYWHERE``, a
    baseline that did all its work and is below tangram on one measure is above it on another:
    each loss is a trade-off ("Where tangram loses here, and why"). ``api-naive`` where it gave up
    on calls, and tangram's own FCFS order, are not baselines here."""
    dominated, points = [], 0
    for where, seed, _ in SWEEPS:
        for workload, runs in _stored(where)["load_sweep"]["workloads"].items():
            for row in runs["rows"]:
                points += 1
                res = {p: [r[m] for m in MEASURES] for p, r in row["results"].items() if p != "tangram:fcfs"}
                failed = {p: r["failed"] for p, r in row["results"].items() if r.get("failed")}
                dominated += [(seed, workload, row["batch"], p) for p in stress.dominated_by(res, 0.0, failed)]
    assert points == 90 and dominated == AHEAD_EVERYWHERE
    doc = (RESULTS / "README.md").read_text()
    for seed, workload, batch in {point[:3] for point in AHEAD_EVERYWHERE}:  # a point, whichever baselines
        assert f"at or below tangram on every measure at `{workload}` {batch} on seed {seed}" in " ".join(doc.split())


STRESS = RESULTS / "policy-stress"
# the stored runs the table of "Which losses trade one measure for another" reads, by its rows
STRESS_RUNS = {("cpu", 0): "sim-seed-0.json", ("cpu", 1): "sim-seed-1.json", ("gpu", 0): "sim-seed-0.json",
               ("gpu", 1): "sim-seed-1.json", ("api", 0): "api-adaptive-books-sim-seed-0.json",
               ("api", 1): "api-adaptive-books-sim-seed-1.json"}


def test_the_table_of_dominated_draws_is_the_stored_runs():
    """Each row: the draws losing to a baseline that did all its work, how many of them lose to one
    tangram beats on no measure (policy_stress.dominated_by, 1%), which draws, and the largest
    ratio of tangram to such a baseline per measure, with its draw."""
    doc = (RESULTS / "README.md").read_text()
    section = _section(doc, "### Which losses trade one measure for another", "So the families differ")
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0][:3] in ("cpu", "gpu", "api"):
            family, seed = cells[0].split(" ")[0].rstrip(","), int(cells[0].split(" ")[1])
            rows[(family, seed)] = cells
    assert rows.keys() == STRESS_RUNS.keys()
    for (family, seed), cells in rows.items():
        stored = json.loads((STRESS / STRESS_RUNS[(family, seed)]).read_text())
        assert stored["sim_seed"] == seed
        draws = [w for w in stored["workloads"] if w["family"] == family]
        fair = [w for w in draws if any("baseline_failed" not in x for x in w["losses"])]
        dominated = {w["seed"]: stress.dominated_by(w["results"], 0.01, w["failed"]) for w in draws}
        dominated = {d: names for d, names in dominated.items() if names}
        assert cells[1:3] == [str(len(fair)), str(len(dominated))], (family, seed)
        named = {int(n) for n in re.findall(r"\d+", re.sub(r"`[^`]*`", "", cells[3]))}
        assert named == set(dominated), (family, seed)
        largest = []
        for i, cell in enumerate(cells[4].split(", ")):
            ratio, draw = max((w["results"]["tangram"][i] / w["results"][b][i], w["seed"])
                              for w in draws if w["seed"] in dominated for b in dominated[w["seed"]])
            largest.append(f"{ratio:.2f} ({draw})" if "(" in cell else f"{ratio:.2f}")
        assert cells[4] == ", ".join(largest), (family, seed)


@pytest.mark.parametrize("workload", builtin_names())
@pytest.mark.parametrize("where, seed, batch", POINTS, ids=lambda v: getattr(v, "name", str(v)))
def test_the_stored_sweep_is_this_codes(where, seed, batch, workload):
    """A stored sweep's tangram run, rerun now on its seed and batch, gives the stored measures."""
    stored = _stored(where)
    assert stored["seed"] == seed
    rows = {r["batch"]: r for r in stored["load_sweep"]["workloads"][workload]["rows"]}
    expected = rows[batch]["results"]["tangram"]
    got = Simulation(load_workload(workload).with_batch(batch), "tangram", seed=seed).run().summary
    for m in MEASURES:
        assert got[m] == pytest.approx(expected[m], rel=1e-9), f"{workload} at {batch}, {m}: {_rerun(where, seed)}"


def _over_best(summary: dict, measure: str) -> str:
    """A table's cell of tangram / best baseline on ``measure``: ``geomean (max)`` of a family summary."""
    t = summary["tangram_over_best"][measure]
    return f"{t['geomean']:.3f} ({t['max']:.2f})"


# the tables of "Elastic actions without a profile": the CPU rows by (simulation seed, steps, tangram),
# the GPU and API rows (seed 0, two steps; the profiled runs one step) by (family, tangram)
UNPROFILED_RUNS = {("0, 2", "before"): "cpu-unprofiled-2-steps-not-learned-sim-seed-0.json",
                   ("0, 2", "learning"): "cpu-unprofiled-2-steps-sim-seed-0.json",
                   ("1, 2", "before"): "cpu-unprofiled-2-steps-not-learned-sim-seed-1.json",
                   ("1, 2", "learning"): "cpu-unprofiled-2-steps-sim-seed-1.json",
                   ("0, 1", "before"): "cpu-unprofiled-1-step-not-learned-sim-seed-0.json",
                   ("0, 1", "learning"): "cpu-unprofiled-1-step-sim-seed-0.json",
                   ("0, 1", "profiled"): "sim-seed-0.json",
                   ("gpu", "before"): "gpu-unprofiled-2-steps-not-learned-sim-seed-0.json",
                   ("gpu", "learning"): "gpu-unprofiled-2-steps-sim-seed-0.json",
                   ("gpu", "profiled"): "sim-seed-0.json",
                   ("api", "before"): "api-unprofiled-2-steps-not-learned-sim-seed-0.json",
                   ("api", "learning"): "api-unprofiled-2-steps-sim-seed-0.json",
                   ("api", "profiled"): "api-adaptive-books-sim-seed-0.json"}


def test_the_unprofiled_tables_are_the_stored_runs():
    """Each row: its file's seed, steps and knob, draws losing (the GPU and API rows: to a baseline
    that did all its work; dominated), and tangram / best baseline per measure."""
    doc = (RESULTS / "README.md").read_text()
    section = _section(doc, "### Elastic actions without a profile", "On the API family learning")
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and (re.fullmatch(r"\d, \d", cells[0]) or cells[0] in ("gpu", "api")):
            rows[(cells[0], cells[1].split(" ")[0].strip("`"))] = cells
    assert rows.keys() == UNPROFILED_RUNS.keys()
    for (where, who), cells in rows.items():
        stored = json.loads((STRESS / UNPROFILED_RUNS[(where, who)]).read_text())
        family, (seed, steps) = ("cpu", map(int, where.split(", "))) if "," in where else (where, (0, 2))
        steps = 1 if who == "profiled" else steps
        assert stored["sim_seed"] == seed
        assert stored.get("unprofiled", False) == (who != "profiled")
        assert (stored.get("steps") or 1) == steps
        assert stored["params"] == ({"learn_unprofiled": False} if who == "before" else {})
        s = stored["summary"][family]
        fair = f"{s['losing_like_for_like']}; " if family != "cpu" else ""
        want = [f"{s['losing_workloads']} ({fair}{s['dominated_workloads']})"]
        want += [_over_best(s, m) for m in MEASURES]
        assert cells[2:] == want, (where, who)


def test_the_neighbours_table_is_the_stored_runs():
    """Per built-in and for all 48 draws, seeds 0 / 1: draws losing (to a baseline that did all its
    work; dominated) and tangram / best baseline per measure, from neighbours-sim-seed-{0,1}.json;
    each file is a full --family neighbours run of its simulation seed at the defaults."""
    doc = (RESULTS / "README.md").read_text()
    section = _section(doc, "### Neighbours of the built-ins", "`ai-coding` and `mopd` lose nowhere")
    runs = [json.loads((STRESS / f"neighbours-sim-seed-{seed}.json").read_text()) for seed in (0, 1)]
    for seed, run in enumerate(runs):
        assert (run["sim_seed"], run["params"], run["steps"], run["unprofiled"]) == (seed, {}, None, False)
        assert [r["seed"] for r in run["workloads"]] == list(range(48))
        for r in run["workloads"]:  # the draw is today's draw of that seed
            assert r["workload"] == stress.neighbour_workload(r["seed"])
    quoted = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and (cells[0] in builtin_names() or cells[0] == "all 48"):
            quoted[cells[0]] = cells[1:]
    assert set(quoted) == {*builtin_names(), "all 48"}

    def cells(rows: list[dict]) -> list[str]:
        per_seed = [stress.summarize(rs, 0.01) for rs in rows]
        out = [" / ".join(f"{s['losing_workloads']} ({s['losing_like_for_like']}; {s['dominated_workloads']})"
                          for s in per_seed)]
        return out + [" / ".join(_over_best(s, m) for s in per_seed) for m in MEASURES]

    for name, got in quoted.items():
        rows = [[r for r in run["workloads"] if name == "all 48" or r["workload"]["name"].split("~")[0] == name]
                for run in runs]
        assert got == cells(rows), name


# "When a trajectory in generation is expected": each row's default run, its "residual" twin, its
# family and its --generation-scale
ARRIVAL_GAP_RUNS = {
    "sim-seed-0.json": ("cpu-arrival-residual-sim-seed-0.json", "cpu", 1.0),
    "sim-seed-1.json": ("cpu-arrival-residual-sim-seed-1.json", "cpu", 1.0),
    "neighbours-sim-seed-0.json": ("neighbours-arrival-residual-sim-seed-0.json", "neighbours", 1.0),
    "neighbours-sim-seed-1.json": ("neighbours-arrival-residual-sim-seed-1.json", "neighbours", 1.0),
    "cpu-generation-x10-sim-seed-0.json": ("cpu-generation-x10-arrival-residual-sim-seed-0.json", "cpu", 10.0),
    "cpu-generation-x10-sim-seed-1.json": ("cpu-generation-x10-arrival-residual-sim-seed-1.json", "cpu", 10.0),
    "cpu-generation-x3-sim-seed-0.json": ("cpu-generation-x3-arrival-residual-sim-seed-0.json", "cpu", 3.0),
    "mixed-sim-seed-0.json": ("mixed-arrival-residual-sim-seed-0.json", "mixed", 1.0),
}


def _twin_table(heading: str, marks: tuple[str, str], runs: dict) -> dict[tuple[str, str], list[str]]:
    """A table of runs and their twins under ``heading``: (first run's file, mark) -> its sim seed and
    summary cells, from the rows of 7 cells whose third is one of ``marks``; one row of each per run."""
    section = _section((RESULTS / "README.md").read_text(), heading, "`tests/test_results_docs.py` computes")
    quoted = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[2] in marks:
            (name,) = re.findall(r"`([^`]+\.json)`", cells[0])
            quoted[(name, cells[2])] = cells[1:2] + cells[3:]
    assert {name for name, _ in quoted} == set(runs) and len(quoted) == 2 * len(runs)
    return quoted


def test_the_arrival_gap_table_is_the_stored_runs():
    """Each default run and its twin with arrival_gap "residual" (the same draws, tangram alone on the
    default run's baselines): draws losing (to a baseline that did all its work; dominated) and
    tangram / best baseline per measure, from the stored files."""
    quoted = _twin_table("## When a trajectory in generation is expected", ("mean", "residual"), ARRIVAL_GAP_RUNS)
    for default, (twin, family, scale) in ARRIVAL_GAP_RUNS.items():
        base, other = (json.loads((STRESS / f).read_text()) for f in (default, twin))
        assert base["sim_seed"] == other["sim_seed"] and base["params"] == {}
        assert other["params"] == {"arrival_gap": "residual"}
        assert base.get("generation_scale", 1.0) == other.get("generation_scale", 1.0) == scale
        drawn = [r["workload"] for r in base["workloads"] if r["family"] == family]
        assert drawn == [r["workload"] for r in other["workloads"]]  # the same draws
        for gap, run in (("mean", base), ("residual", other)):
            s = run["summary"][family]
            want = [str(run["sim_seed"]),
                    f"{s['losing_workloads']} ({s['losing_like_for_like']}; {s['dominated_workloads']})"]
            assert quoted[(default, gap)] == want + [_over_best(s, m) for m in MEASURES], (default, gap)


def test_the_mixed_familys_rows_are_the_stored_runs():
    """The mixed family's rows: full --family mixed runs of simulation seeds 0 and 1 at the defaults, today's draws."""
    doc = (RESULTS / "README.md").read_text()
    section = _section(doc, "### Every kind of resource at once", "`tests/test_results_docs.py` computes these rows")
    for seed in (0, 1):
        run = json.loads((STRESS / f"mixed-sim-seed-{seed}.json").read_text())
        assert (run["sim_seed"], run["params"], run["steps"], run["unprofiled"]) == (seed, {}, None, False)
        assert [r["seed"] for r in run["workloads"]] == list(range(36))
        for r in run["workloads"]:
            assert r["workload"] == stress.draw("mixed", r["seed"])
        s = run["summary"]["mixed"]
        want = [f"{s['losing_workloads']} of {s['workloads']} ({s['losing_like_for_like']}; {s['dominated_workloads']})"]
        want += [_over_best(s, m) for m in MEASURES]
        (row,) = [line for line in section.splitlines() if line.startswith(f"| mixed, simulation seed {seed} |")]
        assert [c.strip() for c in row.strip().strip("|").split("|")][1:] == want


# the restart table: each run with the suites as drawn, and its twin with every elastic CPU reward
# restartable (--restartable), family, steps
RESTART_RUNS = {
    "sim-seed-0.json": ("cpu-restartable-sim-seed-0.json", "cpu", None),
    "sim-seed-1.json": ("cpu-restartable-sim-seed-1.json", "cpu", None),
    "cpu-2-steps-sim-seed-0.json": ("cpu-2-steps-restartable-sim-seed-0.json", "cpu", 2),
    "mixed-sim-seed-0.json": ("mixed-restartable-sim-seed-0.json", "mixed", None),
    "mixed-sim-seed-1.json": ("mixed-restartable-sim-seed-1.json", "mixed", None),
    "neighbours-sim-seed-0.json": ("neighbours-restartable-sim-seed-0.json", "neighbours", None),
    "neighbours-sim-seed-1.json": ("neighbours-restartable-sim-seed-1.json", "neighbours", None),
}
# the baselines that run no CPU policy of tangram's: a restart never reaches them, so the twin's are equal
NO_RESTART_BASELINES = ("trajectory", "fixed-dop:1", "fixed-dop:4", "fixed-dop:16")


def test_the_restart_table_is_the_stored_runs():
    """Each run and its twin with the suites restartable (the same draws, every policy rerun): draws
    losing (to a baseline that did all its work; dominated) and tangram / best baseline per measure."""
    quoted = _twin_table("## Restarting a straggler wider", ("no", "yes"), RESTART_RUNS)
    for plain, (twin, family, steps) in RESTART_RUNS.items():
        base, other = (json.loads((STRESS / f).read_text()) for f in (plain, twin))
        assert base["sim_seed"] == other["sim_seed"] and base["params"] == other["params"] == {}
        assert base.get("steps") == other["steps"] == steps  # the oldest runs stored no steps (one)
        assert not base.get("restartable", False) and other["restartable"] is True
        rows = [r for r in base["workloads"] if r["family"] == family]
        assert [r["seed"] for r in rows] == [r["seed"] for r in other["workloads"]]
        for a, b in zip(rows, other["workloads"]):
            assert b["workload"] == stress.draw(family, b["seed"], steps=steps, restartable=True)
            assert a["workload"] == stress.draw(family, a["seed"], steps=steps)  # the same draw, unmarked
            for name in NO_RESTART_BASELINES:
                if name in a["results"]:
                    assert a["results"][name] == b["results"][name], (twin, b["seed"], name)
        for mark, run in (("no", base), ("yes", other)):
            s = run["summary"][family]
            want = [str(run["sim_seed"]),
                    f"{s['losing_workloads']} ({s['losing_like_for_like']}; {s['dominated_workloads']})"]
            assert quoted[(plain, mark)] == want + [_over_best(s, m) for m in MEASURES], (plain, mark)


def test_the_serverless_fewest_table_is_the_stored_runs():
    """Each family's run with --also serverless:fewest against the stored run it took its baselines from:
    tangram identical, the counts of the table computed."""
    doc = (RESULTS / "README.md").read_text()
    section = _section(doc, "### `serverless` on the fewest GPUs", "Where it wins, it wins by little")
    sources = {"gpu": "sim-seed-0.json", "api": "api-adaptive-books-sim-seed-0.json", "mixed": "mixed-sim-seed-0.json"}
    for family, source in sources.items():
        run = json.loads((STRESS / f"{family}-serverless-fewest-sim-seed-0.json").read_text())
        base = json.loads((STRESS / source).read_text())
        old = {r["seed"]: r for r in base["workloads"] if r["family"] == family}
        assert run["also"] == ["serverless:fewest"] and run["sim_seed"] == base["sim_seed"] == 0
        for r in run["workloads"]:
            assert r["results"]["tangram"] == old[r["seed"]]["results"]["tangram"]
            assert {k: v for k, v in r["results"].items() if k != "serverless:fewest"} == old[r["seed"]]["results"]

        def count(s):
            return f"{s['losing_workloads']} ({s['losing_like_for_like']}; {s['dominated_workloads']})"

        losing = [r["seed"] for r in run["workloads"] if any(x["baseline"] == "serverless:fewest" for x in r["losses"])]
        dominated = [r["seed"] for r in run["workloads"] if "serverless:fewest" in r["dominated_by"]]
        cell = f"{', '.join(map(str, losing))} ({', '.join(map(str, dominated))})" if losing else "none"
        want = [count(base["summary"][family]), count(run["summary"][family]), cell]
        (row,) = [line for line in section.splitlines() if line.startswith(f"| {family} |")]
        assert [c.strip() for c in row.strip().strip("|").split("|")][1:] == want


def test_serverless_fewest_is_behind_tangram_on_the_built_ins_where_the_docs_say():
    """Two points of the built-in sweep rerun: serverless:fewest behind the stored tangram on every measure."""
    from tangram.simulator.sim import simulate
    from tangram.simulator.workload import load_workload

    sweep = json.loads((RESULTS / "load-sweep-all" / "results.json").read_text())["load_sweep"]["workloads"]
    for workload in ("mopd", "deepsearch"):
        (row,) = [r for r in sweep[workload]["rows"] if r["batch"] == 256]
        tangram = row["results"]["tangram"]
        fewest = simulate(load_workload(workload).with_batch(256), "serverless:fewest", seed=0).summary
        assert all(fewest[m] >= tangram[m] for m in MEASURES), (workload, fewest, tangram)
