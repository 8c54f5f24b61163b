"""Profiling pipeline: model fitting, unfit classes, the profile store, refine, report, tune."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("sklearn", reason="the profiling extra is missing: pip install '.[profiling]'")

from profiling.fit import FitResult, Sample, Unfit, fit_class  # noqa: E402
from profiling.store import STORE_VERSION, ProfileStore, StoreError, entry_from_fit, profile_from_entry, refine  # noqa: E402


def amdahl(t1: float, s: float, m: int) -> float:
    return t1 * (s + (1 - s) / m)


# --------------------------------------------------------------------------- #
# fitting


@pytest.mark.parametrize("t1,s", [(10.0, 0.2), (3.5, 0.0), (42.0, 0.75), (1.0, 1.0)])
def test_fit_recovers_amdahl_exactly(t1, s):
    # noise-free Amdahl samples at 1, 2, 4, 8 with 3 repeats: s and T1 come back exactly
    samples = [Sample(m, amdahl(t1, s, m), r) for m in (1, 2, 4, 8) for r in range(3)]
    fit = fit_class(samples)
    assert isinstance(fit, FitResult)
    assert fit.model == "amdahl"
    assert fit.t1_s == pytest.approx(t1, rel=1e-9)
    assert fit.serial_fraction == pytest.approx(s, abs=1e-9)
    assert fit.samples == 12
    assert fit.dops == [1, 2, 4, 8]
    assert sorted(fit.efficiency) == list(range(1, 9))  # every feasible DoP, not only measured
    for m in range(1, 9):
        assert fit.efficiency[m] == pytest.approx(min(1.0, 1 / (m * (s + (1 - s) / m))), rel=1e-9)
    assert fit.cv_error < 1e-9


def test_fit_amdahl_with_single_repeat_uses_leave_one_dop_out():
    fit = fit_class([Sample(m, amdahl(8.0, 0.3, m)) for m in (1, 2, 4, 8)])
    assert fit.model == "amdahl" and fit.cv_method == "leave-one-dop-out"
    assert fit.serial_fraction == pytest.approx(0.3, abs=1e-9)
    assert fit.t1_s == pytest.approx(8.0, rel=1e-9)


def test_fit_amdahl_with_noise_is_close():
    rng = np.random.default_rng(7)
    samples = [Sample(m, amdahl(20.0, 0.1, m) * (1 + 0.02 * rng.standard_normal()), r)
               for m in (1, 2, 4, 8, 16) for r in range(4)]
    fit = fit_class(samples)
    assert fit.model == "amdahl"
    assert fit.serial_fraction == pytest.approx(0.1, abs=0.03)
    assert fit.t1_s == pytest.approx(20.0, rel=0.05)


def test_isotonic_chosen_when_not_amdahl_shaped():
    # a knee: perfect speedup to 4 cores, then a plateau (e.g. 4 big test files): not a + b/m
    t = {1: 8.0, 2: 4.0, 3: 8 / 3, 4: 2.0, 6: 2.0, 8: 2.0}
    samples = [Sample(m, t[m] * (1 + 0.005 * r), r) for m in t for r in range(3)]
    fit = fit_class(samples)
    assert fit.model == "isotonic"
    assert fit.candidates["isotonic"] < fit.candidates["amdahl"]
    assert fit.serial_fraction is None
    assert fit.efficiency[4] == pytest.approx(1.0, abs=0.01)
    assert fit.efficiency[8] == pytest.approx(0.5, rel=0.02)
    assert all(0 < e <= 1 for e in fit.efficiency.values())


def test_two_dops_one_sample_each_falls_back_to_direct_table():
    fit = fit_class([Sample(1, 10.0), Sample(2, 6.0)])
    assert isinstance(fit, FitResult)
    assert fit.model == "table"
    assert fit.t1_s == 10.0
    assert fit.efficiency == {1: 1.0, 2: pytest.approx(10 / 12)}


def test_slower_with_more_cores_is_clipped_not_rejected():
    # DoP 2 slower than DoP 1 (xdist start-up on a busy box): E(2) < 0.5 but valid
    fit = fit_class([Sample(1, 2.0), Sample(2, 3.0)])
    assert fit.efficiency[2] == pytest.approx(2 / 6)
    fit = fit_class([Sample(m, 2.0 + 0.5 * m, r) for m in (1, 2, 4) for r in range(2)])
    assert all(0 < e <= 1 for e in fit.efficiency.values())


def test_table_chosen_when_more_cores_are_consistently_slower():
    # DoP 2 slower than DoP 1 in every repeat (start-up costs on a busy box): monotone fits flatten
    # to a constant and overstate E(2) as 0.5; the per-DoP table keeps the measured E(2) = 10 / (2 * 13)
    samples = [Sample(1, 10.0 + 0.2 * r, r) for r in range(3)] + [Sample(2, 13.0 + 0.2 * r, r) for r in range(3)]
    fit = fit_class(samples)
    assert fit.model == "table"
    assert fit.t1_s == pytest.approx(10.2)
    assert fit.efficiency[2] == pytest.approx(10.2 / (2 * 13.2))


@pytest.mark.parametrize("samples,why", [
    ([Sample(1, 5.0), Sample(1, 5.1), Sample(1, 4.9)], "distinct DoPs"),  # one DoP only
    ([], "distinct DoPs"),  # nothing measured
    ([Sample(2, 5.0), Sample(4, 3.0)], "DoP-1"),  # no T1 and too little to fit a model
    ([Sample(m, x, r) for r, xs in enumerate([(10, 1, 9), (1, 12, 1), (10, 1, 9)]) for m, x in zip((1, 2, 4), xs)],
     "too noisy"),  # wildly inconsistent repeats
])
def test_unfit_classes_are_reported(samples, why):
    res = fit_class(samples)
    assert isinstance(res, Unfit)
    assert why in res.reason


def test_noise_threshold_is_configurable():
    samples = [Sample(m, amdahl(10, 0.2, m) * (1.3 if r else 0.7), r) for m in (1, 2, 4) for r in range(2)]
    assert isinstance(fit_class(samples, max_cv_error=0.1), Unfit)
    assert isinstance(fit_class(samples, max_cv_error=1.0), FitResult)


# --------------------------------------------------------------------------- #
# store


def _store_with_fit() -> ProfileStore:
    fit = fit_class([Sample(m, amdahl(10.0, 0.2, m), r) for m in (1, 2, 4) for r in range(2)])
    st = ProfileStore()
    st.put("suite-a", entry_from_fit(fit, measured={1: [10.0, 10.0], 2: [6.0, 6.0], 4: [4.0, 4.0]}))
    st.put_unfit("suite-b", "needs samples at >= 2 distinct DoPs, got 1", samples=3, dops=[1])
    return st


def test_store_round_trip_and_contract_keys(tmp_path):
    st = _store_with_fit()
    path = tmp_path / "profiles.json"
    st.save(path)
    doc = json.loads(path.read_text())
    assert doc["version"] == STORE_VERSION == 1
    assert "created" in doc
    entry = doc["classes"]["suite-a"]
    assert isinstance(entry["t1_s"], float) and entry["t1_s"] > 0
    assert isinstance(entry["samples"], int) and entry["samples"] == 6
    assert set(entry["efficiency"]) == {"1", "2", "3", "4"}
    assert all(0 < v <= 1 for v in entry["efficiency"].values())
    assert entry["model"] == "amdahl" and entry["serial_fraction"] == pytest.approx(0.2)
    assert "suite-b" in doc["unfit"] and "suite-b" not in doc["classes"]
    back = ProfileStore.load(path)
    assert back.to_dict() == st.to_dict()


def test_profile_from_entry_matches_fit():
    st = _store_with_fit()
    prof = profile_from_entry(st.classes["suite-a"])
    assert prof.t1_s == pytest.approx(10.0)
    for m in (1, 2, 3, 4):
        assert prof.elasticity.duration(prof.t1_s, m) == pytest.approx(amdahl(10.0, 0.2, m), rel=1e-9)
    entry = {**st.classes["suite-a"], "max_dop": 3}  # an entry's own cap is kept, as the service keeps it
    assert profile_from_entry(entry).max_dop == 3 and profile_from_entry(entry, max_dop=2).max_dop == 2


def test_service_loader_reads_our_format(tmp_path):
    import tangram.profiles as profiles
    path = tmp_path / "p.json"
    _store_with_fit().save(path)
    loaded = profiles.load_profiles(path)
    assert set(loaded) == {"suite-a"}
    assert loaded["suite-a"].elasticity.efficiency(2) == pytest.approx(1 / (2 * 0.6))


@pytest.mark.parametrize("doc,msg", [
    ({"version": 2, "classes": {}}, "unsupported version"),
    ({"classes": {}}, "'version'"),
    ({"version": 1, "classes": {"x": {"t1_s": -1, "efficiency": {"1": 1}, "samples": 1}}}, "t1_s"),
    ({"version": 1, "classes": {"x": {"t1_s": 1, "efficiency": {"2": 1.5}, "samples": 1}}}, "efficiency"),
    ({"version": 1, "classes": {"x": {"t1_s": 1, "efficiency": {"1": 1}}}}, "samples"),
])
def test_store_rejects_bad_files(tmp_path, doc, msg):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(StoreError, match=msg):
        ProfileStore.load(path)


def test_store_merge_newer_wins_and_unfit_keeps_last_good():
    old = _store_with_fit()
    new = ProfileStore()
    new.put("suite-b", {"t1_s": 3.0, "efficiency": {"1": 1.0, "2": 0.9}, "samples": 4})
    new.put_unfit("suite-a", "too noisy", samples=2)
    merged = old.merge(new)
    assert merged.classes["suite-b"]["t1_s"] == 3.0 and "suite-b" not in merged.unfit  # now fitted
    assert merged.classes["suite-a"] == old.classes["suite-a"]  # a failed re-run keeps the last good fit
    assert "suite-a" not in merged.unfit


def test_refine_writes_online_t1_back(tmp_path):
    from tangram.core.estimator import DurationEstimator
    from tangram.core.model import Action

    st = _store_with_fit()
    prof = st.profile("suite-a")
    est = DurationEstimator()
    # the suite got slower: observed 7.2 s at DoP 2, whose E(2) = 1 / (2 * 0.6) -> T1 = 12 s
    for i in range(3):
        a = Action.build(f"a{i}", {"cpu": {"min": 1, "max": 4}}, action_class="suite-a", profile=prof)
        est.observe(a, 2, 7.2)
    changed = refine(st, est)
    assert changed == {"suite-a": (pytest.approx(10.0), pytest.approx(12.0))}
    assert st.classes["suite-a"]["t1_s"] == pytest.approx(12.0)
    assert st.classes["suite-a"]["t1_refined"]["observations"] == 3
    path = tmp_path / "refined.json"
    st.save(path)
    assert ProfileStore.load(path).classes["suite-a"]["t1_s"] == pytest.approx(12.0)
    assert refine(st, DurationEstimator()) == {}  # nothing observed: nothing changes


def test_refine_keeps_a_profile_the_runs_do_not_contradict():
    from tangram.core.estimator import DurationEstimator
    from tangram.core.model import Action

    st = _store_with_fit()
    prof = st.profile("suite-a")
    est = DurationEstimator()
    # T1 10 s (T(2) = 0.6 T1): runs of 4.5, 10.5 and 6.6 s at DoP 2 are observed T1s of 7.5, 17.5
    # and 11 s, mean 12 s (as in the test above) but a standard error of 2.9 s: 2 s off is within two
    for i, secs in enumerate((4.5, 10.5, 6.6)):
        a = Action.build(f"a{i}", {"cpu": {"min": 1, "max": 4}}, action_class="suite-a", profile=prof)
        est.observe(a, 2, secs)
    assert est.refined_t1("suite-a") == pytest.approx(12.0)
    assert refine(st, est) == {}
    assert st.classes["suite-a"]["t1_s"] == pytest.approx(10.0) and "t1_refined" not in st.classes["suite-a"]


# --------------------------------------------------------------------------- #
# report


def test_report_writes_png_per_class(tmp_path, capsys):
    from tangram.cli import main

    path = tmp_path / "p.json"
    _store_with_fit().save(path)
    rc = main(["profile", "report", "--store", str(path), "--out", str(tmp_path / "plots")])
    assert rc == 0
    png = tmp_path / "plots" / "suite-a.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "suite-a" in out and "amdahl" in out


# --------------------------------------------------------------------------- #
# tune (optuna on the simulator)


def _small_workload():
    from dataclasses import replace

    from tangram.simulator.workload import load_workload

    wl = load_workload("ai-coding").with_batch(12)
    return wl.with_cluster(replace(wl.cluster, cpu_nodes=1, cores_per_node=8))


def test_apply_profiles_uses_calibrated_t1_and_efficiency():
    from profiling.tune import apply_profiles, elastic_classes

    wl = _small_workload()
    st = _store_with_fit()
    new, applied = apply_profiles(wl, st, mapping={"test-suite": "suite-a"})
    assert applied == {"test-suite": "suite-a"}
    cls = next(c for j in new.jobs for c in j.rewards if c.name == "test-suite")
    assert cls.duration.mean == pytest.approx(10.0)
    assert cls.elasticity.efficiency(2) == pytest.approx(1 / 1.2)
    assert elastic_classes(new) == {"test-suite": 8}
    with pytest.raises(KeyError, match="not in the store"):
        apply_profiles(wl, st, mapping={"test-suite": "nope"})


def test_tune_never_worse_than_defaults(tmp_path, capsys):
    pytest.importorskip("optuna")
    from tangram.cli import main

    path = tmp_path / "p.json"
    _store_with_fit().save(path)
    out = tmp_path / "tuned.json"
    rc = main(["tune", "--workload", "ai-coding", "--profiles", str(path), "--map", "test-suite=suite-a",
               "--batch", "12", "--cpu-nodes", "1", "--cores-per-node", "8", "--trials", "6", "--no-progress",
               "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert set(doc["policy"]) == {"depth", "lookahead", "dop_caps"}
    assert doc["mean_act_s"] <= doc["default"]["mean_act_s"]
    assert doc["applied_profiles"] == {"test-suite": "suite-a"}
    assert all(k == "test-suite" and 1 <= v < 8 for k, v in doc["policy"]["dop_caps"].items())
    printed = capsys.readouterr().out
    assert "simulated mean ACT" in printed and "default" in printed


async def test_tune_config_fragment_is_loaded_by_serve(tmp_path):
    pytest.importorskip("optuna")
    from tangram.cli import main
    from tangram.service.build import build_runtime
    from tangram.service.config import load_config

    store = tmp_path / "p.json"
    _store_with_fit().save(store)
    fragment = tmp_path / "tuned.yaml"
    assert main(["tune", "--workload", "ai-coding", "--profiles", str(store), "--map", "test-suite=suite-a",
                 "--batch", "12", "--cpu-nodes", "1", "--cores-per-node", "8", "--trials", "4", "--no-progress",
                 "--out", str(tmp_path / "tuned.json"), "--config-out", str(fragment)]) == 0
    chosen = json.loads((tmp_path / "tuned.json").read_text())["policy"]
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("cpu_nodes: [{name: local, cores: 1, memory_mb: 256, isolation: none}]\n"
                       "scheduler: {depth: 1, lookahead: 2, default_duration_s: 3.0}\n")
    cfg = load_config([cluster, fragment])
    assert (cfg.depth, cfg.lookahead, dict(cfg.dop_caps)) == (chosen["depth"], chosen["lookahead"],
                                                              chosen["dop_caps"])
    assert cfg.default_duration_s == 3.0 and [n.name for n in cfg.cpu_nodes] == ["local"]  # the rest is kept
    async with await build_runtime(cfg) as rt:  # the service's engine runs with the tuned knobs
        p = rt.engine.params
        assert (p.depth, p.lookahead, dict(p.dop_caps)) == (chosen["depth"], chosen["lookahead"], chosen["dop_caps"])
    # and `tangram serve` takes both files (--check: validate without serving)
    assert main(["serve", "--config", str(cluster), "--config", str(fragment), "--check", "--no-auth"]) == 0


def test_config_rejects_a_bad_dop_cap():
    from tangram.service.config import ConfigError, parse_config

    with pytest.raises(ConfigError) as e:
        parse_config({"cpu_nodes": [], "gpu_nodes": [], "scheduler": {"dop_caps": {"suite": 0}}})
    assert e.value.field == "scheduler.dop_caps.suite"
