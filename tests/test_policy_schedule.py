"""One scheduling round: candidates, per-pool blocking, greedy eviction (exact expectations)."""
from __future__ import annotations

import pytest

from tangram.policy.schedule import plan
from tangram.policy.snapshot import PolicyParams, PoolState, Snapshot

from tests.helpers import make_action


def _snap(waiting, *, cpu=8, running=(), api=None, mem=10_000, params=None, placement=None, nodes=("n0",)):
    pools = {}
    for n in nodes:
        used = sum(u for _, u in running) if n == nodes[0] else 0
        pools[f"cpu@{n}"] = PoolState(f"cpu@{n}", "cpu", n, cpu, cpu - used)
        pools[f"mem@{n}"] = PoolState(f"mem@{n}", "mem", n, mem, mem)
    for name, (cap, free) in (api or {}).items():
        pools[f"api:{name}"] = PoolState(f"api:{name}", f"api:{name}", None, cap, free)
    return Snapshot(pools=pools, nodes=tuple(nodes), waiting=tuple(waiting),
                    running={f"cpu@{nodes[0]}": tuple(running)} if running else {},
                    placement=placement or {}, params=params or PolicyParams())


def _units(p):
    return {d.action.id: dict(d.units) for d in p.dispatches}


def test_greedy_eviction_prefers_fewer_faster_actions():
    # three actions of 8 s (10% serial) on 8 cores: A and B on 4 cores each, C right
    # after on all 8 (ACT 2.6 + 2.6 + 4.3) beats squeezing all three (3 + 3 + 2 cores:
    # 3.2 + 3.2 + 4.4) and running them one at a time on 8 (1.7 + 3.4 + 5.1)
    acts = [make_action(x, cpu={"min": 1, "max": 8}, t1=8.0, serial=0.1) for x in "ABC"]
    assert _units(plan(_snap(acts))) == {"A": {"cpu": 4}, "B": {"cpu": 4}}


def test_perfectly_parallel_actions_run_one_at_a_time_on_all_units():
    # linear speed-up: one at a time on all 8 cores (ACT 1 + 2 + 3) beats two on 4
    # (2 + 2 + 3); the estimate must see that the evicted ones start wide, not on one core
    acts = [make_action(x, cpu={"min": 1, "max": 8}, t1=8.0, serial=0.0) for x in "ABC"]
    assert _units(plan(_snap(acts))) == {"A": {"cpu": 8}}


def test_elastic_action_waits_for_many_cores_rather_than_start_on_one():
    # one core free, a 7-core action ends in 2 s, two 100 s elastic actions wait:
    # waiting 2 s for the cores beats running one for 100 s on the single free core
    # (the estimate must not assume the other one would start on its minimum)
    acts = [make_action(x, cpu={"min": 1, "max": 8}, t1=100.0, serial=0.05) for x in "AB"]
    got = _units(plan(_snap(acts, running=[(2.0, 7)])))
    assert got == {}


def test_eviction_stops_when_it_no_longer_helps():
    # strongly serial work gains nothing from more cores: everyone runs at once
    acts = [make_action(x, cpu={"min": 1, "max": 8}, t1=8.0, serial=0.95) for x in "ABCD"]
    got = _units(plan(_snap(acts)))
    assert set(got) == {"A", "B", "C", "D"} and sum(u["cpu"] for u in got.values()) <= 8


def test_alone_an_elastic_action_takes_what_helps():
    acts = [make_action("A", cpu={"min": 1, "max": 8}, t1=8.0, serial=0.0)]
    assert _units(plan(_snap(acts))) == {"A": {"cpu": 8}}


def test_evicted_actions_keep_fcfs_order_no_overtaking():
    # A needs 6 cores at least and only 4 are free: B (1 core) must not overtake it
    acts = [make_action("A", cpu=6), make_action("B", cpu=1)]
    assert _units(plan(_snap(acts, running=[(5.0, 4)]))) == {}


def test_api_action_never_waits_behind_cpu_action():
    acts = [make_action("big", cpu=6), make_action("search", api="search"), make_action("small", cpu=1)]
    got = _units(plan(_snap(acts, running=[(5.0, 4)], api={"search": (2, 2)})))
    assert got == {"search": {"api:search": 1}}


def test_cpu_action_never_waits_behind_api_action():
    acts = [make_action("q1", api="search"), make_action("q2", api="search"), make_action("shell", cpu=1)]
    got = _units(plan(_snap(acts, api={"search": (1, 1)})))
    assert got == {"q1": {"api:search": 1}, "shell": {"cpu": 1}}


def test_non_scalable_actions_get_their_minimum():
    acts = [make_action("unprofiled", cpu={"min": 2, "max": 8})]
    assert _units(plan(_snap(acts))) == {"unprofiled": {"cpu": 2}}


def test_fixed_dop_baseline():
    acts = [make_action(x, cpu={"min": 1, "max": 8}, t1=8.0, serial=0.0) for x in "AB"]
    got = _units(plan(_snap(acts, params=PolicyParams(fixed_dop=2))))
    assert got == {"A": {"cpu": 2}, "B": {"cpu": 2}}


def test_dop_caps_per_class():
    acts = [make_action("A", cpu={"min": 1, "max": 8}, t1=8.0, serial=0.0, cls="suite")]
    got = _units(plan(_snap(acts, params=PolicyParams(dop_caps={"suite": 3}))))
    assert got == {"A": {"cpu": 3}}


def test_new_trajectory_goes_to_node_with_most_free_memory():
    pools_snap = _snap([], nodes=("n0", "n1"))
    pools = dict(pools_snap.pools)
    pools["mem@n0"] = PoolState("mem@n0", "mem", "n0", 10_000, 2_000)
    a = make_action("A", cpu=1, trajectory="t", mem=1_000)
    snap = Snapshot(pools=pools, nodes=("n0", "n1"), waiting=(a,))
    (d,) = plan(snap).dispatches
    assert d.node == "n1" and d.place_mem_mb == 1_000


def test_placed_trajectory_stays_on_its_node():
    a = make_action("A", cpu=1, trajectory="t", mem=1_000)
    (d,) = plan(_snap([a], nodes=("n0", "n1"), placement={"t": "n0"})).dispatches
    assert d.node == "n0" and d.place_mem_mb == 0


def test_memory_for_the_whole_trajectory_must_fit():
    a = make_action("A", cpu=1, trajectory="t", mem=20_000)
    assert plan(_snap([a], mem=10_000)).dispatches == ()


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_depth_is_a_valid_knob(depth):
    acts = [make_action(x, cpu={"min": 1, "max": 8}, t1=8.0, serial=0.1) for x in "ABCDE"]
    got = _units(plan(_snap(acts, params=PolicyParams(depth=depth))))
    assert got and sum(u["cpu"] for u in got.values()) <= 8
    assert list(got) == ["A", "B", "C", "D", "E"][: len(got)]  # the scheduled set is a FCFS prefix


def test_gpu_action_prefers_the_node_where_its_model_is_resident():
    pools = {
        f"gpu@{n}": PoolState(f"gpu@{n}", "gpu", n, 8, 8, chunks=(8,), resident=frozenset(res))
        for n, res in (("n0", {"rm2@dop1"}), ("n1", {"rm@dop2"}))
    }
    a = make_action("judge", gpu=[1, 2], service="rm")  # "rm2" is another model, not a prefix match
    (d,) = plan(Snapshot(pools=pools, nodes=("n0", "n1"), waiting=(a,))).dispatches
    assert d.node == "n1"


def test_lone_elastic_action_waits_for_cores_about_to_free_up():
    # 2 of 66 cores free; 64 come back in 2.8 s. A 120 s (single-core) suite
    # finishes far sooner by waiting for them than by starting now on 2 cores.
    a = make_action("suite", cpu={"min": 1, "max": 64}, t1=120.0, serial=0.02)
    assert _units(plan(_snap([a], cpu=66, running=[(2.8, 64)]))) == {}


def test_lone_elastic_action_starts_when_waiting_does_not_pay():
    # the busy cores come back only in 500 s: start now on the free ones
    a = make_action("suite", cpu={"min": 1, "max": 64}, t1=120.0, serial=0.02)
    assert _units(plan(_snap([a], cpu=66, running=[(500.0, 64)]))) == {"suite": {"cpu": 2}}


def test_never_waits_when_nothing_would_wake_it():
    # nothing holds the pool: waiting would never end, so it starts
    a = make_action("suite", cpu={"min": 1, "max": 64}, t1=120.0, serial=0.02)
    assert _units(plan(_snap([a], cpu=2))) == {"suite": {"cpu": 2}}


def test_a_blocked_head_reserves_one_node_and_the_others_keep_serving():
    # the 4-GPU head fits nowhere; n0 is closest (3 free), so it waits for n0 alone
    pools = {
        "gpu@n0": PoolState("gpu@n0", "gpu", "n0", 8, 3, chunks=(1, 2)),
        "gpu@n1": PoolState("gpu@n1", "gpu", "n1", 8, 2, chunks=(2,)),
    }
    head = make_action("head", gpu=4)
    small = make_action("small", gpu=1)
    (d,) = plan(Snapshot(pools=pools, nodes=("n0", "n1"), waiting=(head, small))).dispatches
    assert (d.action.id, d.node) == ("small", "n1")  # never on the reserved n0


def test_a_head_that_fits_no_node_yet_blocks_only_its_node_for_cpu_too():
    waiting = [make_action("big", cpu=6), make_action("small", cpu=1)]
    snap = _snap(waiting, cpu=8, nodes=("n0", "n1"))
    pools = dict(snap.pools)
    pools["cpu@n0"] = PoolState("cpu@n0", "cpu", "n0", 8, 4)
    pools["cpu@n1"] = PoolState("cpu@n1", "cpu", "n1", 8, 2)
    got = plan(Snapshot(pools=pools, nodes=("n0", "n1"), waiting=tuple(waiting))).dispatches
    assert [(d.action.id, d.node) for d in got] == [("small", "n1")]


def test_units_that_buy_no_speedup_are_not_taken():
    # measured E(2) = 0.502: two cores are 0.4% faster than one; the second core is not worth holding
    from tangram.core.model import Action, Elasticity

    a = Action.build("suite", {"cpu": {"min": 1, "max": 2}}, t1_s=7.0,
                     elasticity=Elasticity.from_table({1: 1.0, 2: 0.502}))
    assert _units(plan(_snap([a], cpu=2))) == {"suite": {"cpu": 1}}


def test_actions_free_to_go_to_any_node_wait_in_every_node_estimate():
    # 12 suites of min 4 cores on two nodes of 8: the third fits nowhere and reserves n0, but it and
    # those behind it start on whichever node frees first, so n1's estimate counts them as n0's does.
    # Counted by n0 alone, n1 saw nobody waiting and ran one suite on all 8 cores, the other waiting.
    acts = [make_action(f"s{i}", cpu={"min": 4, "max": 8}, t1=100.0, serial=0.05) for i in range(12)]
    got = plan(_snap(acts, cpu=8, nodes=("n0", "n1"))).dispatches
    assert sorted((d.action.id, d.node, d.units["cpu"]) for d in got) == [
        ("s0", "n0", 4), ("s1", "n1", 4), ("s2", "n0", 4), ("s3", "n1", 4)]
    # as one node with the same queue decides for its two
    one = plan(_snap(acts, cpu=8, nodes=("n0",))).dispatches
    assert [(d.action.id, d.units["cpu"]) for d in one] == [("s0", 4), ("s1", 4)]


def test_every_node_look_ahead_holds_the_first_waiting_actions_in_queue_order():
    from tangram.policy.schedule import _select_candidates

    acts = [make_action(f"s{i}", cpu={"min": 4, "max": 8}, t1=100.0, serial=0.05) for i in range(12)]
    _, lookahead, _ = _select_candidates(_snap(acts, cpu=8, nodes=("n0", "n1"), params=PolicyParams(lookahead=3)))
    assert {p: [a.id for a in lst] for p, lst in lookahead.items()} == {
        "cpu@n0": ["s4", "s5", "s6"], "cpu@n1": ["s4", "s5", "s6"]}


def test_a_waiting_action_counts_only_on_nodes_that_could_ever_run_it():
    from tangram.policy.schedule import _select_candidates

    big = make_action("big", cpu={"min": 8, "max": 8})  # n1 has 4 cores: it can never run there
    small = [make_action(f"s{i}", cpu={"min": 1, "max": 4}, t1=10.0, serial=0.2) for i in range(2)]
    pools = {"cpu@n0": PoolState("cpu@n0", "cpu", "n0", 16, 4), "cpu@n1": PoolState("cpu@n1", "cpu", "n1", 4, 4),
             "mem@n0": PoolState("mem@n0", "mem", "n0", 10_000, 10_000),
             "mem@n1": PoolState("mem@n1", "mem", "n1", 10_000, 10_000)}
    snap = Snapshot(pools=pools, nodes=("n0", "n1"), waiting=(big, *small), params=PolicyParams(order="fcfs"))
    _, lookahead, _ = _select_candidates(snap)
    assert {p: [a.id for a in lst] for p, lst in lookahead.items()} == {"cpu@n0": ["big"]}
    # a trajectory to place needs a node whose memory could hold it
    traj = make_action("t", cpu=8, trajectory="T", mem=20_000)
    pools = {**pools, "cpu@n1": PoolState("cpu@n1", "cpu", "n1", 16, 4),
             "mem@n0": PoolState("mem@n0", "mem", "n0", 30_000, 30_000)}
    snap = Snapshot(pools=pools, nodes=("n0", "n1"), waiting=(traj,))
    _, lookahead, _ = _select_candidates(snap)
    assert {p: [a.id for a in lst] for p, lst in lookahead.items()} == {"cpu@n0": ["t"], "mem@n0": ["t"]}


def test_an_action_held_by_its_api_pool_counts_only_where_its_cores_wait():
    from tangram.policy.schedule import _select_candidates

    # cores fit on n0; the API pool is full: it waits for the API, not for cores on another node
    c = make_action("c", cpu=1, api="llm")
    snap = _snap([c], cpu=8, nodes=("n0", "n1"), api={"llm": (1, 0)})
    _, lookahead, _ = _select_candidates(snap)
    assert set(lookahead) == {"cpu@n0", "api:llm"}
