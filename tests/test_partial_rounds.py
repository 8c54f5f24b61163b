"""Rounds over some lanes only (skips.replan_scope) plan what the full round would.

After a settled round, an event that changes only some pools (an action queued, units released)
re-plans the lanes that could use them, closed over the pools those use in turn; what the last
round left on the other pools stands. The seeded runs below are made twice, with and without such
rounds, and every action must start and end at the same time on the same units.
"""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from tangram.core import skips
from tangram.core.engine import Engine
from tangram.core.model import Demand
from tangram.managers.base import CountingManager
from tangram.policy.schedule import plan
from tangram.policy.snapshot import PolicyParams
from tangram.simulator.sim import Simulation
from tangram.simulator.workload import ApiPool, load_workload
from tests.helpers import FakeClock, make_action, make_engine, make_node
from tests.test_skips_fuzz import _key


def _lane(home, demands, mem=0, service=None):
    return (home, mem, tuple(sorted((t, Demand(lo, lo)) for t, lo in demands.items())), service)


_POOLS = {"cpu@n0": None, "mem@n0": None, "cpu@n1": None, "mem@n1": None, "cpu@n2": None, "api:llm": None}
_NODES = ("n0", "n1", "n2")


def test_the_scope_is_the_lanes_of_the_changed_pools_closed_over_theirs():
    shell0, shell1 = _lane("n0", {"cpu": 1}), _lane("n1", {"cpu": 1})
    call_from_n0 = _lane("n0", {"cpu": 1, "api:llm": 1})
    call = _lane(None, {"api:llm": 1})
    lanes = [(lane, [None]) for lane in (shell0, shell1, call_from_n0, call)]
    # n1's cores changed: only its shell lane
    assert skips.replan_scope(lanes, {"cpu@n1"}, _NODES, _POOLS) == ((shell1,), ("cpu@n1",))
    # n0's cores: its shell, the call made from n0, and through the API every other call too
    got_lanes, got_pools = skips.replan_scope(lanes, {"cpu@n0"}, _NODES, _POOLS)
    assert set(got_lanes) == {shell0, call_from_n0, call}
    assert set(got_pools) == {"cpu@n0", "api:llm"}


def test_no_scope_where_a_full_round_could_decide_otherwise():
    shell0, shell1 = _lane("n0", {"cpu": 1}), _lane("n1", {"cpu": 1})
    unplaced = _lane(None, {"cpu": 1}, mem=100)
    gpu = _lane(None, {"gpu": 1}, service="rm")
    lanes = [(lane, [None]) for lane in (shell0, shell1)]
    # every lane concerned: that is the full round
    assert skips.replan_scope(lanes, {"cpu@n0", "cpu@n1"}, _NODES, _POOLS) is None
    # an unplaced trajectory could go to any node: it joins, and with it every lane
    assert skips.replan_scope(lanes + [(unplaced, [None])], {"cpu@n0"}, _NODES, _POOLS) is None
    # a GPU action waiting may be held back by the clock (affinity): never apart
    assert skips.replan_scope(lanes + [(gpu, [None])], {"cpu@n0"}, _NODES, {**_POOLS, "gpu@n0": None}) is None
    # every pool but memory is one some lane could use: a full round may find them all shut
    busy = {"cpu@n0": None, "cpu@n1": None, "mem@n0": None}
    assert skips.replan_scope(lanes, {"cpu@n0"}, ("n0", "n1"), busy) is None


def test_a_shell_on_a_quiet_node_is_planned_alone_and_the_held_group_elsewhere_stands():
    eng, clock = make_engine(make_node("n0", cores=8), make_node("n1", cores=8), make_node("n2", cores=8),
                             params=PolicyParams(order="fcfs"))
    for t, node in (("A", "n0"), ("B", "n0"), ("C", "n1")):
        eng.place_trajectory(t, node, 0)
    eng.submit(make_action("busy", cpu=6, t1=1.0, trajectory="A"))
    # an 8-core reward on n0 better off waiting a second for all 8 cores than starting on 2 now
    eng.submit(make_action("reward", cpu={"min": 1, "max": 8}, t1=100.0, serial=0.0, cls="r", trajectory="B"))
    assert "reward" in eng.waiting and "cpu@n0" in eng.snapshot().holdouts
    seen = []
    policy = eng.policy
    eng.policy = lambda snap: (seen.append([a.id for a in snap.waiting]), policy(snap))[1]
    partial = eng.rounds_partial
    started = eng.submit(make_action("shell", cpu=1, t1=1.0, trajectory="C"))
    assert [s.action.id for s in started] == ["shell"] and started[0].dispatch.node == "n1"
    assert seen == [["shell"]] and eng.rounds_partial == partial + 1  # the round read n1's lane alone
    assert "cpu@n0" in eng.snapshot().holdouts and "reward" in eng.waiting
    clock.advance(1.0)
    started = eng.complete("busy")  # n0's cores: the reward's lane is re-planned, and starts
    assert [(s.action.id, s.dispatch.units["cpu"]) for s in started] == [("reward", 8)]
    assert seen[-1] == ["reward"]
    eng.check_invariants()


def _many_nodes(name: str, batch: int):
    wl = load_workload(name).with_batch(batch)
    if name in ("ai-coding", "cpu-contended"):
        # six small nodes: lanes form on some while others stay quiet
        wl = wl.with_cluster(replace(wl.cluster, cpu_nodes=6, cores_per_node=16,
                                     mem_gb_per_node=4 * wl.jobs[0].memory_mb / 1024))
    if name == "deepsearch":  # slots so few that calls queue for one API while the other has room
        wl = wl.with_cluster(replace(wl.cluster, api=(ApiPool("search", 2, 2, 1.0), ApiPool("fetch", 4, None, 1.0))))
    return wl


def _run(wl, policy: str):
    sim = Simulation(wl, policy, seed=3, check=True)
    res = sim.run()
    return [(r.id, r.submit, r.start, r.end, r.units, r.pool_units) for r in res.records]


@pytest.mark.parametrize("name,batch,policy", [
    ("ai-coding", 60, "tangram"),
    ("ai-coding", 60, "tangram:fcfs"),
    ("cpu-contended", 60, "tangram"),
    ("deepsearch", 40, "tangram"),
    ("mopd+search", 256, "tangram"),
])
def test_partial_rounds_plan_what_full_rounds_would(monkeypatch, name, batch, policy):
    wl = _many_nodes(name, batch)
    partial = []
    schedule = Engine.schedule

    def counting(self, only=None):
        partial.append(only is not None)
        return schedule(self, only)

    monkeypatch.setattr(Engine, "schedule", counting)
    with_partial = _run(wl, policy)
    assert any(partial), "no round ran over part of the lanes: the comparison would prove nothing"
    monkeypatch.setattr(skips, "replan_scope", lambda *args: None)
    partial.clear()
    full = _run(wl, policy)
    assert not any(partial)
    assert len(with_partial) == len(full) > 0
    assert with_partial == full


def _stream(seed: int, events: int = 300) -> tuple[list, int]:
    """A random stream on six nodes whose trajectories are mostly placed (where rounds over part of
    the lanes are common); every such round is checked against the full plan on the same state.
    Returns the rounds that differed and the number of rounds over part of the lanes."""
    rng = random.Random(seed)
    clock = FakeClock()
    caps = {"api:search": rng.choice([1, 2, 4]), "api:fetch": 2}
    for n in range(6):
        caps |= {f"cpu@n{n}": rng.choice([4, 8, 16]), f"mem@n{n}": 10_000}
    params = PolicyParams(order=rng.choice(["fcfs", "aging"]), lookahead=rng.choice([2, 32]),
                          expect_arrivals=rng.random() < 0.7)
    eng = Engine([CountingManager(caps)], clock=clock, params=params)
    trajectories = [f"T{i}" for i in range(24)]
    for i, t in enumerate(trajectories[:20]):
        eng.place_trajectory(t, f"n{i % 6}", 1000)
    bad, partial = [], [0]

    def policy(snap):
        mine = plan(snap)
        if len(snap.waiting) < len(eng.waiting):
            partial[0] += 1
            if _key(mine) != _key(plan(eng.snapshot())):
                bad.append((seed, clock.t))
        return mine

    eng.policy = policy
    for n in range(events):
        if rng.random() < 0.4:
            clock.advance(rng.choice([0.1, 0.5, 2.0]))
        r = rng.random()
        traj = rng.choice(trajectories)
        if r < 0.35:
            eng.submit(make_action(f"s{n}", cpu=1, t1=rng.choice([None, 0.5, 3.0]), cls="shell", trajectory=traj,
                                   mem=1000))
        elif r < 0.45:
            eng.submit(make_action(f"r{n}", cpu={"min": 1, "max": 16}, t1=rng.choice([5.0, 40.0]),
                                   serial=rng.choice([0.0, 0.1]), cls="suite", trajectory=traj, mem=1000))
        elif r < 0.6:
            eng.submit(make_action(f"a{n}", api=rng.choice(["search", "fetch"]), t1=rng.choice([None, 1.0]),
                                   cls="call", trajectory=traj))
        elif r < 0.9 and eng.running:
            eng.complete(rng.choice(list(eng.running)))
        elif r < 0.93 and eng.waiting:
            eng.cancel(rng.choice(list(eng.waiting)))
        else:
            eng.tick()
        eng.check_invariants()
    while eng.running:  # drain: everything queued runs
        clock.advance(1.0)
        eng.complete(next(iter(eng.running)))
    assert not eng.waiting, (seed, sorted(eng.waiting))
    return bad, partial[0]


def test_random_streams_plan_each_partial_round_as_the_full_round():
    results = [_stream(seed) for seed in range(60)]
    assert [b for bad, _ in results for b in bad] == []
    assert sum(n for _, n in results) > 1000, "too few rounds over part of the lanes to show anything"
