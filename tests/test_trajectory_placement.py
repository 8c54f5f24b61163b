"""A trajectory is placed once, by its first CPU action in queue order, with its memory, and only on
a node that could run all its waiting CPU actions (Snapshot.hostable).

Both cases below left a round that was not a fixed point of the policy: the action that placed the
trajectory was not the one its node was chosen for, so the next round decided otherwise (or could
never run an action of the trajectory at all).
"""
from __future__ import annotations

import pytest

from tangram.core.engine import Engine
from tangram.core.errors import UnschedulableError
from tangram.core.model import Action, Elasticity
from tangram.managers.base import CountingManager
from tangram.managers.gpu import GpuManager, GpuNode, ModelSpec
from tangram.policy.schedule import plan
from tangram.policy.snapshot import Plan, PolicyParams, PoolState, Snapshot
from tests.helpers import FakeClock, make_action, make_engine, make_node


def _snap(waiting, pools, placement=None) -> Snapshot:
    by_name = {p.name: p for p in pools}
    nodes = tuple(sorted({p.node for p in pools if p.node is not None}))
    return Snapshot(pools=by_name, nodes=nodes, waiting=tuple(waiting), running={}, placement=placement or {},
                    params=PolicyParams())


def test_a_later_cpu_action_does_not_place_its_trajectory_away_from_the_first_one_waiting():
    # T's first action needs 7 cores: only n0 (8 cores, 4 of them busy) can ever run it. Its second
    # fits n1 now; starting it there would bind T, and so the first action, to a 4-core node.
    first = make_action("first", cpu=7, trajectory="T")
    second = make_action("second", cpu=4, trajectory="T")
    pools = [PoolState("cpu@n0", "cpu", "n0", 8, 4), PoolState("cpu@n1", "cpu", "n1", 4, 4),
             PoolState("mem@n0", "mem", "n0", 10_000, 10_000), PoolState("mem@n1", "mem", "n1", 10_000, 10_000)]
    p = plan(_snap([first, second], pools))
    assert p.dispatches == ()


def test_through_the_engine_the_first_action_runs_where_it_can():
    eng, _ = make_engine(make_node("n0", cores=8), make_node("n1", cores=4))
    eng.submit(make_action("busy", cpu=5, trajectory="B"))  # only n0 has 5 cores
    assert eng.placement == {"B": "n0"}
    hold = eng.policy
    eng.policy = lambda snap: Plan()  # both queued before the next round
    eng.submit(make_action("first", cpu=7, trajectory="T"))
    eng.submit(make_action("second", cpu=3, trajectory="T"))
    eng.policy = hold
    assert eng.schedule() == [] and "T" not in eng.placement
    eng.complete("busy")
    assert set(eng.running) == {"first"} and eng.placement["T"] == "n0"
    eng.check_invariants()


def test_an_evicted_action_that_placed_its_trajectory_hands_the_memory_on():
    # "long" (elastic, 100 s of perfectly parallel work) is better off waiting 0.5 s for all 4
    # cores than starting on 2 now, so it is evicted; "short" of the same trajectory starts, on
    # the node "long" chose, and must reserve the trajectory's memory there
    long = make_action("long", cpu={"min": 1, "max": 4}, t1=100.0, serial=0.0, trajectory="T", mem=3000)
    short = make_action("short", cpu=2, t1=0.5, trajectory="T", mem=3000)
    pools = [PoolState("cpu@n0", "cpu", "n0", 4, 4), PoolState("mem@n0", "mem", "n0", 4000, 4000)]
    (d,) = plan(_snap([long, short], pools)).dispatches
    assert (d.action.id, d.place_mem_mb) == ("short", 3000)


def test_through_the_engine_the_memory_is_reserved():
    eng, clock = make_engine(make_node("n0", cores=4, mem=4000))
    hold = eng.policy
    eng.policy = lambda snap: Plan()
    eng.submit(make_action("long", cpu={"min": 1, "max": 4}, t1=100.0, serial=0.0, trajectory="T", mem=3000))
    clock.advance(500.0)  # "long" first in the aging order too (its key: arrival + k x its duration)
    eng.submit(make_action("short", cpu=2, t1=0.5, trajectory="T", mem=3000))
    eng.policy = hold
    assert [s.action.id for s in eng.schedule()] == ["short"]
    assert eng.snapshot().pools["mem@n0"].free == 1000
    # a trajectory of 3,000 MB more cannot be placed next to it
    eng.submit(make_action("other", cpu=1, trajectory="U", mem=3000))
    assert "other" in eng.waiting
    eng.check_invariants()


def test_an_unplaced_trajectory_goes_only_where_all_its_waiting_cpu_actions_could_run():
    # T's first action waits for the API slot only; its second needs 7 cores, which only n0 has.
    # n1 has the more free memory, so node preference alone would place T there once the slot
    # frees, and bind the 7-core action to a 4-core node for ever (it would also reserve n1).
    eng, _ = make_engine(make_node("n0", cores=8, mem=10_000), make_node("n1", cores=4, mem=20_000),
                         api={"llm": 1}, params=PolicyParams(order="fcfs"))
    eng.submit(make_action("hog", api="llm", t1=5.0))
    eng.submit(make_action("a", cpu=1, api="llm", t1=1.0, trajectory="T"))
    eng.submit(make_action("b", cpu=7, t1=1.0, trajectory="T"))
    assert eng.snapshot().hostable == {"T": ("n0",)}
    started = eng.complete("hog")
    assert {s.action.id: s.dispatch.node for s in started} == {"a": "n0", "b": "n0"}
    assert eng.placement["T"] == "n0" and eng.snapshot().hostable == {}
    eng.check_invariants()


def test_a_gpu_action_of_the_trajectory_keeps_it_to_the_gpu_nodes():
    clock = FakeClock()
    eng = Engine([CountingManager({"cpu@n0": 8, "mem@n0": 10_000, "cpu@n1": 8, "mem@n1": 20_000, "api:llm": 1}),
                  GpuManager([GpuNode("n0", 2, 100)], [ModelSpec("rm", 60)])], clock=clock,
                 params=PolicyParams(order="fcfs"))
    eng.submit(make_action("hog", api="llm", t1=5.0))
    eng.submit(make_action("a", cpu=1, api="llm", t1=1.0, trajectory="T"))
    eng.submit(Action.build("b", {"gpu": 1, "cpu": 1}, t1_s=1.0, trajectory="T"))
    eng.complete("hog")
    assert eng.placement["T"] == "n0"
    for x in list(eng.running):
        eng.complete(x)
    assert not eng.waiting and not eng.running  # both ran: nothing bound to a node without GPUs
    eng.check_invariants()


def test_the_restriction_follows_the_waiting_actions():
    eng, _ = make_engine(make_node("n0", cores=8), make_node("n1", cores=4), api={"llm": 1})
    eng.submit(make_action("hog", api="llm", t1=5.0))
    eng.submit(make_action("a", cpu=1, api="llm", t1=1.0, trajectory="T"))
    assert eng.snapshot().hostable == {}  # one waiting CPU action: nothing to keep it from
    eng.submit(make_action("b", cpu=7, t1=1.0, trajectory="T"))
    assert eng.snapshot().hostable == {"T": ("n0",)}
    eng.cancel("b")
    assert eng.snapshot().hostable == {}  # what needed n0 is gone
    eng.check_invariants()


def test_a_trajectory_waiting_for_memory_leaves_the_api_to_placed_ones():
    # T holds 3,000 of the node's 4,000 MB; U's first action (a core, an LLM call) waits for that
    # memory. Had it reserved the one LLM slot too, T's next call could never run, T would never
    # end, and its memory would never free: a deadlock.
    eng, _ = make_engine(make_node("n0", cores=8, mem=4000), api={"llm": 1})
    eng.submit(make_action("t-step1", cpu=1, t1=1.0, trajectory="T", mem=3000))
    eng.complete("t-step1")
    assert eng.submit(make_action("u-step1", cpu=1, api="llm", t1=1.0, trajectory="U", mem=3000)) == []
    started = eng.submit(make_action("t-step2", cpu=1, api="llm", t1=1.0, trajectory="T", mem=3000))
    assert [s.action.id for s in started] == ["t-step2"]
    eng.complete("t-step2")
    started = eng.close_trajectory("T")  # its memory frees: U is placed at last
    assert [(s.action.id, s.dispatch.node) for s in started] == [("u-step1", "n0")]
    eng.check_invariants()


def test_a_trajectory_whose_waiting_actions_no_one_node_could_run_is_refused_loudly():
    # "gpu-step" can only run on n1 (the one node with 2 GPUs), "big-suite" only on n0 (8 cores):
    # whichever started first would place T, and the other would wait for ever
    clock = FakeClock()
    eng = Engine([CountingManager({"cpu@n0": 8, "mem@n0": 10_000, "cpu@n1": 4, "mem@n1": 10_000, "api:llm": 1}),
                  GpuManager([GpuNode("n0", 1, 100), GpuNode("n1", 2, 100)], [ModelSpec("rm", 60)])], clock=clock)
    eng.submit(make_action("hog", api="llm", t1=5.0))
    eng.submit(make_action("first", cpu=1, api="llm", t1=1.0, trajectory="T"))  # waits: T is unplaced
    eng.submit(Action.build("gpu-step", {"gpu": 2, "cpu": 1}, t1_s=1.0, trajectory="T"))
    with pytest.raises(UnschedulableError) as err:
        eng.submit(make_action("big-suite", cpu=7, t1=1.0, trajectory="T"))
    assert err.value.field == "trajectory" and "'gpu-step'" in str(err.value)
    assert "big-suite" not in eng.waiting
    eng.submit(make_action("big-suite", cpu=7, t1=1.0, trajectory="U"))  # alone it is fine
    eng.check_invariants()


@pytest.mark.parametrize("gpus", [False, True])
def test_the_fixed_dop_baseline_takes_no_more_than_the_trajectorys_node_holds(gpus):
    # T is placed on n1 (4 cores, 2 GPUs); fixed N = 8 asks for more than n1 holds: the action
    # takes n1's all (the largest option it holds), where before it waited for ever
    clock = FakeClock()
    params = PolicyParams(fixed_dop=8)
    managers = [CountingManager({"cpu@n0": 8, "mem@n0": 10_000, "cpu@n1": 4, "mem@n1": 10_000})]
    if gpus:
        managers.append(GpuManager([GpuNode("n0", 8, 100), GpuNode("n1", 2, 100)], [ModelSpec("rm", 60)]))
    eng = Engine(managers, clock=clock, params=params)
    eng.place_trajectory("T", "n1", 0)
    if gpus:
        action = Action.build("step", {"gpu": [1, 2, 4, 8], "cpu": 1}, t1_s=4.0, elasticity=Elasticity.amdahl(0.0),
                              trajectory="T")
    else:
        action = make_action("step", cpu={"min": 1, "max": 8}, t1=4.0, serial=0.0, trajectory="T")
    (started,) = eng.submit(action)
    assert started.dispatch.node == "n1"
    assert started.dispatch.units[action.key] == (2 if gpus else 4)
    eng.check_invariants()


def test_an_action_whose_memory_an_earlier_head_reserved_leaves_the_cores_to_placed_trajectories():
    # T holds 3,000 of n0's 4,000 MB. U (unplaced, 7 cores: only n0 has them) waits for 3,000 MB and
    # reserves n0's memory. "one-shot" needs 7 cores and 1,000 MB: the 1,000 MB are free but
    # reserved by U, so it waits for memory too, and must not reserve n0's cores: T's next
    # action could then never run, T never end, its memory never free (a deadlock a drain check found)
    eng, clock = make_engine(make_node("n0", cores=8, mem=4000), make_node("n1", cores=4, mem=4000),
                             params=PolicyParams(order="fcfs"))
    eng.place_trajectory("T", "n0", 3000)
    assert eng.submit(make_action("u-step1", cpu=7, t1=1.0, trajectory="U", mem=3000)) == []
    assert eng.submit(make_action("one-shot", cpu=7, t1=1.0, mem=1000)) == []
    started = eng.submit(make_action("t-step", cpu=1, t1=1.0, trajectory="T"))
    assert [s.action.id for s in started] == ["t-step"]
    eng.complete("t-step")
    started = eng.close_trajectory("T")  # its memory frees: U is placed at last, then the one-shot
    assert [s.action.id for s in started] == ["u-step1"]
    eng.complete("u-step1")
    eng.close_trajectory("U")
    assert not eng.waiting and "one-shot" in eng.running
    eng.check_invariants()
