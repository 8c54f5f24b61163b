"""A GPU restore is not part of an action's duration estimate (it is charged apart, per DoP)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from tangram.core.estimator import _Mean
from tangram.simulator.policies import policy_spec
from tangram.simulator.sim import Simulation
from tangram.simulator.workload import load_workload

from tests.helpers import make_action, make_engine, make_node


def test_complete_observes_the_run_without_its_restore():
    eng, clock = make_engine(make_node(cores=4))
    a = make_action("a", cpu={"min": 1, "max": 4}, t1=6.0, serial=0.0, cls="c")  # linear: T1 = exec x units
    (started,) = eng.submit(a)
    units = started.dispatch.dop
    clock.advance(10.0)
    eng.complete("a", restore_s=4.0)
    assert eng.record("a").exec_s == 10.0  # the record keeps the whole execution
    assert eng.estimator.mean_duration("c") == pytest.approx(6.0)
    assert eng.estimator.refined_t1("c") == pytest.approx(6.0 * units)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_complete_rejects_a_restore_that_is_not_a_finite_non_negative_number(bad):
    eng, clock = make_engine(make_node(cores=4))
    eng.submit(make_action("a", cpu=1, cls="c"))
    with pytest.raises(ValueError, match="restore_s"):
        eng.complete("a", restore_s=bad)
    assert set(eng.running) == {"a"} and eng.estimator.samples("c") == 0  # rejected before any change
    clock.advance(1.0)
    eng.complete("a", restore_s=0.25)  # and completes with a valid one
    assert not eng.running and eng.estimator.mean_duration("c") == pytest.approx(0.75)
    eng.check_invariants()


def test_simulator_reports_restores_so_estimates_see_runs_only():
    wl = load_workload("mopd-skewed").with_batch(48)
    sim = Simulation(wl, replace(policy_spec("tangram"), gpu_warm=False), seed=0)  # cold: the requests restore
    res = sim.run()
    gpu = sorted((r for r in res.records if r.item is not None and r.item.cls.rtype == "gpu"), key=lambda r: r.end)
    assert any(r.restore_s > 0 for r in gpu)  # the check below means something
    est = sim.engine.estimator
    by_class: dict[str, _Mean] = {}
    for r in gpu:
        by_class.setdefault(f"{r.item.cls.name}.{r.item.service}", _Mean()).add(r.run_s, est._min_weight)
    for cls, m in by_class.items():
        assert est.mean_duration(cls) == pytest.approx(m.value, rel=1e-9), cls
