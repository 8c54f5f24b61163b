"""The action model: demands, elasticity, validation of bad input."""
from __future__ import annotations

import pickle

import pytest

from tangram.core.errors import ConfigError, DemandError, FieldError, UnavailableError, UnschedulableError
from tangram.core.model import Action, Demand, Elasticity, Profile, parse_demand, render_command
from tangram.simulator.errors import WorkloadError


def test_demand_forms():
    assert parse_demand(4, field="f").options == (4,)
    assert parse_demand({"min": 2, "max": 4}, field="f").options == (2, 3, 4)
    assert parse_demand([8, 1, 2, 2], field="f").options == (1, 2, 8)
    assert Demand.range(1, 3).elastic and not Demand.fixed(3).elastic


def test_a_huge_range_is_three_integers_not_a_list():
    import tracemalloc

    tracemalloc.start()
    a = Action.build("big", {"cpu": {"min": 1, "max": 10 ** 9}}, t1_s=1.0, elasticity=Elasticity.linear())
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    d = a.demands["cpu"]
    assert (d.min, d.max, len(d), d.picks) == (1, 10 ** 9, 10 ** 9, None)
    assert peak < 1 << 20  # a materialised tuple of 10^9 ints would take ~36 GiB
    assert d.capped(8).options == tuple(range(1, 9)) and d.capped(0) is None
    assert 5 in d and 10 ** 9 + 1 not in d
    picks = Demand.choices([1, 2, 64])
    assert picks.capped(8).options == (1, 2) and picks.capped(1).options == (1,) and not picks.capped(1).elastic


@pytest.mark.parametrize("raw, field", [
    ({"min": 1, "max": 2 ** 40}, "resources.cpu.max"),  # past MAX_UNITS: refused before anything is built
    (list(range(1, 1000)), "resources.cpu"),  # more explicit choices than a list may hold
    ({"min": 2 ** 70}, "resources.cpu.min"),
])
def test_out_of_bound_demands_are_refused(raw, field):
    with pytest.raises(DemandError) as e:
        Action.build("a", {"cpu": raw})
    assert e.value.field == field


@pytest.mark.parametrize(
    "demands, field",
    [
        ({"gpu": [1, 3]}, "resources.gpu"),  # GPU DoP outside {1, 2, 4, 8}
        ({"cpu": []}, "resources.cpu"),  # empty unit set
        ({"cpu": {"min": 0, "max": 2}}, "resources.cpu.min"),  # zero units
        ({"cpu": {"min": 4, "max": 2}}, "resources.cpu.max"),  # inverted range
        ({"cpu": "four"}, "resources.cpu"),  # wrong type
        ({"cpu": {"min": 1, "max": 2}, "gpu": [1, 2]}, "resources"),  # two elastic resources
        ({"disk": 1}, "resources.disk"),  # unknown resource type
        ({}, "resources"),  # nothing demanded
    ],
)
def test_bad_demands_name_the_field(demands, field):
    with pytest.raises(DemandError) as e:
        Action.build("a", demands)
    assert e.value.field == field


@pytest.mark.parametrize("t1", [0, -1.0, float("inf"), float("nan")])
def test_non_positive_duration_rejected(t1):
    with pytest.raises(DemandError) as e:
        Action.build("a", {"cpu": 1}, t1_s=t1)
    assert e.value.field == "t1_s"


@pytest.mark.parametrize("table", [{1: 1.0, 2: 1.2}, {1: 1.0, 2: 0.0}, {1: 1.0, 2: -0.5}])
def test_efficiency_outside_unit_interval_rejected(table):
    with pytest.raises(DemandError) as e:
        Elasticity.from_table(table)
    assert e.value.field.startswith("elasticity[")


def test_profile_rejects_bad_t1():
    with pytest.raises(DemandError):
        Profile(t1_s=0)


def test_amdahl_duration():
    e = Elasticity.amdahl(0.1)
    # T(m) = T1 (s + (1 - s) / m)
    assert e.duration(10.0, 1) == pytest.approx(10.0)
    assert e.duration(10.0, 4) == pytest.approx(10.0 * (0.1 + 0.9 / 4))
    assert 0 < e.efficiency(64) <= 1


def test_table_interpolates_speedup_and_stays_flat_past_the_end():
    e = Elasticity.from_table({1: 1.0, 2: 0.9, 4: 0.75})
    assert e.efficiency(2) == pytest.approx(0.9)
    assert e.efficiency(3) * 3 == pytest.approx((1.8 + 3.0) / 2)  # speedup interpolated
    assert e.efficiency(8) * 8 == pytest.approx(3.0)  # no gain past the last point


def test_profile_fills_model_and_caps_dop():
    p = Profile(t1_s=6.0, elasticity=Elasticity.linear(), max_dop=4)
    a = Action.build("a", {"cpu": {"min": 1, "max": 16}}, profile=p)
    assert a.scalable and a.demands["cpu"].max == 4
    assert a.duration(3) == pytest.approx(2.0)


def test_unprofiled_elastic_action_is_not_scalable():
    a = Action.build("a", {"cpu": {"min": 1, "max": 8}})
    assert a.key == "cpu" and not a.scalable and a.duration(4) is None


def test_render_command_keeps_other_dollars():
    cmd = "pytest -n ${parallel_num} -k 'a and $b' && echo $$ ${HOME}"
    assert render_command(cmd, 4) == "pytest -n 4 -k 'a and $b' && echo $$ ${HOME}"


@pytest.mark.parametrize("make", [
    lambda: FieldError("a.b", "bad"), lambda: DemandError("demands.cpu", "bad"), lambda: ConfigError("x", "y"),
    lambda: UnschedulableError("demands.gpu", "too big"), lambda: WorkloadError("rewards.r.resources.gpu", "no DoP"),
    lambda: UnavailableError("node", "down", retry_after_s=7)])
def test_a_field_error_survives_a_trip_between_processes(make):
    # a multiprocessing pool pickles a worker's exception to its parent: one that cannot be rebuilt
    # there killed the pool's result thread, and scripts/policy_stress.py --jobs 2 waited for ever
    err = make()
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and (back.field, back.reason, str(back)) == (err.field, err.reason, str(err))
    assert getattr(back, "retry_after_s", None) == getattr(err, "retry_after_s", None)
