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


def _random_group(rng):
    """Elastic rewards (Amdahl or measured, not necessarily convex, tables), shells about to arrive."""
    from tests.test_policy_fastpaths import _elasticity
    from tangram.core.model import Action

    cores = rng.choice([8, 16, 32, 64])
    rewards = []
    for i in range(rng.randint(1, 4)):
        lo = rng.randint(1, 3)
        rewards.append(Action.build(f"R{i}", {"cpu": {"min": lo, "max": lo + rng.randint(1, cores)}},
                                    t1_s=rng.uniform(1.0, 120.0), elasticity=_elasticity(rng),
                                    action_class="reward"))
    shells = [make_action(f"w{i}", cpu=1, t1=rng.uniform(0.2, 5.0), cls="shell") for i in range(rng.randint(0, 3))]
    upcoming = {"n0": tuple((rng.choice([0.0, rng.uniform(0.0, 20.0)]), _shell(i)) for i in range(rng.randint(1, 24)))}
    running = tuple((rng.uniform(0.0, 30.0), rng.randint(1, 4)) for _ in range(rng.randint(0, 6)))
    used = min(sum(u for _, u in running), cores)
    snap = _snap(rewards + shells, cores=cores, running=running, upcoming=upcoming)
    pool = snap.pools["cpu@n0"]
    pools = {**snap.pools, "cpu@n0": type(pool)(pool.name, pool.rtype, pool.node, cores, rng.randint(0, cores - used))}
    return type(snap)(**{**{f: getattr(snap, f) for f in snap.__dataclass_fields__}, "pools": pools}), rewards


def test_a_smaller_capacity_never_arranges_a_group_better():
    """What the headroom search skips on (elastic._below_any_headroom): the whole group's optimum on
    part of the capacity is no lower than on all of it, convex rows (greedy) or not (the DP)."""
    import random

    from tangram.policy.arrange import UnitsOperator, prefix_table_rows
    from tangram.policy.elastic import _below_any_headroom
    from tangram.policy.rows import group_rows

    rng = random.Random(11)
    checked = 0
    for _ in range(600):
        snap, rewards = _random_group(rng)
        pool = snap.pools["cpu@n0"]
        cap = pool.capacity
        rows_all, convex_all = group_rows(rewards, cap, snap.params, pool)
        whole = prefix_table_rows(rows_all, UnitsOperator(cap), len(rewards), convex_all, clipped=True)
        bound = _below_any_headroom(whole, len(rewards))
        for h in range(1, cap):
            rows_h, convex_h = group_rows(rewards, cap - h, snap.params, pool)
            table = prefix_table_rows(rows_h, UnitsOperator(cap - h), len(rewards), convex_h, clipped=True)
            assert table.best(len(rewards)) >= bound
            checked += table.feasible(len(rewards))
    assert checked > 1000  # most of them were arrangements, not infeasible tables


def test_skipping_headroom_below_the_bound_plans_the_same(monkeypatch):
    """Whole rounds with arrivals expected: the same plans with the skip and without it."""
    import random

    from tangram.policy import elastic

    rng = random.Random(5)
    snaps = [_random_group(rng)[0] for _ in range(400)]
    searched = []  # headroom sizes searched (an eviction search with a bound)
    evict = elastic._evict
    monkeypatch.setattr(elastic, "_evict", lambda *a, **k: (searched.append(k.get("unless_above")), evict(*a, **k))[1])
    with_skip = [plan(s) for s in snaps]
    skipping = sum(u is not None for u in searched)
    searched.clear()
    monkeypatch.setattr(elastic, "_below_any_headroom", lambda table, n: float("-inf"))
    without = [plan(s) for s in snaps]
    assert [(p.dispatches, dict(p.unfit)) for p in with_skip] == [(p.dispatches, dict(p.unfit)) for p in without]
    assert sum(bool(p.dispatches) for p in with_skip) > 100
    assert skipping < sum(u is not None for u in searched)  # the bound did skip some
