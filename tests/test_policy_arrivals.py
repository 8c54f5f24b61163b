"""Trajectories in generation: the engine's bookkeeping (Snapshot.upcoming), their expected
next actions in the ACT estimate, and the headroom an elastic group leaves them."""
from __future__ import annotations

import pytest

from tangram.core.errors import FieldError
from tangram.policy.estimate import estimate_from
from tangram.policy.schedule import plan
from tangram.policy.snapshot import PolicyParams
from tangram.service.config import ConfigError, parse_config

from tests.helpers import make_action, make_engine, make_node, one_node_snapshot


_snap = one_node_snapshot


def _shell(i):
    return make_action(f"s{i}", cpu=1, t1=2.0, trajectory=f"t{i}", cls="shell")


def _units(p):
    return {d.action.id: dict(d.units) for d in p.dispatches}


def test_a_reward_leaves_cores_for_the_shell_actions_about_to_arrive():
    # a 32 s perfectly parallel reward on a free 16-core node, 8 trajectories there about to
    # submit a 2 s one-core action: on all 16 cores (2 s) it makes them wait 2 s each
    # (objective 2 + 8 x 4 = 34); on 8 (4 s) none waits (4 + 8 x 2 = 20); 12 cores: 26.7, 14: 31.4
    reward = make_action("R", cpu={"min": 1, "max": 16}, t1=32.0, serial=0.0, cls="reward")
    upcoming = {"n0": tuple((0.0, _shell(i)) for i in range(8))}
    assert _units(plan(_snap([reward], upcoming=upcoming))) == {"R": {"cpu": 8}}
    # the same round without them, or with the feature off: all 16
    assert _units(plan(_snap([reward]))) == {"R": {"cpu": 16}}
    off = PolicyParams(expect_arrivals=False)
    assert _units(plan(_snap([reward], upcoming=upcoming, params=off))) == {"R": {"cpu": 16}}


def test_no_headroom_when_the_group_leaves_room_anyway():
    reward = make_action("R", cpu={"min": 1, "max": 8}, t1=32.0, serial=0.0, cls="reward")
    upcoming = {"n0": tuple((0.0, _shell(i)) for i in range(8))}
    assert _units(plan(_snap([reward], upcoming=upcoming))) == {"R": {"cpu": 8}}


def test_arrivals_far_off_do_not_hold_cores_back():
    # expected in 30 s: the reward on 16 cores (2 s) is long done by then
    reward = make_action("R", cpu={"min": 1, "max": 16}, t1=32.0, serial=0.0, cls="reward")
    upcoming = {"n0": tuple((30.0, _shell(i)) for i in range(8))}
    assert _units(plan(_snap([reward], upcoming=upcoming))) == {"R": {"cpu": 16}}


def test_elastic_last_actions_are_not_expected_to_need_units():
    # a trajectory whose last action was elastic takes what is free when it comes
    reward = make_action("R", cpu={"min": 1, "max": 16}, t1=32.0, serial=0.0, cls="reward")
    other = make_action("R2", cpu={"min": 1, "max": 16}, t1=32.0, serial=0.0, cls="reward", trajectory="t9")
    upcoming = {"n0": tuple((0.0, other) for _ in range(8))}
    assert _units(plan(_snap([reward], upcoming=upcoming))) == {"R": {"cpu": 16}}


def test_estimate_counts_each_arrival_from_its_arrival():
    # 1 unit free, one completion at 3 s (1 unit): arrivals at 1 s and 2 s of 1 unit, 1 s each:
    # the first starts at 1 (ends 2: 1 s), the second takes the unit freed at 2 (ends 3: 1 s);
    # then a waiter of 2 units, 1 s: the completions at 3 s free them (ends 4)
    got = estimate_from([(3.0, 1)], 1, [(2, 1.0, None)], 0, [(1.0, 1, 1.0), (2.0, 1, 1.0)])
    assert got == pytest.approx(1.0 + 1.0 + 4.0)
    assert estimate_from([(3.0, 1)], 1, [(2, 1.0, None)], 0) == pytest.approx(4.0)


def test_engine_reports_trajectories_in_generation_per_node():
    eng, clock = make_engine(make_node("n0", cores=4))
    (started,) = eng.submit(make_action("a1", cpu=1, t1=2.0, trajectory="t", cls="shell"))
    assert dict(eng.snapshot().upcoming) == {}  # nothing quiet, no gap measured yet
    clock.advance(2.0)
    eng.complete("a1")
    clock.advance(3.0)  # generation: 3 s
    eng.submit(make_action("a2", cpu=1, t1=2.0, trajectory="t", cls="shell"))
    clock.advance(2.0)
    eng.complete("a2")
    clock.advance(1.0)
    up = eng.snapshot().upcoming
    ((seconds, last),) = up["n0"]
    assert last.id == "a2" and seconds == pytest.approx(2.0)  # 3 s gap, 1 s already spent
    clock.advance(5.0)
    ((seconds, _),) = eng.snapshot().upcoming["n0"]
    assert seconds == 0.0  # overdue: any moment now
    eng.submit(make_action("a3", cpu=1, t1=2.0, trajectory="t", cls="shell"))
    assert not eng.snapshot().upcoming.get("n0")
    eng.cancel("a3")
    assert len(eng.snapshot().upcoming["n0"]) == 1  # cancelled: quiet again
    eng.close_trajectory("t")
    assert not eng.snapshot().upcoming.get("n0")


def test_a_trajectory_with_an_action_in_flight_is_not_in_generation():
    eng, clock = make_engine(make_node("n0", cores=4), api={"search": 1})
    eng.submit(make_action("c1", cpu=1, t1=1.0, trajectory="t", cls="shell"))
    eng.complete("c1")
    clock.advance(1.0)
    eng.submit(make_action("q1", api="search", trajectory="t"))
    eng.submit(make_action("q2", api="search", trajectory="t"))  # waits: one slot
    eng.complete("q1")
    assert not eng.snapshot().upcoming.get("n0")  # q2 still waits for it
    eng.complete("q2")
    assert [a.id for _, a in eng.snapshot().upcoming["n0"]] == ["q2"]


def test_a_trajectory_whose_last_action_was_elastic_is_not_listed():
    # its next action would take what is free when it comes; the gap is still measured
    eng, clock = make_engine(make_node("n0", cores=4))
    eng.submit(make_action("a1", cpu=1, t1=2.0, trajectory="t", cls="shell"))
    eng.complete("a1")
    clock.advance(3.0)
    eng.submit(make_action("r", cpu={"min": 1, "max": 4}, t1=8.0, serial=0.1, trajectory="t", cls="reward"))
    eng.complete("r")
    assert not eng.snapshot().upcoming.get("n0")
    clock.advance(1.0)
    eng.submit(make_action("a2", cpu=1, t1=2.0, trajectory="t", cls="shell"))
    eng.complete("a2")
    ((seconds, last),) = eng.snapshot().upcoming["n0"]
    assert last.id == "a2" and seconds == pytest.approx(2.0)  # gaps of 3 s and 1 s


def test_expect_arrivals_is_validated():
    with pytest.raises(ValueError, match="expect_arrivals"):
        PolicyParams(expect_arrivals="yes")
    with pytest.raises(ConfigError) as e:
        parse_config({"scheduler": {"expect_arrivals": 1}, "cpu_nodes": [{"name": "n0", "cores": 2, "memory_mb": 1024}]})
    assert e.value.field == "scheduler.expect_arrivals"
    assert isinstance(e.value, FieldError)
