"""The engine's waiting lanes: what a round reads, rounds it skips, and who may wait."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from tangram.core.model import Action, Elasticity
from tangram.policy.schedule import plan
from tangram.policy.snapshot import PolicyParams
from tests.helpers import make_action, make_engine, make_node


def _ids(started):
    return [s.action.id for s in started]


def _random_action(rng: random.Random, i: int) -> Action:
    kind = rng.random()
    if kind < 0.4:  # a trajectory's shell action (placed on first start)
        return make_action(f"a{i}", cpu=1, trajectory=f"t{rng.randrange(12)}", mem=rng.choice((2000, 4000)))
    if kind < 0.6:  # an elastic reward
        return Action.build(f"a{i}", {"cpu": {"min": 1, "max": rng.choice((4, 8))}}, t1_s=rng.uniform(1, 30),
                            elasticity=Elasticity.amdahl(rng.uniform(0.05, 0.5)), trajectory=f"t{rng.randrange(12)}",
                            mem_mb=2000)
    if kind < 0.8:
        return make_action(f"a{i}", api="llm")
    return make_action(f"a{i}", cpu=rng.choice((1, 2, 4)))


@pytest.mark.parametrize("order", ["fcfs", "aging"])
@pytest.mark.parametrize("seed", range(12))
def test_a_round_over_the_lanes_plans_what_the_whole_queue_would(seed, order):
    """The view holds, per lane, what free units could start plus the look-ahead: the same plan."""
    rng = random.Random(seed)
    eng, clock = make_engine(make_node("n0", cores=8, mem=9000), make_node("n1", cores=6, mem=7000), api={"llm": 3},
                             params=PolicyParams(lookahead=4, order=order))
    for i in range(rng.randint(20, 120)):
        clock.advance(0.1)
        eng.submit(_random_action(rng, i))
        if eng.running and rng.random() < 0.3:
            eng.complete(rng.choice(list(eng.running)))
    snap = eng.snapshot()
    full = replace(snap, waiting=tuple(eng._lanes.in_order()))
    assert {a.id for a in full.waiting} == set(eng.waiting)
    assert len(snap.waiting) == len(full.waiting)
    got, want = plan(snap), plan(full)
    assert [(d.action.id, d.node, dict(d.units)) for d in got.dispatches] == \
           [(d.action.id, d.node, dict(d.units)) for d in want.dispatches]
    assert len(list(snap.waiting)) <= len(full.waiting)


def test_no_round_runs_for_an_action_that_cannot_start():
    eng, clock = make_engine(make_node(cores=2))
    assert _ids(eng.submit(make_action("busy", cpu=2))) == ["busy"]
    rounds = eng.rounds
    for i in range(50):
        assert eng.submit(make_action(f"w{i}", cpu=1)) == []
    assert eng.rounds == rounds  # the round that started "busy" left no core: none runs
    assert eng.rounds_skipped == 50
    started = eng.complete("busy")
    assert _ids(started) == ["w0", "w1"]  # FCFS once cores are free
    eng.check_invariants()


def test_a_freed_pool_wakes_only_what_needs_it():
    eng, clock = make_engine(make_node(cores=1), api={"llm": 1})
    eng.submit(make_action("c0", cpu=1))
    eng.submit(make_action("l0", api="llm"))
    eng.submit(make_action("c1", cpu=1))  # skipped: cpu is shut
    rounds = eng.rounds
    assert _ids(eng.submit(make_action("l1", api="llm"))) == []
    assert eng.rounds == rounds  # the API pool is shut too
    assert _ids(eng.complete("l0")) == ["l1"]
    assert _ids(eng.complete("c0")) == ["c1"]


def test_a_trajectory_placed_meanwhile_changes_lanes():
    """Its waiting actions leave the queue of unplaced trajectories waiting for memory."""
    eng, clock = make_engine(make_node("n0", cores=4, mem=1000))
    assert _ids(eng.submit(make_action("t0a", cpu=4, trajectory="t0", mem=1000))) == ["t0a"]
    eng.submit(make_action("t1a", cpu=1, trajectory="t1", mem=1000))  # no memory: waits
    eng.submit(make_action("t0b", cpu=1, trajectory="t0", mem=1000))  # placed on n0: needs cores only
    assert _ids(eng.complete("t0a")) == ["t0b"]  # t1a waits for memory, t0b's cores are free
    eng.check_invariants()


def test_a_trajectory_waiting_for_memory_does_not_idle_placed_cores():
    eng, clock = make_engine(make_node("n0", cores=8, mem=2000))
    eng.submit(make_action("p1", cpu=1, trajectory="placed", mem=2000))
    eng.complete("p1")
    eng.submit(make_action("w1", cpu=1, trajectory="new", mem=2000))  # waits for memory
    assert _ids(eng.submit(make_action("p2", cpu=4, trajectory="placed", mem=2000))) == ["p2"]
    started = eng.close_trajectory("placed")
    assert _ids(started) == ["w1"]  # the memory it reserved goes to the head


def test_close_trajectory_puts_its_waiting_actions_back_with_the_unplaced():
    eng, clock = make_engine(make_node("n0", cores=1, mem=1000), make_node("n1", cores=1, mem=1000))
    eng.submit(make_action("a", cpu=1, trajectory="t", mem=1000))
    node = eng.placement["t"]
    assert eng.submit(make_action("b", cpu=1, trajectory="t", mem=1000)) == []  # its node's core is busy
    assert eng._lanes.lane_of("b")[0] == node
    other = "n1" if node == "n0" else "n0"
    assert _ids(eng.close_trajectory("t")) == ["b"]  # unpinned: placed again, on the free node
    assert eng.placement["t"] == other
    eng.check_invariants()
