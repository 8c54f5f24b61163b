"""Rounds the engine skips change no schedule.

Each run below is made twice on the same seeded workload: with the engine as
it is, and with every completion followed by a round (the engine before it
learned to skip them). Every action must start and end at the same time on
the same number of units in both.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from tangram.core.engine import Engine
from tangram.simulator.sim import Simulation
from tangram.simulator.workload import ApiPool, load_workload
from tests.helpers import make_action, make_engine, make_node


def _contended(name: str, batch: int):
    wl = load_workload(name).with_batch(batch)
    c = wl.cluster
    if name in ("ai-coding", "cpu-contended"):
        # two small nodes holding 6 sandboxes each: trajectories wait for memory and cores
        c = replace(c, cpu_nodes=2, cores_per_node=24, mem_gb_per_node=6 * wl.jobs[0].memory_mb / 1024)
    if name == "deepsearch":
        c = replace(c, api=(ApiPool("search", 2, 2, 1.0), ApiPool("fetch", 2, None, 1.0)))
    return wl.with_cluster(c)


def _run(wl, policy: str):
    sim = Simulation(wl, policy, seed=7, check=True)
    res = sim.run()
    rows = [(r.id, r.submit, r.start, r.end, r.units, r.pool_units, r.restore_s) for r in res.records]
    return rows, sim.engine


@pytest.mark.parametrize("name,batch,policy", [
    ("cpu-contended", 40, "tangram"),
    ("cpu-contended", 40, "tangram:fcfs"),
    ("ai-coding", 30, "tangram"),
    ("ai-coding", 30, "trajectory"),
    ("ai-coding", 30, "fixed-dop:4"),
    ("deepsearch", 12, "tangram"),
    ("mopd", 8, "tangram"),
])
def test_skipped_rounds_would_have_started_nothing(monkeypatch, name, batch, policy):
    wl = _contended(name, batch)
    fast, fast_engine = _run(wl, policy)
    monkeypatch.setattr(Engine, "_release_wakes_nothing", lambda self: False)
    slow, slow_engine = _run(wl, policy)
    assert len(fast) == len(slow) > 0
    assert fast == slow
    assert fast_engine.rounds + fast_engine.rounds_skipped >= slow_engine.rounds
    if name == "cpu-contended":
        assert fast_engine.rounds < slow_engine.rounds  # the contended runs do skip rounds


def test_a_completion_that_frees_nothing_a_lane_uses_runs_no_round():
    eng, clock = make_engine(make_node("n0", cores=2), api={"llm": 1})
    eng.submit(make_action("c0", cpu=2))
    eng.submit(make_action("l0", api="llm"))
    eng.submit(make_action("l1", api="llm"))  # waits for the API
    assert set(eng.running) == {"c0", "l0"}
    rounds, skipped = eng.rounds, eng.rounds_skipped
    clock.advance(1.0)
    assert eng.complete("c0") == []  # only cores freed: nothing waiting needs them
    assert (eng.rounds, eng.rounds_skipped) == (rounds, skipped + 1)
    eng.submit(make_action("c1", cpu=1))  # the freed cores: its own round starts it
    assert set(eng.running) == {"c1", "l0"}
    rounds = eng.rounds
    clock.advance(1.0)
    assert [s.action.id for s in eng.complete("l0")] == ["l1"]  # the API's lane: a round
    assert eng.rounds == rounds + 1
    eng.check_invariants()


def test_running_view_gives_each_actions_seconds_left():
    from tangram.core.running import RunningView, _seconds_left

    by_pool = {"cpu@n0": {"a": (0.0, 10.0, 2), "b": (1.0, 3.0, 1)}}  # (start, estimated end, units)
    view = RunningView(by_pool, now=5.0)
    assert view["cpu@n0"] == ((5.0, 2), (_seconds_left(1.0, 3.0, 5.0), 1)) == ((5.0, 2), (2.0, 1))  # b overran: half its age
    assert view.get("cpu@n0") == view["cpu@n0"] and view.get("gpu@n0", ()) == ()
    assert dict(view) == {"cpu@n0": view["cpu@n0"]}
