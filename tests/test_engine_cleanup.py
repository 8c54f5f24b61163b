"""An engine that ran many trajectories to their end keeps nothing of them but its finished records.

A long-running service sees millions of actions and trajectories: any per-action or per-trajectory
entry left behind once they end is a leak. Every container the engine (and its bookkeeping of
quiet trajectories, and the policy's memos) holds is checked, not a list of known ones, so state
added later is covered too.
"""
from __future__ import annotations

import random

import pytest

from tangram.core.model import Action, Elasticity
from tangram.policy import needs, rows
from tests.helpers import make_engine, make_node

# per engine, not per trajectory or action: managers, their pools, the nodes, the kept records
_PER_ENGINE = {"managers", "_owner", "_nodes", "_nodes_of", "finished"}


def _action(rng: random.Random, traj: str, i: int) -> Action:
    k = rng.random()
    if k < 0.45:
        return Action.build(f"{traj}-{i}", {"cpu": 1}, trajectory=traj, mem_mb=2000, t1_s=0.5)
    if k < 0.75:
        return Action.build(f"{traj}-{i}", {"api:llm": 1}, trajectory=traj, t1_s=1.0)
    return Action.build(f"{traj}-{i}", {"cpu": {"min": 1, "max": 8}}, trajectory=traj, mem_mb=2000, t1_s=4.0,
                        elasticity=Elasticity.amdahl(0.1))


def _left(obj, skip=frozenset()) -> dict:
    names = getattr(obj, "__slots__", None) or vars(obj)
    out = {}
    for name in names:
        v = getattr(obj, name)
        if name not in skip and isinstance(v, (dict, set, list)) and v:
            out[name] = len(v)
    return out


@pytest.mark.parametrize("seed", range(3))
def test_nothing_of_ended_trajectories_is_left(seed):
    rng = random.Random(seed)
    eng, clock = make_engine(make_node("n0", cores=32, mem=64_000), make_node("n1", cores=32, mem=64_000),
                             api={"llm": 8})
    running, done_of, n_traj = [], {}, 300
    for t in range(n_traj):
        traj = f"t{t}"
        done_of[traj] = 0
        running += eng.submit(_action(rng, traj, 0))
        while len(running) > 20 or (t == n_traj - 1 and (running or eng.waiting)):
            clock.advance(0.5)
            if not running:  # nothing runs yet something waits: the engine would be stuck
                pytest.fail(f"actions wait with nothing running: {sorted(eng.waiting)[:5]}")
            s = running.pop(rng.randrange(len(running)))
            outcome = rng.choice(["succeeded"] * 8 + ["failed"])
            running += eng.complete(s.record.action.id, outcome)
            traj = s.record.action.trajectory
            done_of[traj] += 1
            if done_of[traj] < 5:
                nxt = _action(rng, traj, done_of[traj])
                running += eng.submit(nxt)
                if rng.random() < 0.1 and nxt.id in eng.waiting:  # the agent gave up on it
                    running += eng.cancel(nxt.id)
                    running += eng.close_trajectory(traj)
                    done_of[traj] = 5
            elif done_of[traj] == 5:
                running += eng.close_trajectory(traj)
    assert not running and not eng.waiting and not eng.running
    assert _left(eng, _PER_ENGINE) == {}
    assert _left(eng._last, {"unfit"}) == {}
    gen = eng._generating
    assert _left(gen, {"_fixed"}) == {} and not any(gen._fixed.values())  # _fixed: one (empty) entry per node
    assert len(eng._lanes) == 0
    assert not any(id(r.action) in needs._NEEDS or id(r.action) in rows._ROWS for r in eng.finished.values())
    assert len(eng.finished) >= n_traj
