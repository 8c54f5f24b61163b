"""scripts/policy_stress.py: random workloads of each family, tangram against the family's baselines."""
from __future__ import annotations

import json
import re
import sys

import pytest

from tangram.simulator.workload import builtin_raw, load_workload, parse_workload
from tests.test_simulator_scripts import ROOT

sys.path.append(str(ROOT / "scripts"))  # last: nothing of the scripts shadows a module of the tests
import policy_stress as stress  # noqa: E402  (by name: worker processes unpickle its functions)


def test_a_loss_is_a_baseline_below_tangram_by_more_than_the_tolerance():
    res = {"tangram": [10.0, 50.0, 100.0], "fixed-dop:4": [9.0, 50.4, 120.0], "trajectory": [20.0, 60.0, 99.5]}
    found = stress.losses(res, 0.01)
    assert found == [{"measure": "mean_act_s", "baseline": "fixed-dop:4", "ratio": pytest.approx(10 / 9, abs=1e-4)}]
    # 0.5% above trajectory's step: inside 1%, outside 0.1%
    assert {(x["measure"], x["baseline"]) for x in stress.losses(res, 0.001)} == {
        ("mean_act_s", "fixed-dop:4"), ("step_time_s", "trajectory")}


def test_the_summary_compares_tangram_with_the_best_baseline_that_did_all_its_work():
    rows = [
        {"results": {"tangram": [2.0, 10.0, 100.0], "a": [1.0, 20.0, 100.0], "b": [4.0, 5.0, 200.0]},
         "failed": {}, "losses": [{"baseline": "a"}]},
        {"results": {"tangram": [1.0, 10.0, 100.0], "a": [2.0, 20.0, 100.0], "b": [4.0, 40.0, 200.0]},
         "failed": {}, "losses": []},
        # "b" gave up on 7 actions: left out of the best, and a loss to it is not like for like
        {"results": {"tangram": [3.0, 30.0, 100.0], "a": [3.0, 30.0, 100.0], "b": [0.5, 1.0, 50.0]},
         "failed": {"b": 7}, "losses": [{"baseline": "b", "baseline_failed": 7}]},
    ]
    s = stress.summarize(rows, 0.01)
    assert s["workloads"] == 3 and s["losing_workloads"] == 2 and s["losing_like_for_like"] == 1
    mean = s["tangram_over_best"]["mean_act_s"]
    assert mean["geomean"] == pytest.approx((2.0 * 0.5 * 1.0) ** (1 / 3)) and mean["max"] == 2.0
    assert s["tangram_over_best"]["p99_act_s"] == {"geomean": pytest.approx((2.0 * 0.5 * 1.0) ** (1 / 3)),
                                                   "max": 2.0}


def test_a_loss_to_a_baseline_that_gave_up_on_actions_says_how_many():
    res = {"tangram": [10.0, 50.0, 100.0], "api-naive": [5.0, 60.0, 90.0], "api-retry": [9.0, 60.0, 100.0]}
    found = stress.mark_failed(stress.losses(res, 0.01), {"api-naive": 12})
    assert {(x["baseline"], x["measure"]): x.get("baseline_failed") for x in found} == {
        ("api-naive", "mean_act_s"): 12, ("api-naive", "step_time_s"): 12, ("api-retry", "mean_act_s"): None}


def test_a_baseline_dominates_when_tangram_beats_it_on_no_measure():
    res = {"tangram": [10.0, 50.0, 100.0],
           "a": [9.0, 50.4, 100.5],  # ahead on the mean, within 1% on the rest: dominates
           "b": [9.0, 60.0, 100.0],  # ahead on the mean, behind on the p99: a trade-off
           "c": [9.0, 40.0, 90.0],  # ahead on all three
           "d": [10.05, 50.0, 100.0],  # ahead on none (within 1%)
           "e": [5.0, 40.0, 90.0]}  # ahead on all three, but it gave up on actions
    assert stress.dominated_by(res, 0.01, {"e": 3}) == ["a", "c"]
    # at no tolerance "a" is behind tangram on the p99 and the step: a trade-off too
    assert stress.dominated_by(res, 0.0, {"e": 3}) == ["c"]
    rows = [{"results": res, "failed": {"e": 3}, "losses": [{"baseline": "a"}], "dominated_by": ["a", "c"]},
            {"results": res, "failed": {}, "losses": [{"baseline": "b"}], "dominated_by": []}]
    assert stress.summarize(rows, 0.01)["dominated_workloads"] == 1


def test_static_services_reproduce_mopd_skewed_deployment():
    wl = load_workload("mopd-skewed")
    names = sorted(wl.services, key=lambda n: wl.services[n].size_gb)
    static = stress._static_services([wl.services[n].size_gb for n in names], 24)
    got = {n: (c["dop"], c["replicas"]) for n, c in zip(names, static.values())}
    want = {n: wl.baselines.static[n] for n in names}
    # the same DoP for every teacher and the same replicas, but for the GPU the built-in leaves idle
    assert {n: d for n, (d, _) in got.items()} == {n: d for n, (d, _) in want.items()}
    assert {n: r - want[n][1] for n, (_, r) in got.items()} == {"t-7b": 0, "t-8b": 1, "t-14b": 0, "t-32b": 0,
                                                                 "t-70b": 0}
    for sizes, gpus in (([15, 30, 60, 130, 130], 24), ([60] * 8, 16), ([15] * 3, 8)):
        static = stress._static_services(sizes, gpus)
        assert sum(c["dop"] * c["replicas"] for c in static.values()) <= gpus
    assert stress._static_services([130] * 5, 8) is None  # one replica of each does not fit


@pytest.mark.parametrize("seed", range(12))
def test_every_draw_is_a_valid_workload(seed):
    assert parse_workload(stress.cpu_workload(seed), source="test").trajectories > 0
    api = parse_workload(stress.api_workload(seed), source="test")
    assert {p.name for p in api.cluster.api} == {"search", "fetch"}
    raw = stress.gpu_workload(seed)
    if raw is not None:
        wl = parse_workload(raw, source="test")
        assert set(wl.baselines.static) == set(wl.services)


def test_smoke_run_reports_every_policy_and_its_losses(capsys):
    assert stress.main(["--smoke", "--seeds", "0:2", "--jobs", "2", "--json"]) == 0  # worker processes
    out = json.loads(capsys.readouterr().out)
    assert set(out["summary"]) == {"cpu", "gpu", "api"}
    for row in out["workloads"]:
        assert set(row["results"]) == {"tangram", *stress.BASELINES[row["family"]]}
        assert row["workload"]["trajectories"] == 32
        # every loss is found, and one to a baseline that gave up on actions says how many
        assert row["losses"] == stress.mark_failed(stress.losses(row["results"], 0.01), row["failed"])
        assert row["dominated_by"] == stress.dominated_by(row["results"], 0.01, row["failed"])
    for fam, s in out["summary"].items():
        rows = [r for r in out["workloads"] if r["family"] == fam]
        assert s["workloads"] == len(rows) and s["losing_workloads"] == sum(1 for r in rows if r["losses"])
        assert s["dominated_workloads"] == sum(1 for r in rows if r["dominated_by"])


def test_a_policy_param_reaches_tangram_and_a_bad_one_is_refused(capsys):
    base = ["--smoke", "--family", "cpu", "--seeds", "1", "--jobs", "1", "--json"]
    assert stress.main(base + ["--param", "fixed_dop=1"]) == 0
    pinned = json.loads(capsys.readouterr().out)
    assert pinned["params"] == {"fixed_dop": 1}
    (row,) = pinned["workloads"]
    assert row["results"]["tangram"] == row["results"]["fixed-dop:1"]  # tangram ran as the DoP-1 baseline
    with pytest.raises(SystemExit):
        stress.main(base + ["--param", "no_such_field=1"])
    with pytest.raises(ValueError, match="order"):
        stress.main(base + ["--param", "order=random"])
    with pytest.raises(SystemExit):
        stress.main(["--seeds", "3:1"])  # no draw


def test_an_arrival_margin_is_stated_on_every_quota_pool():
    raw = stress.draw("api", 0, arrival_margin_s=0.5)
    pools = raw["cluster"]["api"]
    assert pools["search"]["arrival_margin_s"] == 0.5 and "arrival_margin_s" not in pools["fetch"]  # no quota
    assert "arrival_margin_s" not in stress.draw("api", 0)["cluster"]["api"]["search"]
    assert stress.draw("cpu", 0, arrival_margin_s=0.5) == stress.draw("cpu", 0)  # no API pools
    pools = stress.draw("api", 0, books="conservative")["cluster"]["api"]
    assert pools["search"]["books"] == "conservative" and "books" not in pools["fetch"]
    with pytest.raises(SystemExit):  # a stated margin is the books: one or the other
        stress.main(["--smoke", "--arrival-margin", "0.5", "--books", "conservative"])


def _earlier_run(base: list[str], tmp_path, capsys) -> tuple[object, dict]:
    """Run ``base`` and keep its output for --baselines-from: (its file, draw -> its row)."""
    assert stress.main(base) == 0
    earlier = tmp_path / "earlier.json"
    earlier.write_text(capsys.readouterr().out)
    return earlier, {r["seed"]: r for r in json.loads(earlier.read_text())["workloads"]}


def test_baselines_from_an_earlier_output_run_tangram_alone(tmp_path, capsys):
    base = ["--smoke", "--family", "cpu", "--seeds", "0:2", "--jobs", "1", "--json"]
    earlier, stored = _earlier_run(base, tmp_path, capsys)
    assert stress.main(base + ["--baselines-from", str(earlier), "--param", "fixed_dop=4"]) == 0
    for row in json.loads(capsys.readouterr().out)["workloads"]:
        before = stored[row["seed"]]["results"]
        assert {k: v for k, v in row["results"].items() if k != "tangram"} == {
            k: v for k, v in before.items() if k != "tangram"}
        assert row["results"]["tangram"] == before["fixed-dop:4"]  # this run's tangram, pinned at 4
    with pytest.raises(SystemExit, match="not the workload drawn now"):  # full-size draws against smoke runs
        stress.main(["--family", "cpu", "--seeds", "0:2", "--baselines-from", str(earlier)])
    with pytest.raises(SystemExit, match="simulation seed"):
        stress.main(base + ["--baselines-from", str(earlier), "--sim-seed", "1"])
    with pytest.raises(SystemExit, match="no run of cpu draw 2"):
        stress.main(["--smoke", "--family", "cpu", "--seeds", "0:3", "--baselines-from", str(earlier)])


@pytest.mark.parametrize("flag", [[], ["--warm-start", "all"]], ids=["default", "all"])
def test_warm_start_all_reruns_every_policy_on_tangrams_gpu_manager_warm(tmp_path, capsys, flag):
    """``--warm-start all`` (the default): tangram and the baselines that run tangram's GPU manager (api-naive,
    api-retry) run warm-started; with --baselines-from an output that ran them cold they are rerun, those
    with GPUs of their own reused."""
    from dataclasses import replace

    from tangram.simulator import simulate
    from tangram.simulator.policies import policy_spec

    base = ["--smoke", "--family", "api", "--seeds", "0:4", "--jobs", "1", "--json"]
    earlier, stored = _earlier_run(base + ["--cold-start"], tmp_path, capsys)
    assert json.loads(earlier.read_text())["warm_start"] is False
    assert stress.main(base + ["--baselines-from", str(earlier)] + flag) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["warm_start"] == "all"
    moved = 0
    for row in out["workloads"]:
        wl = stress.parse_workload(row["workload"], source="test")
        for name, got in row["results"].items():
            spec = policy_spec(name)
            if spec.gpu_mode == "eoe":
                s = simulate(wl, replace(spec, gpu_warm=True), seed=0).summary
                assert got == [s[m] for m in stress.MEASURES], (row["seed"], name)
                moved += got != stored[row["seed"]]["results"][name]
            else:
                assert got == stored[row["seed"]]["results"][name]  # reused
    assert moved  # the warm start changed some run: the draws have GPUs
    # an output that ran as now is reused whole but for tangram (its runs marked, to see them come back); with
    # tangram alone warm, the baselines on its GPU manager are rerun cold
    marked = _marked(out)
    again = tmp_path / "warm.json"
    again.write_text(json.dumps(marked))
    for mode in ([], ["--warm-start", "tangram"]):
        assert stress.main(base + ["--baselines-from", str(again)] + mode) == 0
        rows = {r["seed"]: r for r in json.loads(capsys.readouterr().out)["workloads"]}
        for row in marked["workloads"]:
            for name, got in row["results"].items():
                if name == "tangram":
                    continue
                cold = mode and policy_spec(name).gpu_mode == "eoe"
                want = stored[row["seed"]]["results"][name] if cold else got
                assert rows[row["seed"]]["results"][name] == want, (mode, name)


def _marked(out: dict) -> dict:
    """``out`` with every baseline's measures replaced by marks no run gives (negative): a reused run shows."""
    marked = json.loads(json.dumps(out))
    for i, row in enumerate(marked["workloads"]):
        for j, name in enumerate(sorted(row["results"])):
            if name != "tangram":
                row["results"][name] = [-1.0 - i, -1.0 - j, -1.0]
    return marked


def test_a_cold_output_s_baselines_are_reused_where_a_draw_has_no_gpu(tmp_path, capsys):
    base = ["--smoke", "--family", "cpu", "--seeds", "0:2", "--jobs", "1", "--json"]
    earlier, _ = _earlier_run(base + ["--cold-start"], tmp_path, capsys)
    marked = _marked(json.loads(earlier.read_text()))
    earlier.write_text(json.dumps(marked))
    assert stress.main(base + ["--baselines-from", str(earlier)]) == 0  # the default: every GPU manager warm
    for row, before in zip(json.loads(capsys.readouterr().out)["workloads"], marked["workloads"], strict=True):
        assert {n: v for n, v in row["results"].items() if n != "tangram"} == \
               {n: v for n, v in before["results"].items() if n != "tangram"}


def test_unprofiled_rewards_and_more_steps_are_drawn_on_request(capsys):
    raw = stress.draw("cpu", 0, unprofiled=True, steps=2)
    assert all(not c["profiled"] for c in raw["rewards"].values()) and raw["steps"] == 2
    plain = stress.draw("cpu", 0)
    assert all(c["profiled"] for c in plain["rewards"].values()) and plain["steps"] == 1
    assert stress.main(["--smoke", "--family", "cpu", "--seeds", "0:1", "--jobs", "1", "--unprofiled",
                        "--steps", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["unprofiled"] is True and out["steps"] == 2
    (row,) = out["workloads"]
    assert row["workload"]["steps"] == 2 and not row["workload"]["rewards"]["test-suite"]["profiled"]
    with pytest.raises(SystemExit):
        stress.main(["--smoke", "--steps", "0"])


@pytest.mark.parametrize("seed", range(12))
def test_a_neighbour_is_its_built_in_moved_by_the_drawn_factors(seed):
    raw = stress.neighbour_workload(seed)
    built_in = raw["name"].split("~")[0]
    assert built_in == stress.builtin_names()[seed % len(stress.builtin_names())]
    base = load_workload(built_in)
    wl = parse_workload(raw, source="test")
    factor = dict(zip("agtc", map(float, re.fullmatch(r".*~a([\d.]+)g([\d.]+)t([\d.]+)c([\d.]+)-\d+",
                                                      raw["name"]).groups())))
    for nodes in ("cpu_nodes", "gpu_nodes"):  # half up, and none stays none
        built = getattr(base.cluster, nodes)
        assert getattr(wl.cluster, nodes) == (max(1, int(built * factor["c"] + 0.5)) if built else 0)
    assert {j.trajectories for j in wl.jobs} <= {128, 256, 512, 1024}  # each job's batch, as Workload.with_batch
    assert len({j.trajectories for j in wl.jobs}) == 1
    if "jobs" in raw:  # a job of several workloads moves its batch and nodes only
        assert (factor["a"], factor["g"], factor["t"]) == (1, 1, 1)
        assert [j["name"] for j in raw["jobs"]] == [f"{j['workload']}-{seed}" for j in raw["jobs"]]
    orig = builtin_raw(built_in)
    if isinstance(orig.get("turns"), dict):  # mean and cap, half up
        for key in ("mean", "max"):
            assert raw["turns"][key] == max(1, int(orig["turns"][key] * factor["t"] + 0.5))
    # a smoke draw is the full draw at 32 trajectories
    assert stress.neighbour_workload(seed, smoke=True)["name"] == raw["name"]
    # the static deployment follows the cluster, and leaves the baselines where it does not fit
    scaled = {s: (d, max(1, int(n * factor["c"] + 0.5))) for s, (d, n) in base.baselines.static.items()}
    fits = sum(d * n for d, n in scaled.values()) <= wl.cluster.gpu_nodes * wl.cluster.gpus_per_node
    assert ("static-services" in wl.baselines.compare) == ("static-services" in base.baselines.compare and fits)
    if "static-services" in wl.baselines.compare:
        assert dict(wl.baselines.static) == scaled
    assert set(wl.baselines.compare) <= set(base.baselines.compare)


def test_a_neighbour_scales_its_durations_and_keeps_the_rest():
    seed = next(s for s in range(60) if stress.neighbour_workload(s)["name"].startswith("ai-coding~a2g0.5"))
    raw = stress.neighbour_workload(seed)
    orig = builtin_raw("ai-coding")
    assert raw["actions"]["shell"]["duration_s"]["mean"] == 2 * orig["actions"]["shell"]["duration_s"]["mean"]
    suite = next(iter(raw["rewards"].values()))["duration_s"]
    orig_suite = next(iter(orig["rewards"].values()))["duration_s"]
    assert (suite["mean"], suite["max"]) == (2 * orig_suite["mean"], 2 * orig_suite["max"])
    assert raw["generation_s"]["mean"] == 0.5 * orig["generation_s"]["mean"]
    assert raw["memory_mb"] == orig["memory_mb"] and raw["rewards"].keys() == orig["rewards"].keys()


def test_a_neighbours_smoke_run_compares_each_with_its_built_ins_baselines(capsys):
    assert stress.main(["--smoke", "--family", "neighbours", "--seeds", "0:6", "--jobs", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["summary"]) == {"neighbours"}
    names = sorted(row["workload"]["name"].split("~")[0] for row in out["workloads"])
    assert names == stress.builtin_names()  # six draws: each built-in once
    for row in out["workloads"]:
        assert set(row["results"]) == {"tangram", *row["workload"]["baselines"]["compare"]}


def test_unprofiled_neighbours_refuse_a_job_of_several_workloads():
    # mopd+search's jobs read their workloads' own files, profiles included: nothing to withhold here
    with pytest.raises(SystemExit, match="mopd\\+search.* a job of several workloads"):
        stress.main(["--smoke", "--family", "neighbours", "--seeds", "0:6", "--unprofiled", "--jobs", "1"])
    raw = stress.draw("neighbours", 0, smoke=True, unprofiled=True)  # a single workload: withheld
    assert [cls["profiled"] for cls in raw["rewards"].values()] == [False]


def test_a_generation_scale_multiplies_every_draws_generation_time(capsys):
    plain, slow = stress.draw("cpu", 3), stress.draw("cpu", 3, generation_scale=10.0)
    assert slow["generation_s"]["mean"] == pytest.approx(10.0 * plain["generation_s"]["mean"])
    assert slow["generation_s"]["cv"] == plain["generation_s"]["cv"]
    assert slow["name"] == plain["name"] + "-generation-x10"
    assert stress.main(["--smoke", "--family", "cpu", "--seeds", "0:1", "--jobs", "1", "--generation-scale", "3",
                        "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["generation_scale"] == 3.0
    (row,) = out["workloads"]
    smoke = stress.draw("cpu", 0, smoke=True)
    assert row["workload"]["generation_s"]["mean"] == pytest.approx(3.0 * smoke["generation_s"]["mean"])
    for bad in ("0", "-1", "inf", "nan"):
        with pytest.raises(SystemExit, match="generation-scale"):
            stress.main(["--smoke", "--family", "cpu", "--generation-scale", bad])
    # mopd+search's jobs read their workloads' own files: no generation time of its own to scale
    with pytest.raises(SystemExit, match="--generation-scale: mopd\\+search.* a job of several workloads"):
        stress.main(["--smoke", "--family", "neighbours", "--seeds", "0:6", "--generation-scale", "2", "--jobs", "1"])


@pytest.mark.parametrize("seed", range(12))
def test_a_mixed_draw_uses_every_kind_of_resource_in_one_trajectory(seed):
    raw = stress.draw("mixed", seed)
    wl = parse_workload(raw, source="test")
    (job,) = wl.jobs
    assert {c.rtype for c in job.actions} == {"cpu", "api:search"}
    assert {c.rtype for c in job.rewards} == {"cpu", "gpu"}  # every trajectory runs both rewards
    compare = raw["baselines"]["compare"]
    assert len(compare) == len(set(compare))  # each baseline once
    assert set(compare) == {b for fam in stress.FAMILIES for b in stress.BASELINES[fam]} - (
        set() if "static_services" in raw["baselines"] else {"static-services"})
    if "static_services" in raw["baselines"]:
        assert set(wl.baselines.static) == set(wl.services)


def test_a_mixed_smoke_run_compares_with_every_familys_baselines(capsys):
    assert stress.main(["--smoke", "--family", "mixed", "--seeds", "0:2", "--jobs", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["summary"]) == {"mixed"} and out["summary"]["mixed"]["workloads"] == 2
    for row in out["workloads"]:
        assert set(row["results"]) == {"tangram", *row["workload"]["baselines"]["compare"]}
        assert row["losses"] == stress.mark_failed(stress.losses(row["results"], 0.01), row["failed"])


def test_restartable_marks_every_elastic_cpu_reward_and_nothing_else(capsys):
    plain, marked = stress.draw("mixed", 30), stress.draw("mixed", 30, restartable=True)
    assert marked["name"] == plain["name"]  # its random streams follow the name: the same draw
    for name, cls in marked["rewards"].items():  # the test suite (a cpu range), not the judge on GPUs
        assert cls.get("restartable", False) == isinstance(cls["resources"].get("cpu"), dict), name
    assert any(cls.get("restartable") for cls in marked["rewards"].values())
    assert not any(cls.get("restartable") for cls in marked["actions"].values())
    assert {k: v for k, v in marked.items() if k not in ("name", "rewards")} == {
        k: v for k, v in plain.items() if k not in ("name", "rewards")}
    assert stress.main(["--smoke", "--family", "cpu", "--seeds", "3:4", "--jobs", "1", "--restartable",
                        "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (row,) = out["workloads"]
    assert out["restartable"] is True and row["workload"]["rewards"]["test-suite"]["restartable"] is True
    assert set(row["results"]) == {"tangram", *row["workload"]["baselines"]["compare"]}
