"""The simulator: the real engine and policy on a virtual clock (small, fast scenarios)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tangram.cli import main
from tangram.simulator.errors import WorkloadError
from tangram.simulator.policies import policy_spec
from tangram.simulator.sim import Simulation, simulate
from tangram.simulator.workload import ApiPool, builtin_names, builtin_raw, load_workload, parse_cluster, parse_workload

CONTRACT = ("policy", "workload", "actions", "mean_act_s", "p50_act_s", "p99_act_s", "mean_queue_s",
            "mean_exec_s", "step_time_s", "lower_bound_mean_act_s")


def small_coding(batch: int = 12, cores: int = 16):
    """ai-coding on one small node: contended (12 pods of 4 cores need 48 cores)."""
    wl = load_workload("ai-coding").with_batch(batch)
    return wl.with_cluster(replace(wl.cluster, cpu_nodes=1, cores_per_node=cores))


def small_search(batch: int = 16):
    """deepsearch with tight API limits."""
    wl = load_workload("deepsearch").with_batch(batch)
    api = (ApiPool("search", 2, 2, 1.0), ApiPool("fetch", 2, None, 1.0))
    return wl.with_cluster(replace(wl.cluster, api=api))


def check_complete(wl, res) -> None:
    """Every trajectory of every step ran each of its job's rewards once, after all its other actions.

    Counted from the workload's definition (trajectories x steps x reward classes),
    not from the simulator's own scripts; and the summary counts what was recorded.
    """
    assert res.summary["actions"] == len(res.records)
    rewards = {j.name: [c.name for c in j.rewards] for j in wl.jobs}
    by_traj: dict[str, list] = {}
    for r in res.records:
        by_traj.setdefault(r.traj.id, []).append(r)
    expected_trajectories = sum(j.trajectories for j in wl.jobs) * wl.steps
    assert len(by_traj) == expected_trajectories
    for recs in by_traj.values():
        names = rewards[recs[0].traj.job.name]
        got = sorted((r for r in recs if r.item.cls.kind == "reward"), key=lambda r: r.submit)
        assert [r.item.cls.name for r in got] == names
        others = [r.end for r in recs if r.item.cls.kind != "reward"]
        if got and others:  # the rewards run at the trajectory's end
            assert max(others) <= got[0].submit + 1e-9


# --------------------------------------------------------------------------- #
# determinism and completeness


def test_same_seed_same_result_and_other_seed_differs():
    wl = small_coding()
    a = simulate(wl, "tangram", seed=3).summary
    b = simulate(wl, "tangram", seed=3).summary
    c = simulate(wl, "tangram", seed=4).summary
    assert a == b
    assert a["mean_act_s"] != c["mean_act_s"]


@pytest.mark.parametrize("policy", ["tangram", "trajectory", "fixed-dop:1", "fixed-dop:16"])
def test_every_cpu_action_completes_with_invariants_checked(policy):
    wl = small_coding().with_steps(2)
    s = Simulation(wl, policy, seed=1, check=True)
    res = s.run()
    check_complete(wl, res)
    assert not s.engine.waiting and not s.engine.running
    assert all(r.end >= r.start >= r.submit for r in res.records)
    assert len(res.summary["step_times_s"]) == 2


@pytest.mark.parametrize("policy", ["tangram", "api-naive", "static-services", "serverless", "fixed-dop:2"])
def test_every_search_and_gpu_action_completes(policy):
    wl = small_search()
    s = Simulation(wl, policy, seed=2, check=True)
    res = s.run()
    check_complete(wl, res)
    assert not s.engine.waiting and not s.engine.running


def test_mopd_and_shared_pool_complete():
    for name in ("mopd", "mopd-skewed", "mopd+search"):
        wl = load_workload(name).with_batch(12)
        for policy in ("tangram", "static-services", "serverless"):
            res = simulate(wl, policy, seed=0, check=True)
            check_complete(wl, res)
    shared = simulate(load_workload("mopd+search").with_batch(12), "tangram").summary
    assert set(shared["job_step_time_s"]) == {"mopd", "deepsearch"}


# --------------------------------------------------------------------------- #
# bounds and comparisons


@pytest.mark.parametrize("policy", ["tangram", "trajectory", "fixed-dop:1", "fixed-dop:4"])
def test_lower_bound_is_below_mean_act(policy):
    s = simulate(small_coding(), policy, seed=0).summary
    assert s["lower_bound_mean_act_s"] <= s["mean_act_s"] + 1e-9
    assert s["lower_bound_step_time_s"] <= s["step_time_s"] + 1e-9


@pytest.mark.parametrize("policy", ["tangram", "fixed-dop:1", "fixed-dop:4"])
def test_each_action_runs_for_its_true_duration_at_the_dop_it_got(policy):
    wl = small_coding()
    res = simulate(wl, policy, seed=0)
    for r in res.records:
        true_s = r.item.cls.elasticity.duration(r.item.t1, r.units) if r.item.cls.elasticity else r.item.t1
        assert r.run_s == pytest.approx(true_s)
        # start to end: the environment's set-up (first action of a trajectory) and the run, nothing else
        assert r.end - r.start == pytest.approx(r.setup_s + r.restore_s + r.run_s)
    mean_exec = sum(r.end - r.start for r in res.records) / len(res.records)
    assert res.summary["mean_exec_s"] == pytest.approx(mean_exec)


def test_tangram_beats_trajectory_and_fixed_dop_1_when_contended():
    wl = small_coding()
    t = simulate(wl, "tangram", seed=0).summary
    k8s = simulate(wl, "trajectory", seed=0).summary
    dop1 = simulate(wl, "fixed-dop:1", seed=0).summary
    assert t["mean_act_s"] < k8s["mean_act_s"]
    assert t["mean_act_s"] < dop1["mean_act_s"]
    # pods hold their cores for the trajectory's life; tangram only while an action runs
    assert t["pools"]["cpu"]["reserved_unit_s"] < k8s["pools"]["cpu"]["reserved_unit_s"]


def test_api_naive_retries_and_tangram_never_does():
    wl = small_search()
    naive = simulate(wl, "api-naive", seed=0).summary
    managed = simulate(wl, "tangram", seed=0).summary
    assert naive["retries"] > 0
    assert managed["retries"] == 0 and managed["failed"] == 0


def test_api_retry_is_api_naive_that_never_gives_up():
    """Where the naive client fails calls after its retries, the same client retrying until it
    succeeds fails none, and runs every call the full time it takes (a failed call ends early)."""
    wl = small_search(64)
    naive = simulate(wl, "api-naive", seed=0)
    retry = simulate(wl, "api-retry", seed=0)
    assert naive.summary["failed"] > 0
    assert retry.summary["failed"] == 0 and retry.summary["retries"] > 0
    assert retry.summary["actions"] == naive.summary["actions"]
    check_complete(wl, retry)
    api = [r for r in retry.records if r.rtype.startswith("api:")]
    assert api and all(r.end - r.start == pytest.approx(r.run_s) for r in api)


def test_static_services_reserve_their_gpus_for_the_whole_step():
    wl = load_workload("mopd").with_batch(16)
    res = simulate(wl, "static-services")
    static = res.summary
    dedicated = wl.baselines.static
    assert static["pools"]["gpu"]["capacity"] == sum(dop * n for dop, n in dedicated.values())
    gpu = [r for r in res.records if r.item.cls.rtype == "gpu"]
    assert gpu and all(r.units == dedicated[r.item.service][0] and r.restore_s == 0.0 for r in gpu)
    assert static["mean_restore_s"] == 0.0
    # the dedicated GPUs are reserved all step long but busy only while an action runs on them
    assert static["pools"]["gpu"]["utilisation"] < static["pools"]["gpu"]["reserved_frac"]


# --------------------------------------------------------------------------- #
# the command line


def last_json(capsys) -> dict:
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


def test_cli_json_contract(capsys):
    rc = main(["simulate", "--workload", "ai-coding", "--policy", "tangram", "--batch", "4", "--seed", "1", "--json"])
    assert rc == 0
    obj = last_json(capsys)
    for k in CONTRACT:
        assert k in obj, k
    assert obj["policy"] == "tangram" and obj["workload"] == "ai-coding" and obj["actions"] > 0


def test_cli_cluster_file_and_policy_all(tmp_path, capsys):
    cluster = tmp_path / "c.yaml"
    cluster.write_text("cpu_nodes: 1\ncores_per_node: 16\nmem_gb_per_node: 512\n")
    rc = main(["simulate", "--workload", "ai-coding", "--policy", "all", "--batch", "4", "--cluster", str(cluster), "--json"])
    assert rc == 0
    obj = last_json(capsys)
    assert [r["policy"] for r in obj["results"]][:2] == ["tangram", "trajectory"]
    assert obj["results"][0]["pools"]["cpu"]["capacity"] == 16
    for k in CONTRACT:
        assert k in obj


def test_cli_workload_file(tmp_path, capsys):
    wl = tmp_path / "w.yaml"
    wl.write_text(
        "name: tiny\ntrajectories: 3\nturns: 2\ngeneration_s: 1.0\n"
        "actions:\n  sh: {duration_s: 0.5, resources: {cpu: 1}}\n"
        "rewards:\n  tests: {duration_s: 8, resources: {cpu: {min: 1, max: 8}}, elasticity: {amdahl: 0.1}, profiled: true}\n"
        "cluster: {cpu_nodes: 1, cores_per_node: 8, mem_gb_per_node: 64}\n"
    )
    assert main(["simulate", "--workload", str(wl), "--json"]) == 0
    obj = last_json(capsys)
    assert obj["workload"] == "tiny" and obj["actions"] == 9


@pytest.mark.parametrize("argv, needle", [
    (["--workload", "no-such-workload"], "workload"),
    (["--workload", "ai-coding", "--policy", "fifo"], "policy"),
    (["--workload", "ai-coding", "--policy", "fixed-dop:x"], "fixed-dop"),
    (["--workload", "ai-coding", "--batch", "0"], "batch"),
    (["--workload", "ai-coding", "--cluster", "/nonexistent/c.yaml"], "cluster"),
])
def test_cli_bad_input(argv, needle, capsys):
    assert main(["simulate", *argv]) != 0
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("text, field", [
    ("name: x\ntrajectories: [1\n", "malformed YAML"),
    ("name: x\nturns: 1\ngeneration_s: 1\ncluster: {cpu_nodes: 1, cores_per_node: 4}\n", "trajectories"),
    ("name: x\ntrajectories: 2\nturns: 1\ngeneration_s: {dist: lognormal, mean: 1}\n"
     "actions: {a: {duration_s: 1, resources: {cpu: 1}}}\ncluster: {cpu_nodes: 1, cores_per_node: 4}\n", "generation_s.cv"),
    ("name: x\ntrajectories: 2\nturns: 1\ngeneration_s: 1\n"
     "actions: {a: {duration_s: 1, resources: {tpu: 1}}}\ncluster: {cpu_nodes: 1, cores_per_node: 4}\n", "actions.a.resources.tpu"),
    ("name: x\ntrajectories: 2\nturns: 1\ngeneration_s: 1\n"
     "actions: {a: {duration_s: 1, resources: {cpu: {min: 1, max: 8}}}}\ncluster: {cpu_nodes: 1, cores_per_node: 4}\n",
     "actions.a.elasticity"),
    ("name: x\ntrajectories: 2\nturns: 1\ngeneration_s: 1\n"
     "actions: {a: {duration_s: 1, resources: {api:search: 1}}}\ncluster: {cpu_nodes: 1, cores_per_node: 4}\n",
     "cluster.api.search"),
])
def test_malformed_workloads_name_the_field(tmp_path, capsys, text, field):
    wl = tmp_path / "bad.yaml"
    wl.write_text(text)
    assert main(["simulate", "--workload", str(wl)]) == 2
    assert field in capsys.readouterr().err


def test_errors_are_workload_errors():
    with pytest.raises(WorkloadError) as ei:
        policy_spec("k8s")
    assert ei.value.field == "policy"
    with pytest.raises(WorkloadError) as ei:
        parse_cluster({"cpu_nodes": 1, "cores_per_node": 4, "api": {"s": {}}}, "cluster")
    assert ei.value.field == "cluster.api.s"


def test_arrival_margin_frees_quota_sooner_and_stays_within_the_providers_limit():
    base = load_workload("deepsearch").with_batch(128)
    searches = {}
    for margin, books in ((None, "conservative"), (None, "adaptive"), (0.05, None)):
        # a quota of 8 calls a second, so that it binds at this batch
        api = tuple(replace(p, quota=8, arrival_margin_s=margin, books=books if margin is None else "adaptive")
                    if p.quota else p for p in base.cluster.api)
        res = simulate(base.with_cluster(replace(base.cluster, api=api)), "tangram", seed=0)
        assert res.summary["retries"] == 0 and res.summary["failed"] == 0
        starts = [r.start for r in res.records if r.rtype == "api:search"]
        # the simulated provider counts a call at its dispatch, in fixed windows of period_s from 0
        per_window = {}
        for t in starts:
            per_window[int(t // 1.0)] = per_window.get(int(t // 1.0), 0) + 1
        assert max(per_window.values()) <= 8
        searches[books if margin is None else margin] = res.summary["by_class"]["search"]["mean_act_s"]
    # conservative books count a call until its answer, so in two windows whenever it spans a boundary;
    # the adaptive books' guess (0.5 s) is never withdrawn here: the simulated provider counts at dispatch
    assert searches[0.05] < searches["conservative"] and searches["adaptive"] < searches["conservative"]
    with pytest.raises(WorkloadError) as ei:
        parse_cluster({"cpu_nodes": 1, "cores_per_node": 4,
                       "api": {"s": {"quota": 5, "period_s": 1, "books": "optimistic"}}}, "cluster")
    assert ei.value.field == "cluster.api.s.books"
    for lim in ({"concurrency": 5, "books": "conservative"},
                {"quota": 5, "period_s": 1, "arrival_margin_s": 0.1, "books": "adaptive"}):
        with pytest.raises(WorkloadError, match="no arrival_margin_s") as ei:
            parse_cluster({"cpu_nodes": 1, "cores_per_node": 4, "api": {"s": lim}}, "cluster")
        assert ei.value.field == "cluster.api.s.books"
    with pytest.raises(WorkloadError) as ei:
        parse_cluster({"cpu_nodes": 1, "cores_per_node": 4,
                       "api": {"s": {"quota": 5, "period_s": 1, "arrival_margin_s": -1}}}, "cluster")
    assert ei.value.field == "cluster.api.s.arrival_margin_s"


def _gen2_collections_while(block) -> int:
    """Full collections Python ran while ``block()`` ran."""
    import gc

    seen = []

    def on_gc(phase, info):
        if phase == "stop" and info["generation"] == 2:
            seen.append(info)

    gc.callbacks.append(on_gc)
    try:
        block()
    finally:
        gc.callbacks.remove(on_gc)
    return len(seen)


def test_full_collections_are_deferred_within_the_block_and_thresholds_come_back():
    import gc

    from tangram.simulator.collections_deferred import full_collections_deferred

    # long-lived containers, half as many as the process tracks (Python runs a full collection once
    # they have grown by a quarter): what makes full collections run
    n = max(300_000, len(gc.get_objects()) // 2)

    def grow():
        keep = [[i] for i in range(n)]
        return len(keep)

    before = gc.get_threshold()
    if not gc.isenabled() or before[0] == 0:
        pytest.fail("this test needs Python's automatic collection on, as a default process has it")
    # a full collection first: Python compares the growth with what the last one kept, which a freed
    # large heap (an earlier test's) would leave too high for this growth to reach
    gc.collect()
    assert _gen2_collections_while(grow) > 0  # the premise: Python runs them for this much
    with full_collections_deferred():
        assert _gen2_collections_while(grow) == 0
        assert gc.get_threshold()[:2] == before[:2]  # the young generations as before
    assert gc.get_threshold() == before
    with pytest.raises(RuntimeError), full_collections_deferred():
        raise RuntimeError("a simulation that fails")
    assert gc.get_threshold() == before
    with full_collections_deferred():  # nested: the inner block's end keeps the outer's deferral
        with full_collections_deferred():
            pass
        assert gc.get_threshold()[2] > before[2]
    assert gc.get_threshold() == before


def test_full_collections_deferred_in_overlapping_threads_give_the_thresholds_back():
    """Two threads whose blocks overlap, the first to enter leaving first: the thresholds come
    back when the second leaves, not to the deferred ones the second saw on entering."""
    import gc
    import threading

    from tangram.simulator.collections_deferred import full_collections_deferred

    before = gc.get_threshold()
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with full_collections_deferred():
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second():
        first_in.wait(10)
        with full_collections_deferred():
            second_in.set()
            first_out.wait(10)
            seen["deferred after the first left"] = gc.get_threshold()[2] > before[2]

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == {"deferred after the first left": True}
    assert gc.get_threshold() == before


def test_a_simulation_defers_full_collections_while_it_runs_and_restores_the_thresholds():
    import gc

    before = gc.get_threshold()
    sim = Simulation(small_coding(), "tangram", seed=0)
    during = []
    policy = sim.engine.policy

    def watched(snap):
        during.append(gc.get_threshold())
        return policy(snap)

    sim.engine.policy = watched
    res = sim.run()
    assert res.summary["actions"] > 0 and during
    assert all(t[:2] == before[:2] and t[2] > before[2] for t in during)  # every round: deferred
    assert gc.get_threshold() == before


def test_a_built_ins_raw_mapping_parses_to_the_built_in_and_a_wrong_name_is_refused():
    for name in builtin_names():
        assert parse_workload(builtin_raw(name), source=f"builtin:{name}") == load_workload(name)
    with pytest.raises(WorkloadError, match="unknown workload 'mopd2'"):
        builtin_raw("mopd2")


@pytest.mark.parametrize("workload", builtin_names())
def test_a_trajectory_is_its_generation_and_its_actions(workload):
    """Every second of a one-step trajectory is generation or one of its actions (queued or
    running): the actions' ACTs sum to the trajectories' completion times less their generation.
    Both the count of actions and the generation are the seed's, the same under every policy, so
    on these closed loops mean ACT = (sum of trajectory completion times - generation) / actions
    with the same constants for all (docs/results/README.md reads the API workloads' mean ACT so)."""
    wl = load_workload(workload).with_batch(16)
    assert wl.steps == 1
    constants = set()
    for policy in ["tangram", *wl.baselines.compare]:
        res = Simulation(wl, policy, seed=3).run()
        trajs = {id(r.traj): r.traj for r in res.records}
        assert len(trajs) == 16 * len(wl.jobs)  # mopd+search: two jobs of 16
        generation = sum(i.gen_s for t in trajs.values() for i in t.items)
        acts = sum(r.end - r.submit for r in res.records)
        assert acts > 0
        assert acts == pytest.approx(sum(t.end for t in trajs.values()) - generation, rel=1e-9)
        assert res.summary["mean_act_s"] == pytest.approx(acts / len(res.records), rel=1e-9)
        constants.add((len(res.records), round(generation, 6)))
    assert len(constants) == 1  # the same actions and generation under every policy


def test_a_class_or_trajectory_no_node_holds_is_refused_naming_its_field():
    raw = {"name": "w", "trajectories": 2, "turns": 2, "generation_s": 1.0, "memory_mb": 1024,
           "actions": {"shell": {"duration_s": 1.0, "resources": {"cpu": 4}}},
           "cluster": {"cpu_nodes": 1, "cores_per_node": 2, "mem_gb_per_node": 8}}
    with pytest.raises(WorkloadError) as e:
        parse_workload(raw)
    assert e.value.field == "actions.shell.resources.cpu"
    raw["actions"]["shell"]["resources"]["cpu"] = 2
    raw["memory_mb"] = 16384
    with pytest.raises(WorkloadError) as e:
        parse_workload(raw)
    assert e.value.field == "memory_mb"


def test_a_gpu_class_whose_dops_cannot_hold_its_model_is_refused_before_the_run():
    # a 300 GB model needs 8 GPUs of 80 GB (a GPU's weights at most MEM_FRACTION of it): a class
    # that asks for 2 or 4 GPUs would fail every one of its requests mid-run
    raw = {"name": "w", "trajectories": 2, "turns": 0, "generation_s": 1.0,
           "rewards": {"judge": {"duration_s": 1.0, "resources": {"gpu": [2, 4]}, "service": ["big", "small"],
                                 "elasticity": {"amdahl": 0.1}}},
           "services": {"small": {"size_gb": 16}, "big": {"size_gb": 300}},
           "cluster": {"gpu_nodes": 1, "gpus_per_node": 8, "gpu_mem_gb": 80}}
    with pytest.raises(WorkloadError) as e:
        parse_workload(raw)
    assert e.value.field == "rewards.judge.resources.gpu"
    assert "'big'" in e.value.reason and "[2, 4]" in e.value.reason and "[8]" in e.value.reason
    raw["rewards"]["judge"]["resources"]["gpu"] = {"min": 1, "max": 7}  # a range: named by its ends
    with pytest.raises(WorkloadError) as e:
        parse_workload(raw)
    assert e.value.field == "rewards.judge.resources.gpu" and "(1-7)" in e.value.reason
    raw["rewards"]["judge"]["resources"]["gpu"] = [2, 4, 8]
    assert simulate(parse_workload(raw), "tangram").summary["actions"] == 2


@pytest.mark.parametrize("pod_cores", [1, 8])
def test_a_pod_that_cannot_hold_an_action_or_fit_a_node_is_refused(pod_cores):
    raw = {"name": "w", "trajectories": 2, "turns": 2, "generation_s": 1.0, "memory_mb": 1024,
           "actions": {"shell": {"duration_s": 1.0, "resources": {"cpu": 2}}},
           "cluster": {"cpu_nodes": 1, "cores_per_node": 4, "mem_gb_per_node": 8},
           "baselines": {"trajectory": {"pod_cores": pod_cores}}}
    wl = parse_workload(raw)
    with pytest.raises(WorkloadError) as e:
        simulate(wl, "trajectory")
    assert e.value.field == "baselines.trajectory.pod_cores"
    assert simulate(wl, "tangram").summary["actions"] == 4  # tangram runs it
