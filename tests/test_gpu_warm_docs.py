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
from tangram.simulator.workload import builtin_raw, load_workload, parse_workload
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
    lines = {line.split(" | ")[0] + " |": line for line in _section_text().splitlines()
             if re.match(r"\| `[a-z+-]+` [\d,]+ \|", line)}  # a workload and its batch
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


# --warm-start all: the default runs of each family, then every policy on tangram's GPU manager warm-started
ALL_FAMILIES = {("api", 0): "api-adaptive-books-sim-seed-0.json", ("api", 1): "api-adaptive-books-sim-seed-1.json",
                ("mixed", 0): "mixed-sim-seed-0.json", ("mixed", 1): "mixed-sim-seed-1.json",
                ("neighbours", 0): "neighbours-sim-seed-0.json", ("neighbours", 1): "neighbours-sim-seed-1.json"}


def test_the_all_families_table_is_the_stored_runs():
    rows = [line for line in _section_text().splitlines() if re.match(r"\| (api|mixed|neighbours) \| \d \|", line)]
    want = []
    for (family, s), name in ALL_FAMILIES.items():
        warm = json.loads((STRESS / f"gpu-warm-start-all-{family}-sim-seed-{s}.json").read_text())
        default = json.loads((STRESS / name).read_text())
        assert warm["warm_start"] == "all" and warm["sim_seed"] == default["sim_seed"] == s
        assert [r["workload"] for r in warm["workloads"]] == [r["workload"] for r in default["workloads"]]
        for w, d in zip(warm["workloads"], default["workloads"]):
            for policy, run in d["results"].items():  # the policies with GPUs of their own: reused as they ran
                if policy_spec(policy).gpu_mode != "eoe":
                    assert w["results"][policy] == run
        want.append(f"| {family} | {s} | {_cell(default['summary'][family])} | {_cell(warm['summary'][family])} |")
    assert rows == want


def _sweep() -> dict:
    return json.loads((STRESS / "gpu-warm-start-sweep.json").read_text())


def test_the_sweep_table_is_the_stored_runs():
    """Per workload: the points met (tangram at or below every baseline that did all its work, on all three
    measures) on seeds 0 / 1 / 2 as built and warm-started, and tangram's geometric mean warm / as built."""
    import statistics

    stored = _sweep()
    assert stored["seeds"] == [0, 1, 2]
    rows = [line for line in _section_text().splitlines() if re.match(r"\| `[a-z+-]+` \| \d+ / \d+ / \d+ \|", line)]
    want = []
    for name in ("mopd", "mopd-skewed", "deepsearch", "mopd+search"):
        points = {k: p for k, p in stored["points"].items() if k.split("@")[0] == name}
        assert len(points) == 15, name  # five batches on three seeds
        met = {when: " / ".join(str(sum(not p[f"behind_{when}"] for k, p in points.items() if k.endswith(f"@{s}")))
                                for s in (0, 1, 2)) for when in ("cold", "warm")}
        ratio = [statistics.geometric_mean(p["warm"]["tangram"][i] / p["cold"]["tangram"][i] for p in points.values())
                 for i in range(3)]
        ratios = " / ".join(f"{r:.3f}" for r in ratio)
        want.append(f"| `{name}` | {met['cold']} | {met['warm']} | {ratios} |")
    assert rows == want
    total = {w: sum(not p[f"behind_{w}"] for p in stored["points"].values()) for w in ("cold", "warm")}
    assert stored["met"] == {**total, "points": 60}


def _sweep_script():
    """scripts/warm_start_sweep.py as a module, without putting scripts/ on the session's path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("warm_start_sweep", RESULTS.parent.parent / "scripts" /
                                                  "warm_start_sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sweeps_warm_runs_are_the_stored_sweeps():
    """The warm start is the default: the stored sweep's warm runs are the stored load sweeps' (rerun with it)."""
    sweep = _sweep_script()

    stored = _sweep()
    for s in (0, 1, 2):
        rows = sweep.stored_sweep(s)
        for key, p in stored["points"].items():
            name, batch, seed = key.split("@")
            if int(seed) != s:
                continue
            row = next(r for r in rows[name]["rows"] if r["batch"] == int(batch))
            assert p["warm"] == {k: sweep._row(v) for k, v in row["results"].items() if k in p["warm"]}, key
            assert set(p["warm"]) == {"tangram", *p["compare"]} & set(row["results"])
            for policy in ("static-services", "serverless"):  # their own GPUs: the same on both sides
                assert p["cold"].get(policy) == p["warm"].get(policy)
            assert p["behind_cold"] == sweep.met(p["cold"], p["compare"])
            assert p["behind_warm"] == sweep.met(p["warm"], p["compare"])


@pytest.mark.timeout(180)
def test_a_stored_sweep_point_reruns_to_the_digit():
    p = _sweep()["points"]["deepsearch@256@1"]
    wl = load_workload("deepsearch").with_batch(256)  # as scripts/warm_start_sweep.py makes it
    for policy in ("tangram", "api-retry", "api-naive"):
        for key, spec in (("cold", replace(policy_spec(policy), gpu_warm=False)), ("warm", policy_spec(policy))):
            s = simulate(wl, spec, seed=1).summary
            assert [s[m] for m in MEASURES] + [s.get("failed", 0)] == p[key][policy], (policy, key)


def test_the_sweep_script_reruns_a_stored_point_and_refuses_what_it_has_not(capsys):
    sweep = _sweep_script()

    assert sweep.main(["--seeds", "1", "--workloads", "mopd-skewed", "--batches", "256", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    stored = _sweep()["points"]["mopd-skewed@256@1"]  # its warm loads were counted when it ran warm
    assert out["points"] == {"mopd-skewed@256@1": {k: v for k, v in stored.items() if k != "gpu_warm_loads"}}
    with pytest.raises(SystemExit, match="not GPU workloads"):
        sweep.main(["--seeds", "0", "--workloads", "ai-coding"])
    with pytest.raises(SystemExit, match="nothing to run"):
        sweep.main(["--seeds", "0", "--batches", "300"])


def test_tangram_alone_warm_on_the_api_family_is_what_the_docs_say():
    text = " ".join(_section_text().split())
    runs = [json.loads((STRESS / f"gpu-warm-start-api-sim-seed-{s}.json").read_text()) for s in (0, 1)]
    for s, run in enumerate(runs):
        default = json.loads((STRESS / ALL_FAMILIES[("api", s)]).read_text())
        assert run["warm_start"] is True and run["sim_seed"] == s
        for w, d in zip(run["workloads"], default["workloads"], strict=True):  # tangram alone was rerun
            assert w["workload"] == d["workload"]
            assert {n: v for n, v in w["results"].items() if n != "tangram"} == \
                   {n: v for n, v in d["results"].items() if n != "tangram"}
    summary = [r["summary"]["api"] for r in runs]
    said = (f"{summary[0]['losing_like_for_like']} and {summary[1]['losing_like_for_like']} draws losing, "
            f"{summary[0]['dominated_workloads']} and {summary[1]['dominated_workloads']} dominated, geometric "
            f"means of the mean {summary[0]['tangram_over_best']['mean_act_s']['geomean']:.3f} and "
            f"{summary[1]['tangram_over_best']['mean_act_s']['geomean']:.3f}")
    assert said in text


def test_mopd_2048_both_ways_on_replicas_is_what_the_docs_say():
    """close-calls/mopd-2048-warm-cold.json: replica 0 of each side is the sweep's run (warm: the stored sweep;
    cold: the cold side beside it), and the paragraph's ratios are the replicas'."""
    points = json.loads((RESULTS / "close-calls" / "mopd-2048-warm-cold.json").read_text())["points"]
    sides = {(p["seed"], p.get("warm_start", True)): p["policies"]["tangram"]["runs"] for p in points}
    assert set(sides) == {(s, w) for s in (0, 1, 2) for w in (True, False)}
    assert all(len(runs) == 6 for runs in sides.values())
    stored = _sweep()["points"]
    text = " ".join(_section_text().split())
    p99 = []
    for s in (0, 1, 2):
        warm, cold = sides[(s, True)], sides[(s, False)]
        row = next(r for r in _sweep_script().stored_sweep(s)["mopd"]["rows"] if r["batch"] == 2048)
        assert warm[0] == [row["results"]["tangram"][m] for m in MEASURES]
        assert warm[0] == stored[f"mopd@2048@{s}"]["warm"]["tangram"][:3]
        assert cold[0] == stored[f"mopd@2048@{s}"]["cold"]["tangram"][:3]
        ratios = sorted(w[0] / c[0] for w, c in zip(warm, cold))
        below = sum(w[0] <= c[0] for w, c in zip(warm, cold))
        said = "warm at or below cold on " if s == 0 else ""
        assert (f"{(ratios[2] + ratios[3]) / 2:.3f} on seed {s} ({ratios[0]:.3f}-{ratios[-1]:.3f}; "
                f"{said}{below} of 6)") in text
        if s == 0:  # the sweep's own run, and how far the replicas move
            assert (f"{warm[0][0] / cold[0][0] - 1:.1%} above the cold one on seed 0 "
                    f"({warm[0][0]:.1f} s against {cold[0][0]:.1f} s)") in text
            assert f"the sweep's seed-0 ratio ({warm[0][0] / cold[0][0]:.3f})" in text
            lo, hi = min(c[0] for c in cold), max(c[0] for c in cold)
            assert f"by up to {hi / lo - 1:.0%} from replica to replica (cold seed 0: {lo:.1f}-{hi:.1f} s)" in text
            assert max(max(r[0] for r in side) / min(r[0] for r in side) for side in sides.values()) <= hi / lo
        p99 += [w[1] / c[1] for w, c in zip(warm, cold)]
        assert all(w[2] == pytest.approx(c[2], rel=1e-4) for w, c in zip(warm, cold))  # the same step
    assert f"ratios are {min(p99):.3f}-{max(p99):.3f} over the 18 pairs" in text
