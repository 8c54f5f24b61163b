"""The demo's parts, each on real inputs: the shared result shape, the machine measurement,
the Ray tasks baseline on a real local Ray, and the projection on the real simulator."""
from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

import pytest

from tangram.demo.results import compare, document, policy_entry, verdict

pytestmark = pytest.mark.timeout(240)


def _run(mean, p99, step, **extra):
    return {"actions": 4, "mean_act_s": mean, "p50_act_s": mean / 2, "p99_act_s": p99, "step_time_s": step,
            "failed": 0, **extra}


def test_policy_entry_takes_medians_and_keeps_every_run():
    runs = [_run(3.0, 9.0, 20.0), _run(1.0, 5.0, 30.0), _run(2.0, 7.0, 10.0)]
    e = policy_entry(runs)
    assert (e["mean_act_s"], e["p99_act_s"], e["step_time_s"]) == (2.0, 7.0, 20.0)
    assert e["spread"]["step_time_s"] == [10.0, 30.0] and e["actions"] == 4 and isinstance(e["actions"], int)
    assert e["runs"] == runs
    with pytest.raises(ValueError):
        policy_entry([])


def test_ratios_say_when_a_difference_is_inside_the_spread():
    ref = policy_entry([_run(1.0, 4.0, 10.0), _run(1.2, 4.4, 11.0)])
    overlapping = policy_entry([_run(1.1, 4.2, 10.5), _run(1.5, 4.8, 12.0)])
    clearly_worse = policy_entry([_run(3.0, 9.0, 20.0), _run(3.3, 9.9, 22.0)])
    r = compare({"tangram": ref, "a": overlapping, "b": clearly_worse}, "tangram")
    assert set(r) == {"a", "b"}
    assert r["a"]["within_spread"]["mean_act"] and r["a"]["mean_act"] == round(1.3 / 1.1, 3)
    assert not r["b"]["within_spread"]["step_time"] and r["b"]["step_time"] == 2.0
    assert "within noise" in verdict("a", r["a"]) and "tangram better" in verdict("b", r["b"])
    doc = document("coding", {"tangram": ref, "a": overlapping}, reference="tangram", projection=None, extra=1)
    assert doc["workload"] == "coding" and doc["ratios"]["a"] == r["a"] and doc["extra"] == 1


def test_machine_measurement_is_real():
    from tangram.demo.machine import explain, measure

    cores = sorted(os.sched_getaffinity(0))[:2]
    m = measure(cores, work=1_000_000)
    # a busy machine makes the number noisy, never meaningless: n x (one alone) / (n together)
    assert m["cores"] == len(cores) and m["one_process_s"] > 0 and m["all_processes_s"] > 0
    assert abs(m["parallel_speedup"] - len(cores) * m["one_process_s"] / m["all_processes_s"]) <= 0.0051
    assert 0.0 <= m["busy_before"] <= 1.0
    text = " ".join(explain(m))
    assert f"ideal {len(cores)}x" in text


def test_ray_tasks_baseline_runs_the_rollout_and_cleans_up(tmp_path):
    pytest.importorskip("ray")
    from tangram.demo.ray_tasks import RayTasks
    from tangram.demo.rollout import RolloutSpec

    spec = RolloutSpec(trajectories=2, turns=1, gap_s=0.05, cores=2, pod_cores=1)
    ray = RayTasks(2, reward_dop=1)
    tmp = ray.tmp
    try:
        r = asyncio.run(ray.run(spec, tmp_path / "w", lambda: None))
    finally:
        ray.close()
    assert not os.path.exists(tmp) and os.environ.get("RAY_TMPDIR") != tmp  # Ray's state removed, env restored
    assert r.rewards == [1.0, 1.0]  # the real suite passed in both working directories
    kinds = sorted(s.kind for s in r.samples)
    assert kinds == ["reward", "reward", "shell", "shell"] and all(s.ok for s in r.samples)
    assert all(s.dop == 1 for s in r.samples if s.kind == "reward")
    assert not any((tmp_path / "w").iterdir())  # working directories removed


def test_projection_feeds_measured_inputs_to_the_simulator():
    from tangram.demo.projection import inputs, project
    from tangram.demo.rollout import ActionSample, RolloutResult, RolloutSpec

    spec = RolloutSpec(trajectories=2, turns=2, gap_s=1.0, pod_cores=1)
    r = RolloutResult("trajectory", 10.0, samples=[
        ActionSample(0, "shell", 0.2, 0.0, 0.2, 1, True), ActionSample(0, "shell", 0.4, 0.0, 0.4, 1, True),
        ActionSample(0, "reward", 6.0, 0.0, 6.0, 1, True), ActionSample(1, "reward", 8.0, 0.0, 8.0, 1, True)],
        setup_s=[0.1, 0.3])
    profile = str(Path(__file__).resolve().parents[1] / "tangram" / "demo" / "numkit_profile.json")
    inp = inputs(spec, {"trajectory": [r]}, profile, "numkit-suite", serial_fraction=0.05)
    assert inp["reward_t1_s"] == 7.0 and inp["serial_fraction"] == 0.05 and inp["env_start_s"] == 0.2
    assert abs(inp["shell_s"]["mean"] - 0.3) < 1e-9 and inp["gap_s"] == [0.5, 1.5] and inp["turns"] == 2
    measured = inputs(spec, {"trajectory": [r]}, profile, "numkit-suite")
    assert measured["serial_fraction"] > 0.9 and "numkit_profile.json" in measured["serial_fraction_source"]
    p = project(inp, cores=64, trajectories=96, pod_cores=1, ray_dop=1)
    assert p["simulated"] and p["cores"] == 64 and p["trajectories"] == 96
    assert list(p["policies"]) == ["tangram", "ray-tasks", "trajectory"]
    assert p["policies"]["ray-tasks"]["simulated_as"] == "fixed-dop:1"
    # 96 one-core pods on 64 cores queue; with an elastic reward (5% serial) tangram's step is shorter
    assert p["ratios"]["trajectory"]["step_time"] > 1.0
    big = project(inp, cores=3840, trajectories=64, pod_cores=1, ray_dop=None)
    assert big["cpu_nodes"] == 15 and "ray-tasks" not in big["policies"]


def test_projection_adds_a_labelled_scaling_scenario_when_the_suite_did_not_scale():
    from tangram.demo.projection import SCALING_SERIAL_FRACTION, project

    inp = {"shell_s": {"dist": "lognormal", "mean": 0.1, "cv": 0.5}, "shell_source": "t", "reward_t1_s": 6.0,
           "reward_t1_source": "t", "serial_fraction": 0.99, "serial_fraction_source": "measured",
           "gap_s": [0.5, 1.5], "turns": 2, "env_start_s": 0.1}
    p = project(inp, cores=64, trajectories=32, pod_cores=1, ray_dop=1, scaling_scenario=True)
    alt = p["if_scaling"]
    assert alt["inputs"]["serial_fraction"] == SCALING_SERIAL_FRACTION and "guess" in alt["inputs"]["serial_fraction_source"]
    # 1-core baselines never see the elasticity; tangram's elastic reward does
    assert alt["policies"]["trajectory"] == p["policies"]["trajectory"]
    assert alt["policies"]["tangram"]["mean_act_s"] < p["policies"]["tangram"]["mean_act_s"]
    assert "if_scaling" not in project({**inp, "serial_fraction": 0.1}, cores=64, trajectories=32, pod_cores=1,
                                       ray_dop=None, scaling_scenario=True)
