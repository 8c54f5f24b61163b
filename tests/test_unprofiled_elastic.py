"""An elastic action without a profile: its class's T1 and elasticity are learned online.

Before, such an action (a DoP range, no T1 or elasticity) ran at its smallest DoP for good, and
a fixed DoP of 4 beat tangram by 1.8x on a workload whose suites were not profiled. Now the first
run of the class is at its smallest DoP; after it the class has a T1 and a cautious Amdahl guess
(``UNPROFILED_SERIAL_FRACTION``), and once runs at two DoPs are seen its serial fraction is
fitted from them.
"""
from __future__ import annotations

import pytest

from tangram.core.engine import Engine
from tangram.core.errors import ConfigError
from tangram.core.estimator import UNPROFILED_SERIAL_FRACTION, DurationEstimator
from tangram.core.model import Action, Elasticity
from tangram.managers.base import CountingManager
from tangram.policy.snapshot import PolicyParams
from tangram.service.config import parse_config
from tangram.simulator.policies import policy_spec
from tangram.simulator.sim import simulate
from tangram.simulator.workload import parse_workload
from tests.helpers import FakeClock


def _suite(i: int, cls: str = "suite") -> Action:
    return Action.build(f"{cls}{i}", {"cpu": {"min": 1, "max": 8}}, action_class=cls)


def test_the_first_run_is_at_the_smallest_dop_and_then_the_class_has_a_model():
    est = DurationEstimator()
    first = est.refine(_suite(0))
    assert first.t1_s is None and not first.scalable
    est.observe(first, 1, 40.0)
    second = est.refine(_suite(1))
    assert second.scalable
    assert second.t1_s == pytest.approx(40.0)
    assert second.elasticity.serial_fraction == UNPROFILED_SERIAL_FRACTION
    # a run at 4 units under the guess: T(4) = T1 * (0.5 + 0.5 / 4)
    est.observe(second, 4, 25.0)
    t1 = est.refine(_suite(2)).t1_s
    assert t1 == pytest.approx((40.0 + 25.0 / 0.625) / 2)


@pytest.mark.parametrize("serial", [0.0, 0.05, 0.3, 0.8])
def test_the_serial_fraction_is_fitted_from_runs_at_two_dops(serial):
    true = Elasticity.amdahl(serial)
    est = DurationEstimator(refine_after=3)
    for i in range(3):
        for m in (1, 4):
            est.observe(est.refine(_suite(10 * i + m)), m, true.duration(60.0, m))
    learned = est.refine(_suite(99))
    assert learned.elasticity.serial_fraction == pytest.approx(serial, abs=1e-9)
    assert learned.t1_s == pytest.approx(60.0)


def test_runs_that_do_not_speed_up_are_fitted_as_nearly_serial():
    est = DurationEstimator(refine_after=1)
    est.observe(est.refine(_suite(0)), 1, 30.0)
    est.observe(est.refine(_suite(1)), 8, 31.0)
    assert est.refine(_suite(2)).elasticity.serial_fraction == pytest.approx(0.99)


def test_a_profiled_action_and_a_fixed_one_are_not_learned_this_way():
    est = DurationEstimator()
    fixed = Action.build("f", {"cpu": 2}, action_class="shell")
    est.observe(fixed, 2, 3.0)
    assert est.refine(Action.build("g", {"cpu": 2}, action_class="shell")).t1_s is None
    profiled = Action.build("p", {"cpu": {"min": 1, "max": 8}}, action_class="p", t1_s=10.0,
                            elasticity=Elasticity.amdahl(0.1))
    assert est.refine(profiled) is profiled


def test_a_dropped_class_is_unlearned():
    est = DurationEstimator(max_classes=1)
    est.observe(est.refine(_suite(0, "a")), 1, 10.0)
    assert est.refine(_suite(1, "a")).scalable
    est.observe(Action.build("x", {"cpu": 1}, action_class="other"), 1, 1.0)  # drops "a"
    assert not est.refine(_suite(2, "a")).scalable


def test_the_engine_widens_an_unprofiled_action_onto_idle_cores_after_its_first_run():
    clock = FakeClock()
    eng = Engine([CountingManager({"cpu@n0": 8, "mem@n0": 10_000})], clock=clock)
    dops = []
    for i in range(3):
        started = eng.submit(_suite(i))
        (s,) = started
        dops.append(s.dispatch.units["cpu"])
        clock.advance(10.0)
        eng.complete(s.action.id)
    assert dops[0] == 1 and dops[1] == 8 and dops[2] == 8


WORKLOAD = {
    "name": "unprofiled-suites", "trajectories": 40, "steps": 2,
    "turns": {"dist": "lognormal", "mean": 5, "cv": 0.5, "min": 1, "max": 40},
    "generation_s": {"dist": "lognormal", "mean": 3.0, "cv": 0.8},
    "memory_mb": 8192, "env_start_s": 1.0,
    "actions": {"shell": {"weight": 1.0, "duration_s": {"dist": "lognormal", "mean": 1.0, "cv": 1.5},
                          "resources": {"cpu": 1}}},
    "rewards": {"suite": {"duration_s": {"dist": "lognormal", "mean": 30.0, "cv": 1.0, "max": 600},
                          "resources": {"cpu": {"min": 1, "max": 16}}, "elasticity": {"amdahl": 0.2},
                          "profiled": False}},
    "cluster": {"cpu_nodes": 1, "cores_per_node": 64, "mem_gb_per_node": 512},
    "baselines": {"compare": ["fixed-dop:1", "fixed-dop:4"]},
}


def test_unprofiled_suites_run_wider_than_their_smallest_dop_in_the_simulator():
    wl = parse_workload(WORKLOAD)
    res = simulate(wl, policy_spec("tangram"), seed=0, check=True)
    suites = [r for r in res.records if r.item is not None and r.item.cls.name == "suite"]
    assert len(suites) == 80
    assert sum(r.units > 1 for r in suites) > len(suites) // 2
    narrow = simulate(wl, policy_spec("fixed-dop:1"), seed=0).summary
    assert res.summary["mean_act_s"] < narrow["mean_act_s"]


def test_learning_can_be_turned_off():
    est = DurationEstimator()
    est.observe(est.refine(_suite(0), False), 1, 40.0)
    assert not est.refine(_suite(1), False).scalable
    clock = FakeClock()
    eng = Engine([CountingManager({"cpu@n0": 8, "mem@n0": 10_000})], clock=clock,
                 params=PolicyParams(learn_unprofiled=False))
    for i in range(2):
        (s,) = eng.submit(_suite(i))
        assert s.dispatch.units["cpu"] == 1
        clock.advance(10.0)
        eng.complete(s.action.id)


def test_the_knob_is_validated_and_read_from_the_config():
    with pytest.raises(ValueError, match="learn_unprofiled"):
        PolicyParams(learn_unprofiled="no")
    node = {"name": "n0", "cores": 2, "memory_mb": 1024}
    assert parse_config({"cpu_nodes": [node]}).learn_unprofiled is True
    assert parse_config({"scheduler": {"learn_unprofiled": False}, "cpu_nodes": [node]}).learn_unprofiled is False
    with pytest.raises(ConfigError) as e:
        parse_config({"scheduler": {"learn_unprofiled": 1}, "cpu_nodes": [node]})
    assert e.value.field == "scheduler.learn_unprofiled"


def test_fixed_runs_of_the_same_class_do_not_feed_the_learned_model():
    est = DurationEstimator()
    est.observe(Action.build("sh", {"cpu": 1}, action_class="exec"), 1, 0.5)  # a one-core shell
    assert not est.refine(_suite(1, "exec")).scalable  # no elastic run has ended yet
    est.observe(_suite(2, "exec"), 1, 40.0)
    assert est.refine(_suite(3, "exec")).t1_s == pytest.approx(40.0)


def test_elastic_actions_that_never_run_keep_nothing():
    est = DurationEstimator(max_classes=4)
    for i in range(1000):  # a client naming a new class per action, none of which runs
        est.refine(_suite(i, f"c{i}"))
    assert est._by_dop == {} and est._learned == {}
    for i in range(10):
        est.observe(_suite(i, f"c{i}"), 2, 5.0)
    assert len(est._by_dop) == len(est._learned) == est.classes() == 4
