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
from tangram.policy.snapshot import PolicyParams
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


def test_a_completion_that_moves_an_estimate_a_holdout_read_runs_its_round():
    # a reward holds out for all 16 cores; behind it waits an unprofiled action of class "build",
    # whose estimated duration the hold-out decision read. An API call of that class ending frees
    # nothing a waiting lane uses, but moves the estimate: the round must run (and re-decide).
    eng, clock = make_engine(make_node("n0", cores=16), api={"llm": 1}, params=PolicyParams(order="fcfs"))
    eng.submit(make_action("busy", cpu=15, t1=0.5, trajectory="b"))
    eng.submit(make_action("R0", cpu={"min": 1, "max": 16}, t1=32.0, serial=0.0, cls="reward", trajectory="r"))
    eng.submit(make_action("u", cpu=2, cls="build", trajectory="x"))
    eng.submit(make_action("call", api="llm", cls="build"))
    assert set(eng.running) == {"busy", "call"}
    assert "cpu@n0" in eng.snapshot().holdouts
    rounds = eng.rounds
    clock.advance(0.25)
    eng.complete("call")
    assert eng.rounds == rounds + 1
    eng.submit(make_action("call2", api="llm", cls="lint"))  # another class: its end moves nothing read
    rounds, skipped = eng.rounds, eng.rounds_skipped
    clock.advance(0.01)
    assert eng.complete("call2") == [] and (eng.rounds, eng.rounds_skipped) == (rounds, skipped + 1)
    eng.check_invariants()


def test_a_submission_that_moves_the_generation_gap_runs_its_round_while_a_holdout_reads_arrivals():
    # n0: a reward holds out for all 16 cores while trajectory Q, quiet there, is expected back
    # (a gap after it went quiet). On the full n1, trajectory X returns from generation: its action
    # cannot start, but the gap it measured moves Q's expected arrival: the round must run.
    eng, clock = make_engine(make_node("n0", cores=16), make_node("n1", cores=1), params=PolicyParams(order="fcfs"))
    for t, node in (("Q", "n0"), ("Y", "n1"), ("X", "n1"), ("B", "n0"), ("R", "n0")):
        eng.place_trajectory(t, node, 0)
    eng.submit(make_action("q1", cpu=1, t1=1.0, trajectory="Q"))
    eng.submit(make_action("y1", cpu=1, t1=1.0, trajectory="Y"))
    clock.advance(1.0)
    eng.complete("q1")
    eng.complete("y1")  # Q and Y quiet
    eng.submit(make_action("x1", cpu=1, t1=0.5, trajectory="X"))
    clock.advance(0.5)
    eng.complete("x1")  # X quiet on n1
    clock.advance(0.5)
    eng.submit(make_action("y2", cpu=1, t1=9.0, trajectory="Y"))  # the first gap (1 s); n1 is full
    eng.submit(make_action("busy", cpu=15, t1=0.5, trajectory="B"))
    eng.submit(make_action("R0", cpu={"min": 1, "max": 16}, t1=32.0, serial=0.0, cls="reward", trajectory="R"))
    assert set(eng.running) == {"y2", "busy"}
    snap = eng.snapshot()
    assert "cpu@n0" in snap.holdouts and snap.upcoming.get("n0")
    rounds, skipped = eng.rounds, eng.rounds_skipped
    clock.advance(1.0)
    assert eng.submit(make_action("x2", cpu=1, t1=1.0, trajectory="X")) == []  # a gap of 1.5 s
    assert (eng.rounds, eng.rounds_skipped) == (rounds + 1, skipped)
    eng.check_invariants()


def _nothing_left_to_start(eng) -> bool:
    """The full search (no holdouts) on the engine's snapshot starts nothing: no skipped round or
    held group left anything it would start."""
    from tangram.policy.schedule import plan

    return plan(replace(eng.snapshot(), holdouts={})).dispatches == ()


def test_a_quiet_trajectory_submitting_on_a_held_node_runs_its_round():
    # R0 holds 7 cores back for Q's expected 7-core action; Q comes back with an API call that
    # cannot start (the API is full) one published gap after it went quiet (the gap does not
    # move): n0's expected arrival is gone, so the round runs, and R0 starts on those cores
    eng, clock = make_engine(make_node("n0", cores=8), make_node("n1", cores=1), api={"llm": 1},
                             params=PolicyParams(order="fcfs"))
    for t, node in (("Q", "n0"), ("Y", "n1"), ("B", "n0"), ("R", "n0")):
        eng.place_trajectory(t, node, 0)
    eng.submit(make_action("q1", cpu=7, t1=1.0, trajectory="Q"))
    eng.submit(make_action("y1", cpu=1, t1=1.0, trajectory="Y"))
    clock.advance(1.0)
    eng.complete("q1")
    eng.complete("y1")
    clock.advance(1.0)
    eng.submit(make_action("y2", cpu=1, t1=99.0, trajectory="Y"))  # the first gap: 1 s
    eng.submit(make_action("call", api="llm", t1=99.0))
    eng.submit(make_action("busy", cpu=1, t1=99.0, trajectory="B"))
    eng.submit(make_action("R0", cpu={"min": 1, "max": 8}, t1=20.0, serial=0.0, cls="reward", trajectory="R"))
    assert "cpu@n0" in eng.snapshot().holdouts
    started = eng.submit(make_action("q2", api="llm", t1=1.0, trajectory="Q"))
    assert [s.action.id for s in started] == ["R0"]
    assert _nothing_left_to_start(eng)


def test_a_submission_joining_a_held_pools_look_ahead_runs_its_round():
    # W needs a core of the held node and the full API: it cannot start, but it waits behind the
    # held group, whose search reads it (a 1-core 0.5 s action that would wait for the 16 cores)
    eng, clock = make_engine(make_node("n0", cores=16), api={"llm": 1}, params=PolicyParams(order="fcfs"))
    eng.submit(make_action("call", api="llm", t1=99.0))
    eng.submit(make_action("busy", cpu=15, t1=0.5, trajectory="b"))
    eng.submit(make_action("R0", cpu={"min": 1, "max": 16}, t1=0.6, serial=0.1, cls="reward", trajectory="r"))
    assert "cpu@n0" in eng.snapshot().holdouts
    rounds = eng.rounds
    eng.submit(make_action("W", cpu=1, api="llm", t1=0.5, trajectory="w"))
    assert eng.rounds == rounds + 1
    assert _nothing_left_to_start(eng)


def test_the_first_published_gap_runs_its_round_while_a_group_is_held():
    # before any gap is measured no arrival is expected; the submission that measures the first
    # one makes Q's expected 15-core action visible on the held node: its round must run
    eng, clock = make_engine(make_node("n0", cores=16), make_node("n1", cores=1), params=PolicyParams(order="fcfs"))
    for t, node in (("Q", "n0"), ("Y", "n1"), ("Z", "n1"), ("B", "n0"), ("R", "n0")):
        eng.place_trajectory(t, node, 0)
    eng.submit(make_action("q1", cpu=15, t1=2.0, trajectory="Q"))
    clock.advance(2.0)
    eng.complete("q1")
    eng.submit(make_action("y1", cpu=1, t1=1.0, trajectory="Y"))
    clock.advance(1.0)
    eng.complete("y1")
    eng.submit(make_action("z1", cpu=1, t1=99.0, trajectory="Z"))  # n1 full
    eng.submit(make_action("busy", cpu=15, t1=0.5, trajectory="B"))
    eng.submit(make_action("R0", cpu={"min": 1, "max": 16}, t1=2.0, serial=0.0, cls="reward", trajectory="R"))
    snap = eng.snapshot()
    assert "cpu@n0" in snap.holdouts and not snap.upcoming.get("n0")
    clock.advance(0.4)
    rounds = eng.rounds
    eng.submit(make_action("y2", cpu=1, t1=1.0, trajectory="Y"))  # cannot start on the full n1
    assert eng.rounds == rounds + 1 and eng.snapshot().upcoming.get("n0")
    assert _nothing_left_to_start(eng)


def test_an_action_pinned_to_another_node_does_not_join_a_held_pools_look_ahead():
    # every pool is shut (n0 by a head that does not fit, n1 full), so the round fills the
    # look-ahead with the next actions without placing them: W, pinned to n1, waits behind n1's
    # head only, as placing it would say; its submission changes nothing of n0's held group
    eng, clock = make_engine(make_node("n0", cores=16), make_node("n1", cores=1), params=PolicyParams(order="fcfs"))
    for t, node in (("b", "n0"), ("r", "n0"), ("h", "n0"), ("z", "n1"), ("z2", "n1"), ("w", "n1")):
        eng.place_trajectory(t, node, 0)
    eng.submit(make_action("busy", cpu=15, t1=3.0, trajectory="b"))
    eng.submit(make_action("z1", cpu=1, t1=99.0, trajectory="z"))
    eng.submit(make_action("R0", cpu={"min": 1, "max": 16}, t1=4.0, serial=0.1, cls="reward", trajectory="r"))
    eng.submit(make_action("h1", cpu=8, t1=5.0, trajectory="h"))
    eng.submit(make_action("z21", cpu=1, t1=99.0, trajectory="z2"))
    assert "cpu@n0" in eng.snapshot().holdouts
    skipped = eng.rounds_skipped
    assert eng.submit(make_action("W", cpu=1, t1=0.1, trajectory="w")) == []
    assert eng.rounds_skipped == skipped + 1
    assert _nothing_left_to_start(eng)


def test_a_requeued_action_re_decides_the_held_groups():
    # R0 (0.45 s of perfectly parallel work) holds out while busy has 0.1 s left; busy is then
    # requeued (a 429) and restarts for its whole 0.5 s under the same id: waiting for it no
    # longer pays, and R0 must start on the free core rather than be held on equal ids
    eng, clock = make_engine(make_node("n0", cores=16), params=PolicyParams(order="fcfs"))
    eng.submit(make_action("busy", cpu=15, t1=0.5, trajectory="b"))
    clock.advance(0.4)
    eng.submit(make_action("R0", cpu={"min": 1, "max": 16}, t1=0.45, serial=0.0, cls="reward", trajectory="r"))
    assert "cpu@n0" in eng.snapshot().holdouts
    started = eng.requeue("busy")
    assert sorted(s.action.id for s in started) == ["R0", "busy"]
    assert _nothing_left_to_start(eng)


def test_new_knobs_re_decide_held_groups_and_skip_no_round():
    eng, clock = make_engine(make_node("n0", cores=16), api={"llm": 1}, params=PolicyParams(order="fcfs"))
    eng.submit(make_action("busy", cpu=15, t1=0.5, trajectory="b"))
    eng.submit(make_action("call", api="llm", t1=0.1))
    eng.submit(make_action("R0", cpu={"min": 1, "max": 16}, t1=32.0, serial=0.0, cls="reward", trajectory="r"))
    assert "cpu@n0" in eng.snapshot().holdouts
    eng.params = replace(eng.params, dop_caps={"reward": 1})  # R0 may never use more than one core
    rounds = eng.rounds
    clock.advance(0.1)
    started = eng.complete("call")  # frees nothing R0's lane uses, but the knobs changed
    assert eng.rounds == rounds + 1 and [s.action.id for s in started] == ["R0"]
    assert _nothing_left_to_start(eng)


def test_a_submission_the_round_would_consider_before_a_deferred_gpu_head_is_not_skipped():
    # under the aging order GPU affinity considers G (its model not resident: a 3 s restore) four
    # restores later than its key; C's key is above G's but below that, so the round considers C
    # first and starts it on the cores G reserved: the submission's round must not be skipped
    from tangram.core.engine import Engine
    from tangram.core.model import Action
    from tangram.managers.base import CountingManager
    from tangram.managers.gpu import GpuManager, GpuNode, ModelSpec
    from tests.helpers import FakeClock

    clock = FakeClock()
    eng = Engine([CountingManager({"cpu@n0": 4, "mem@n0": 4000}),
                  GpuManager([GpuNode("n0", 1, 100)], [ModelSpec("rm", 60), ModelSpec("big", 90)])],
                 clock=clock, params=PolicyParams(order="aging"))
    eng.submit(Action.build("busy", {"gpu": 1}, service="big", t1_s=10.0))
    eng.submit(Action.build("G", {"gpu": 1, "cpu": 1}, service="rm", t1_s=1.0, restore_s={1: 3.0}))
    clock.advance(3.0)
    assert [s.action.id for s in eng.submit(make_action("C", cpu=1, t1=0.5))] == ["C"]
    assert _nothing_left_to_start(eng)


def test_a_submission_joining_the_look_ahead_of_a_gpu_group_waiting_by_choice_runs_its_round():
    # X (2 s of perfectly parallel work on 1 or 2 GPUs) waits for busy's GPU rather than start on
    # one (1.5 s against 2 s); GPU groups are never holdouts, but the choice is the same kind.
    # Y (a GPU and a core; the cores are full) cannot start, yet it waits behind X for a GPU:
    # with it, X on one GPU now is better (Y starts at 0.5 s instead of 1.5 s), and the
    # submission's round must run
    from tangram.core.engine import Engine
    from tangram.core.model import Action, Elasticity
    from tangram.managers.base import CountingManager
    from tangram.managers.gpu import GpuManager, GpuNode, ModelSpec
    from tests.helpers import FakeClock

    clock = FakeClock()
    eng = Engine([CountingManager({"cpu@n0": 2, "mem@n0": 4000}), GpuManager([GpuNode("n0", 2, 100)], [ModelSpec("m", 10)])],
                 clock=clock, params=PolicyParams(order="fcfs"))
    eng.submit(make_action("cores", cpu=2, t1=9.0))
    eng.submit(Action.build("busy", {"gpu": 1}, t1_s=0.5))
    eng.submit(Action.build("X", {"gpu": [1, 2]}, t1_s=2.0, elasticity=Elasticity.amdahl(0.0)))
    assert set(eng.running) == {"cores", "busy"}  # X waits by choice
    started = eng.submit(Action.build("Y", {"gpu": 1, "cpu": 1}, t1_s=5.0))
    assert [s.action.id for s in started] == ["X"]
    assert _nothing_left_to_start(eng)


def test_dropping_a_class_estimate_a_holdout_read_runs_its_round():
    # as above, but the estimator keeps one class: "lint" ending drops "build", whose published
    # estimate the hold-out read (the waiting "build" action is unobserved again): re-decide
    eng, clock = make_engine(make_node("n0", cores=16), api={"llm": 1}, params=PolicyParams(order="fcfs"))
    eng.estimator.max_classes = 1
    eng.submit(make_action("busy", cpu=15, t1=0.5, trajectory="b"))
    eng.submit(make_action("R0", cpu={"min": 1, "max": 16}, t1=32.0, serial=0.0, cls="reward", trajectory="r"))
    eng.submit(make_action("u", cpu=2, cls="build", trajectory="x"))
    eng.submit(make_action("call", api="llm", cls="build"))
    clock.advance(0.25)
    eng.complete("call")
    assert "cpu@n0" in eng.snapshot().holdouts and "build" in eng.snapshot().class_estimates
    eng.submit(make_action("call2", api="llm", cls="lint"))
    rounds = eng.rounds
    clock.advance(0.01)
    eng.complete("call2")
    assert eng.rounds == rounds + 1 and set(eng.snapshot().class_estimates) == {"lint"}
    eng.check_invariants()
