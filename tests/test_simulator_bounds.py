"""The overload-aware lower bounds: SRPT on one pooled machine, and the wait for memory slots."""
from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from tangram.simulator.bounds import memory_makespan_bound, memory_wait_bound, pooled_bound_mean, srpt_flow_sum
from tangram.simulator.sim import simulate
from tangram.simulator.workload import load_workload


def _best_nonpreemptive_flow_sum(arrivals, sizes):
    """Brute force over every order of running the jobs to completion one by one."""
    best = None
    for order in itertools.permutations(range(len(sizes))):
        t = total = 0.0
        for j in order:
            t = max(t, arrivals[j]) + sizes[j]
            total += t - arrivals[j]
        best = total if best is None else min(best, total)
    return best


def test_srpt_by_hand():
    # a long job, preempted by a short one at t=1
    assert srpt_flow_sum([0.0, 1.0], [4.0, 1.0]) == pytest.approx(1.0 + 5.0)
    assert srpt_flow_sum([0.0, 10.0], [2.0, 3.0]) == pytest.approx(5.0)  # idle gap between them
    assert srpt_flow_sum([], []) == 0.0


@pytest.mark.parametrize("seed", range(5))
def test_srpt_never_exceeds_any_nonpreemptive_order(seed):
    rng = random.Random(seed)
    for _ in range(30):
        n = rng.randint(1, 6)
        arrivals = [rng.uniform(0, 5) for _ in range(n)]
        sizes = [rng.uniform(0.1, 3) for _ in range(n)]
        assert srpt_flow_sum(arrivals, sizes) <= _best_nonpreemptive_flow_sum(arrivals, sizes) + 1e-9


def test_pooled_bound_divides_work_by_capacity():
    groups = {"cpu": ([0.0, 0.0], [8.0, 8.0])}  # two jobs of 8 core-seconds on 4 cores: 2 s each pooled
    assert pooled_bound_mean(groups, {"cpu": 4}) == pytest.approx((2.0 + 4.0) / 2)


@pytest.mark.parametrize("workload,batch", [("mopd", 128), ("cpu-contended", 96)])
def test_no_policy_beats_the_bounds(workload, batch):
    wl = load_workload(workload).with_batch(batch)
    for policy in ["tangram", *wl.baselines.compare]:
        s = simulate(wl, policy).summary
        assert s["overload_bound_mean_act_s"] >= s["lower_bound_mean_act_s"]
        assert s["mean_act_s"] >= s["overload_bound_mean_act_s"] - 1e-9, policy
        assert 0.0 <= s["restore_share_of_exec"] < 1.0


def _best_list_schedule_wait(releases, holds, slots):
    """Brute force: every order, each trajectory in turn on the slot that frees first."""
    best = None
    for order in itertools.permutations(range(len(holds))):
        free = [0.0] * slots
        total = 0.0
        for j in order:
            k = min(range(slots), key=free.__getitem__)
            start = max(free[k], releases[j])
            free[k] = start + holds[j]
            total += start - releases[j]
        best = total if best is None else min(best, total)
    return best


def test_memory_wait_by_hand():
    # holds 1, 2, 3, 4 on two slots, all at t=0: shortest first, the 3 s one waits 1 s, the 4 s one 2 s
    assert memory_wait_bound([0.0] * 4, [4.0, 1.0, 3.0, 2.0], 2) == pytest.approx(3.0)
    assert memory_wait_bound([0.0, 5.0], [9.0, 9.0], 2) == 0.0  # a slot each: nobody waits
    assert memory_wait_bound([0.0, 0.0], [1.0, 1.0], 0) == 0.0  # no memory to speak of


@pytest.mark.parametrize("seed", range(5))
def test_memory_wait_bound_never_exceeds_a_real_schedule(seed):
    rng = random.Random(100 + seed)
    for _ in range(25):
        n, slots = rng.randint(1, 6), rng.randint(1, 3)
        releases = [rng.choice([0.0, rng.uniform(0, 4)]) for _ in range(n)]
        holds = [rng.uniform(0.5, 5) for _ in range(n)]
        best = _best_list_schedule_wait(releases, holds, slots)
        assert memory_wait_bound(releases, holds, slots) <= best + 1e-9
        span = memory_makespan_bound(releases, holds, slots)
        assert span <= max(r + h for r, h in zip(releases, holds)) + sum(holds)  # and it is a makespan
        assert span >= max(r + h for r, h in zip(releases, holds)) - 1e-9


def test_memory_bound_is_informative_when_trajectories_queue_for_memory():
    base = load_workload("cpu-contended")
    # one node of 64 sandbox slots for 160 trajectories: most wait for memory
    wl = base.with_batch(160).with_cluster(replace(base.cluster, cpu_nodes=1))
    bounds = {}
    for policy in ["tangram", *wl.baselines.compare]:
        s = simulate(wl, policy).summary
        assert s["mean_act_s"] >= s["memory_bound_mean_act_s"] - 1e-9, policy
        assert s["step_time_s"] >= s["memory_bound_step_time_s"] - 1e-9, policy
        bounds[policy] = (s["memory_bound_mean_act_s"], s["memory_bound_step_time_s"])
    mem, step = bounds["tangram"]
    assert len(set(bounds.values())) == 1  # the trajectories' scripts alone decide it
    assert mem > 1.5 * s["lower_bound_mean_act_s"] and step >= s["lower_bound_step_time_s"]
    light = simulate(base.with_batch(64), "tangram").summary  # 256 slots: nobody waits
    assert light["memory_bound_mean_act_s"] == pytest.approx(light["lower_bound_mean_act_s"])
