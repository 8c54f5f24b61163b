"""The overload-aware lower bound: SRPT on one pooled machine."""
from __future__ import annotations

import itertools
import random

import pytest

from tangram.simulator.bounds import pooled_bound_mean, srpt_flow_sum
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
