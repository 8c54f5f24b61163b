"""scripts/replicate_paper.py and scripts/bench_simulator.py run end to end (tiny sizes)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tangram.policy import compiled

ROOT = Path(__file__).resolve().parent.parent


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_replicate_paper_smoke_writes_json_and_plots(tmp_path, capsys):
    rp = load("replicate_paper")
    assert rp.main(["--smoke", "--out", str(tmp_path), "--only", "cpu_scaling", "ablation", "breakdown"]) == 0
    head = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert head["mode"] == "smoke" and set(head["cpu_scaling_act_ratio"]) == {"16", "32"}
    res = json.loads((tmp_path / "results.json").read_text())
    for row in res["cpu_scaling"]["rows"]:
        assert row["lower_bound_mean_act_s"] <= row["tangram"]["mean_act_s"]
    assert {p.name for p in tmp_path.glob("*.png")} == {"cpu_scaling.png", "ablation.png", "breakdown.png"}


def test_bench_simulator_json(capsys):
    bench = load("bench_simulator")
    assert bench.main(["--batch", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["actions"] > 0 and out["actions_per_s"] > 0


def test_replicate_paper_load_sweep_lists_every_loss(tmp_path, capsys):
    rp = load("replicate_paper")
    assert rp.main(["--smoke", "--out", str(tmp_path), "--only", "load_sweep"]) == 0
    res = json.loads((tmp_path / "results.json").read_text())["load_sweep"]
    for name, w in res["workloads"].items():
        assert (tmp_path / f"load_sweep_{name}.png").exists()
        for row in w["rows"]:
            t = row["results"]["tangram"]
            assert row["overload_bound_mean_act_s"] <= t["mean_act_s"]
            listed = {(x["policy"], x["measure"]) for x in row["losses"]}
            for p, r in row["results"].items():
                for m in res["measures"]:
                    assert ((p, m) in listed) == (p != "tangram" and r[m] < t[m] * (1 - 1e-6))


def test_bench_simulator_all_covers_every_builtin_workload(capsys):
    from tangram.simulator.workload import builtin_names

    bench = load("bench_simulator")
    assert bench.main(["--all", "--batch", "4", "--json"]) == 0
    runs = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["runs"]
    assert {r["workload"] for r in runs} == set(builtin_names())
    assert all(r["actions_per_s"] > 0 for r in runs)
    assert {"tangram", "trajectory"} <= {r["policy"] for r in runs}


def test_bench_scheduler_reports_every_size_and_growth(capsys):
    bench = load("bench_scheduler")
    assert bench.main(["--smoke", "--repeats", "3", "--events", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["target_median_ms"] == 0.5 and out["round_median_ms"] == out["sizes"][0]["round_median_ms"]
    for size in out["sizes"]:
        assert {"cores", "candidates", "queued", "round_median_ms", "round_p99_ms"} <= set(size)
        assert size["scheduled"] > 0 and size["events"] == 6
        assert 0 < size["round_cpu_median_ms"] <= size["round_cpu_p99_ms"]
    assert [(s["nodes"], s["blocked_on_memory"]) for s in out["sizes"]] == [
        (1, False), (1, False), (1, True), (1, True), (15, False)]
    assert set(out["growth"]) == {"cores_4x", "queued_10x_blocked", "queued_10x_blocked_events",
                                  "cores_4x_cpu", "queued_10x_blocked_cpu", "testbed_15x_nodes"}
    assert out["growth"]["testbed_15x_nodes"]["ratio_of_medians"] > 0
    assert out["round_cpu_median_ms"] == out["sizes"][0]["round_cpu_median_ms"]
    import tangram.policy.estimate as estimate
    assert out["estimate_compiled"] is estimate._hot.COMPILED and "against_source" not in out
    assert out["policy_compiled"] == sorted(n for n, yes in compiled.native_modules().items() if yes)
    # its imports frozen as `tangram serve` freezes its own; the process left as found
    import gc
    assert out["gc"]["frozen_at_start"] > 1000
    assert gc.get_freeze_count() == 0 and bench.PAUSES._on_collection not in gc.callbacks
    # a collection falls in one round at most: the rounds that held one are no more than the collections
    assert sum(size["rounds_with_full_collection"] for size in out["sizes"]) <= out["gc"]["full_collections"]


def test_bench_scheduler_times_the_plain_estimate_side_by_side(capsys):
    import tangram.policy.estimate as estimate
    bench = load("bench_scheduler")
    running, running_walk = estimate._hot, estimate._walk
    assert bench.main(["--smoke", "--repeats", "4", "--events", "2", "--against-source", "--json"]) == 0
    assert estimate._hot is running and estimate._walk is running_walk  # it puts the running loops back
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = out["against_source"]
    assert [(r["cores"], r["blocked_on_memory"]) for r in rows] == [
        (256, False), (1024, False), (256, True), (256, True), (3840, False)]
    for r in rows:
        assert r["round_cpu_median_ms"] > 0 and r["source_round_cpu_median_ms"] > 0
        assert r["ratio"]["p10"] <= r["ratio"]["median"] <= r["ratio"]["p90"]


def test_load_sweep_table_says_when_a_baseline_won_by_failing_calls():
    rp = load("replicate_paper")

    def summary(mean, p99, step, failed):
        return {"mean_act_s": mean, "p99_act_s": p99, "step_time_s": step, "failed": failed,
                "lower_bound_mean_act_s": 1.0, "overload_bound_mean_act_s": 1.0}

    row = rp.sweep_row(512, {"tangram": summary(10.0, 50.0, 900.0, 0),
                             "api-naive": summary(8.0, 60.0, 800.0, 1037),
                             "static-services": summary(9.0, 70.0, 950.0, 0)})
    lost = {(x["policy"], x["measure"]): x["baseline_failed"] for x in row["losses"]}
    assert lost == {("api-naive", "mean_act_s"): 1037, ("api-naive", "step_time_s"): 1037,
                    ("static-services", "mean_act_s"): 0}
    table = rp.sweep_markdown({"workloads": {"w": {"rows": [row]}}})
    assert "mean_act vs api-naive (1.25x, it failed 1,037 calls)" in table
    assert "mean_act vs static-services (1.11x)" in table


def test_bench_policy_ab_plans_both_policies_on_the_same_snapshots(capsys):
    if not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout: the base policy comes from `git archive`")
    ab = load("bench_policy_ab")
    assert ab.main(["--base", "HEAD", "--smoke", "--repeats", "3"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["base"] == "HEAD" and set(out["estimate_compiled"]) == {"base", "new"}
    assert out["estimate_on_c_arrays"] == {"base": True, "new": True}  # HEAD has walk_arrays.pyx
    # HEAD compiles the modules of a round whole: its own built here, by this checkout's setup.py
    assert out["policy_compiled"]["base"] == out["policy_compiled"]["new"] == sorted(compiled.NATIVE)
    assert [(s["cores"], s["queued"], s["blocked_on_memory"]) for s in out["sizes"]] == [
        (256, 200, False), (1024, 800, False), (256, 200, True), (256, 2000, True), (3840, 3000, False)]
    for s in out["sizes"]:
        assert s["base_round_cpu_median_ms"] > 0 and s["new_round_cpu_median_ms"] > 0
        assert s["ratio"]["p10"] <= s["ratio"]["median"] <= s["ratio"]["p90"]
    assert ab.main(["--base", "HEAD", "--simulate", "ai-coding", "4"]) == 0
    sim = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["simulate"]
    assert sim["rounds"] > 0 and sim["base_policy_cpu_s"] > 0 and sim["new_policy_cpu_s"] > 0


def test_bench_policy_ab_compiles_a_base_walk_that_differs(tmp_path):
    """A base whose walk.py is not the installed one's runs its own, compiled here, digest recorded
    (as setup.py does), so that the two sides compare compiled walks."""
    import importlib
    import shutil
    import sys

    from tangram.policy import compiled

    ab = load("bench_policy_ab")
    pkg = tmp_path / ab.BASE
    pkg.mkdir()
    for name in ("__init__.py", "walk.py", "walk.pxd", "walk_arrays.pyx"):
        shutil.copy(ROOT / "tangram/policy" / name, pkg / name)
    (pkg / "walk.py").write_text((pkg / "walk.py").read_text() + "\n# another version\n")
    (pkg / "walk_arrays.pyx").write_text((pkg / "walk_arrays.pyx").read_text() + "\n# another version\n")
    ab._compile_base(pkg, walk=True, arrays=True)
    for name in [m for m in sys.modules if m.startswith(ab.BASE)]:
        del sys.modules[name]  # another test's base
    sys.path.insert(0, str(tmp_path))
    try:
        walk = compiled.walk_module(f"{ab.BASE}.walk")
        assert walk.COMPILED and walk.__file__.startswith(str(pkg))
        on_arrays = compiled.arrays_walk(walk, f"{ab.BASE}.walk_arrays")  # its own, built from its .pyx
        assert on_arrays is not walk.walk and sys.modules[f"{ab.BASE}.walk_arrays"].__file__.startswith(str(pkg))
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.startswith(ab.BASE)]:
            del sys.modules[name]
        importlib.invalidate_caches()


def test_bench_policy_ab_records_the_digest_the_base_checks(tmp_path):
    """A base's compiled.py may digest other inputs than this checkout's (an older one has no
    directives in it): each library's record is rewritten with the base's own digest of its source."""
    import shutil

    ab = load("bench_policy_ab")
    pkg = tmp_path / ab.BASE
    pkg.mkdir()
    for name in ("compiled.py", "rows.py", "walk.py", "walk.pxd", "walk_arrays.pyx"):
        shutil.copy(ROOT / "tangram/policy" / name, pkg / name)
    base_compiled = pkg / "compiled.py"
    text = base_compiled.read_text()
    assert "    return h.hexdigest()" in text
    base_compiled.write_text(text.replace("    return h.hexdigest()", "    h.update(b'older')\n    return h.hexdigest()"))
    for short in ("rows", "walk", "walk_arrays"):
        (pkg / f"{short}.cpython-311-x86_64-linux-gnu.so.sha256").write_text("as this checkout digests it\n")
    ab._record_as_the_base_judges(pkg)
    spec = importlib.util.spec_from_file_location("_older_compiled", base_compiled)
    older = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(older)
    for short, source in (("rows", "rows.py"), ("walk", "walk.py"), ("walk_arrays", "walk_arrays.pyx")):
        recorded = (pkg / f"{short}.cpython-311-x86_64-linux-gnu.so.sha256").read_text().strip()
        assert recorded == older.source_digest(pkg / source) != compiled.source_digest(pkg / source)


def test_bench_policy_ab_stops_when_the_plans_differ():
    import dataclasses

    from tangram.policy.schedule import plan

    ab = load("bench_policy_ab")

    def one_core_more(snap):  # a "faster" policy that changed a decision
        p = plan(snap)
        d = p.dispatches[0]
        moved = dataclasses.replace(d, units={**d.units, "cpu": d.units["cpu"] + 1})
        return dataclasses.replace(p, dispatches=(moved, *p.dispatches[1:]))

    with pytest.raises(SystemExit, match="planned differently"):
        ab.rounds(plan, one_core_more, repeats=2, seed=0, smoke=True)


def test_decision_digest_follows_every_decision(capsys):
    """Same run, same digest; another seed (other durations, so other decisions), another digest;
    and a policy that decides otherwise on the same workload, another digest."""
    dd = load("decision_digest")
    assert dd.main(["--json", "mopd/16", "mopd/16/tangram:fcfs"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert dd.main(["--json", "mopd/16"]) == 0
    assert json.loads(capsys.readouterr().out)["mopd/16"] == first["mopd/16"]
    assert dd.main(["--json", "--seed", "1", "mopd/16"]) == 0
    assert json.loads(capsys.readouterr().out)["mopd/16"] != first["mopd/16"]
    assert dd.main(["--json", "mopd/16/serverless"]) == 0
    assert json.loads(capsys.readouterr().out)["mopd/16/serverless"] != first["mopd/16"]
    with pytest.raises(SystemExit, match="workload/batch"):
        dd.main(["mopd"])


def test_bench_many_classes_reports_both_sides_per_size(capsys):
    bench = load("bench_many_classes")
    assert bench.main(["--sizes", "50", "200", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [s["actions"] for s in out["sizes"]] == [50, 200]
    for s in out["sizes"]:
        assert s["one_class_us_per_action"] > 0 and s["class_per_action_us_per_action"] > 0
        assert abs(s["ratio"] - s["class_per_action_us_per_action"] / s["one_class_us_per_action"]) < 0.01
