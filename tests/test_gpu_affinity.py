"""GPU affinity: idle resident instances, the order that lets a resident service drain its queue,
and its bound (starvation-freedom)."""
from __future__ import annotations


import pytest

from tangram.core.engine import Engine
from tangram.core.model import Action, Elasticity
from tangram.managers.gpu import Chunk, GpuManager, GpuNode, ModelSpec
from tangram.policy.schedule import plan
from tangram.policy.snapshot import PolicyParams, PoolState, Snapshot
from tests.helpers import drive

MODELS = (ModelSpec("rm", 60), ModelSpec("judge", 60), ModelSpec("tiny", 10))


def act(id, service, *, dop=(1,), t1=1.0, restore=2.0):
    return Action.build(id, {"gpu": list(dop)}, service=service, t1_s=t1, action_class=f"svc:{service}",
                        restore_s={m: restore / m for m in dop})


def test_idle_instances_are_the_resident_ones_best_fit_would_hand_out():
    m = GpuManager([GpuNode("g0", 8, 100)], MODELS)
    m.allocate("gpu@g0", 1, "a", act("a", "tiny"))  # (0, 1)
    m.allocate("gpu@g0", 1, "b", act("b", "rm"))  # (1, 1)
    m.allocate("gpu@g0", 2, "c", act("c", "judge", dop=(2,)))  # (2, 2)
    assert m.allocate("gpu@g0", 1, "d", act("d", "tiny")) == Chunk(4, 1)
    for h in ("b", "c", "d"):
        m.restored("gpu@g0", h)
    (state,) = m.pool_states()
    assert state.idle == ()  # every instance is busy
    m.release("gpu@g0", "d")
    (state,) = m.pool_states()
    assert state.idle == ("tiny@dop1",)  # its chunk is free again: a hit
    m.release("gpu@g0", "b")
    (state,) = m.pool_states()
    # free chunks (1, 1) and (4, 4): a 1-GPU request gets (1, 1), so tiny on device 4 is out of reach
    assert state.chunks == (1, 4) and state.idle == ("rm@dop1",)
    m.release("gpu@g0", "c")
    (state,) = m.pool_states()
    assert "judge@dop2" in state.idle


def _one_free_gpu(idle=("b@dop1",)):
    return {"gpu@n0": PoolState("gpu@n0", "gpu", "n0", 8, 1, chunks=(1,), resident=frozenset(idle), idle=tuple(idle))}


def test_a_queued_action_of_a_resident_service_takes_its_idle_instance_first():
    waiting = (act("A", "a", restore=5.0), act("B", "b", restore=5.0))
    snap = Snapshot(pools=_one_free_gpu(), nodes=("n0",), waiting=waiting, waiting_keys=(0.0, 1.0))
    (d,) = plan(snap).dispatches
    assert d.action.id == "B" and d.units == {"gpu": 1}
    assert d.estimated_s == pytest.approx(1.0)  # a hit: no restore in its estimate


@pytest.mark.parametrize("params, keys", [
    (PolicyParams(order="fcfs"), (0.0, 1.0)),  # the paper's order: no affinity
    (PolicyParams(affinity_k=0.0), (0.0, 1.0)),  # turned off
    (PolicyParams(), None),  # keys unknown: no time scale for the window
    (PolicyParams(affinity_k=4.0), (0.0, 20.5)),  # B is past A's window: 4 x 5 s restore
])
def test_without_affinity_or_past_the_window_the_head_goes_first(params, keys):
    waiting = (act("A", "a", restore=5.0), act("B", "b", restore=5.0))
    snap = Snapshot(pools=_one_free_gpu(), nodes=("n0",), waiting=waiting, waiting_keys=keys, params=params)
    (d,) = plan(snap).dispatches
    assert d.action.id == "A"


def test_one_idle_instance_serves_one_action_the_next_pays_its_restore():
    # two b actions, one idle b instance, two free GPUs: the second b is a miss and is charged for it
    pools = {"gpu@n0": PoolState("gpu@n0", "gpu", "n0", 8, 2, chunks=(2,), resident=frozenset({"b@dop1"}),
                                 idle=("b@dop1",))}
    waiting = (act("B1", "b", restore=3.0), act("B2", "b", restore=3.0))
    got = {d.action.id: d.estimated_s for d in plan(Snapshot(pools=pools, nodes=("n0",), waiting=waiting,
                                                             waiting_keys=(0.0, 0.1))).dispatches}
    assert sorted(got.values()) == pytest.approx([1.0, 4.0])


def test_restore_is_charged_against_a_larger_dop_that_hits():
    # a 4-GPU instance of b is idle; a 1-GPU start would pay a 6 s restore, so b takes the 4 GPUs
    pools = {"gpu@n0": PoolState("gpu@n0", "gpu", "n0", 8, 5, chunks=(1, 4), resident=frozenset({"b@dop4"}),
                                 idle=("b@dop4",))}
    b = Action.build("B", {"gpu": [1, 4]}, service="b", t1_s=4.0, elasticity=Elasticity.amdahl(0.5),
                     restore_s={1: 6.0, 4: 1.5})
    (d,) = plan(Snapshot(pools=pools, nodes=("n0",), waiting=(b,), waiting_keys=(0.0,))).dispatches
    assert d.units == {"gpu": 4}  # 2.5 s + no restore, against 4 s + 6 s
    # with no instance to take both DoPs pay their restore: 4 + 6 against 2.5 + 1.5
    cold = {"gpu@n0": PoolState("gpu@n0", "gpu", "n0", 8, 5, chunks=(1, 4), resident=frozenset(), idle=())}
    (d,) = plan(Snapshot(pools=cold, nodes=("n0",), waiting=(b,), waiting_keys=(0.0,))).dispatches
    assert d.estimated_s == pytest.approx(d.action.duration(d.units["gpu"]) + b.restore_s[d.units["gpu"]])


def _drive(eng, mgr, clock, arrivals):
    """Submit arrivals [(time, action)]; each started action runs its T1 (plus its restore on a miss)."""
    def seconds_of(s):
        (pool, chunk), = s.grants.items()
        extra = 0.0 if mgr.lease(pool, s.action.id).hit else s.action.restore_s[chunk.size]
        mgr.restored(pool, s.action.id, extra)
        return extra + s.action.t1_s

    drive(eng, clock, arrivals, seconds_of)


class _Clock:
    t = 0.0

    def __call__(self):
        return self.t


@pytest.mark.parametrize("affinity_k", [1.0, 4.0])
def test_affinity_is_starvation_free_under_a_stream_of_resident_hits(affinity_k):
    """One GPU, memory for one model: rm actions arrive twice as fast as it serves them, and each
    would hit; a judge action (a miss) waits at most for what sorts ahead of it: actions whose key
    is below its key plus affinity_k times its restore."""
    clock = _Clock()
    mgr = GpuManager([GpuNode("g0", 1, 100)], MODELS)
    params = PolicyParams(order="aging", aging_k=4.0, affinity_k=affinity_k)
    eng = Engine([mgr], clock=clock, params=params)
    arrivals = [(0.5 * i, act(f"r{i}", "rm")) for i in range(200)]
    arrivals.insert(5, (2.2, act("judge", "judge")))
    _drive(eng, mgr, clock, arrivals)
    judge = eng.record("judge")
    assert judge.state == "succeeded"
    bound = 2.2 + 4.0 * 1.0 + affinity_k * 2.0  # its key, shifted by its restore
    ahead = [i for i in range(200) if 0.5 * i + 4.0 * 1.0 <= bound]
    # one GPU: everything ahead of it (hits, 1 s each) and one more that was running
    assert judge.started_at <= 2.2 + len(ahead) * 1.0 + 1.0 + 2.0
    later = [eng.record(f"r{i}") for i in range(200) if 0.5 * i + 4.0 * 1.0 > bound + 1e-9]
    assert later and all(r.started_at >= judge.started_at for r in later)
    # and the rm actions that ran before it were hits: rm was restored once before the judge came
    assert mgr.stats()["nodes"]["gpu@g0"]["by_service"]["rm@dop1"]["misses"] <= 2


def test_without_affinity_the_miss_goes_by_its_key_alone():
    clock = _Clock()
    mgr = GpuManager([GpuNode("g0", 1, 100)], MODELS)
    eng = Engine([mgr], clock=clock, params=PolicyParams(order="aging", aging_k=4.0, affinity_k=0.0))
    arrivals = [(0.5 * i, act(f"r{i}", "rm")) for i in range(60)]
    arrivals.insert(5, (2.2, act("judge", "judge")))
    _drive(eng, mgr, clock, arrivals)
    later = [eng.record(f"r{i}") for i in range(60) if 0.5 * i > 2.2]
    assert all(r.started_at >= eng.record("judge").started_at for r in later)


def test_the_engine_hands_the_policy_each_waiting_actions_key():
    clock = _Clock()
    eng = Engine([GpuManager([GpuNode("g0", 1, 100)], MODELS)], clock=clock, params=PolicyParams())
    for i, svc in enumerate(("rm", "judge", "tiny", "rm", "judge")):
        clock.t = float(i)
        eng.submit(act(f"a{i}", svc, t1=1.0 + i))
    snap = eng.snapshot()
    ids, keys = [a.id for a in snap.waiting], list(snap.waiting_keys)
    assert len(ids) == len(keys) == 4 and keys == sorted(keys)
    # aging: submitted + 4 x expected
    assert keys == [float(int(i[1:])) + 4.0 * (1.0 + int(i[1:])) for i in ids]


def test_affinity_k_is_validated():
    with pytest.raises(ValueError, match="affinity_k"):
        PolicyParams(affinity_k=-1.0)


def test_the_act_estimate_charges_a_gpu_waiter_its_restore():
    from tangram.policy.estimate import waiter

    a = Action.build("W", {"gpu": [1, 2, 4]}, service="b", t1_s=4.0, elasticity=Elasticity.amdahl(0.1),
                     restore_s={1: 3.0, 2: 1.5, 4: 0.75})
    gpu = PoolState("gpu@n0", "gpu", "n0", 8, 8, chunks=(8,))
    snap = Snapshot(pools={gpu.name: gpu}, nodes=("n0",), waiting=())
    umin, dmin, options = waiter(a, gpu, snap)
    assert (umin, dmin) == (1, pytest.approx(4.0 + 3.0))
    assert dict(options) == pytest.approx({u: a.duration(u) + a.restore_s[u] for u in (1, 2, 4)})


@pytest.mark.parametrize("restore, started", [(5.0, 0), (0.5, 1)])
def test_an_action_waits_for_its_models_busy_instance_when_that_beats_a_restore(restore, started):
    # b@dop1 is resident but running; two GPUs are free. Its next request expects 1 s:
    # waiting for the running one is cheaper than a 5 s restore, not than a 0.5 s one
    pools = {"gpu@n0": PoolState("gpu@n0", "gpu", "n0", 8, 2, chunks=(2,), resident=frozenset({"b@dop1"}), idle=())}
    snap = Snapshot(pools=pools, nodes=("n0",), waiting=(act("B", "b", restore=restore),), waiting_keys=(0.0,))
    assert len(plan(snap).dispatches) == started


def test_a_long_queue_of_one_model_spreads_past_its_busy_instance():
    # ten queued requests of b, one busy b instance, a 3 s restore, 1 s each: the
    # first two wait for the instance (1 s, 2 s < 3 s), the rest start on free GPUs now
    pools = {"gpu@n0": PoolState("gpu@n0", "gpu", "n0", 8, 8, chunks=(8,), resident=frozenset({"b@dop1"}), idle=())}
    waiting = tuple(act(f"B{i}", "b", restore=3.0) for i in range(10))
    snap = Snapshot(pools=pools, nodes=("n0",), waiting=waiting, waiting_keys=tuple(float(i) for i in range(10)))
    got = sorted(d.action.id for d in plan(snap).dispatches)
    assert "B0" not in got and "B1" not in got and len(got) == 8


def test_two_idle_instances_of_one_service_serve_two_of_its_actions():
    # b is resident and idle at DoP 1 and at DoP 2: the first b action takes one instance, not both,
    # so the second starts on the other without a restore either
    pools = {"gpu@n0": PoolState("gpu@n0", "gpu", "n0", 8, 3, chunks=(1, 2), resident=frozenset({"b@dop1", "b@dop2"}),
                                 idle=("b@dop1", "b@dop2"))}
    waiting = tuple(Action.build(i, {"gpu": [1, 2]}, service="b", t1_s=1.0, elasticity=Elasticity.amdahl(0.5),
                                 action_class="svc:b", restore_s={1: 6.0, 2: 3.0}) for i in ("B1", "B2"))
    ds = plan(Snapshot(pools=pools, nodes=("n0",), waiting=waiting, waiting_keys=(0.0, 0.1))).dispatches
    assert sorted(d.units["gpu"] for d in ds) == [1, 2]
    for d in ds:  # both hits: no restore in either estimate
        assert d.estimated_s == pytest.approx(d.action.duration(d.units["gpu"]))


def test_a_busy_instance_the_action_cannot_run_at_does_not_hold_it():
    # b is resident only as an 8-GPU instance, busy; a b action that runs at 1 or 2 GPUs can never
    # take that instance, so waiting for it would be for ever: it starts now (and pays its restore)
    pools = {"gpu@n0": PoolState("gpu@n0", "gpu", "n0", 16, 8, chunks=(8,), resident=frozenset({"b@dop8"}), idle=())}
    a = act("B", "b", dop=(1, 2), t1=1.0, restore=20.0)
    (d,) = plan(Snapshot(pools=pools, nodes=("n0",), waiting=(a,), waiting_keys=(0.0,))).dispatches
    assert d.action.id == "B" and d.estimated_s > d.action.duration(d.units["gpu"])
    # the same action with a busy instance it can use waits for it (1 s of work against a 20 s restore)
    pools["gpu@n0"] = PoolState("gpu@n0", "gpu", "n0", 16, 8, chunks=(8,), resident=frozenset({"b@dop1"}), idle=())
    assert plan(Snapshot(pools=pools, nodes=("n0",), waiting=(a,), waiting_keys=(0.0,))).dispatches == ()


# A held action's wait is when its model's busy instance frees (the running action's time left, from the
# snapshot), not its own expected duration. Two free GPUs, b@dop1 resident and running, a 3 s restore.
def _busy_b(running_services, free=2):
    pools = {"gpu@n0": PoolState("gpu@n0", "gpu", "n0", 8, free, chunks=(free,), resident=frozenset({"b@dop1"}),
                                 idle=())}
    return pools, running_services


@pytest.mark.parametrize("t1, left, started", [
    (10.0, 0.2, 0),  # a long action, but the instance frees in 0.2 s: waiting beats a 3 s restore
    (1.0, 20.0, 1),  # a short action, but the instance is busy for 20 s more: restore now
    (1.0, 2.9, 0),  # just under the restore: wait
    (1.0, 3.1, 1),  # just over: restore
])
def test_a_held_action_waits_for_the_busy_instances_time_left_not_its_own_duration(t1, left, started):
    pools, running = _busy_b({"b": ((left, 1),)})
    snap = Snapshot(pools=pools, nodes=("n0",), waiting=(act("B", "b", t1=t1, restore=3.0),), waiting_keys=(0.0,),
                    running_services=running)
    assert len(plan(snap).dispatches) == started


def test_held_actions_queue_on_the_busy_instances_by_when_each_frees():
    # b is resident and busy on two nodes, its instances free in 0.5 s and 2.5 s; 1 s per action, 3 s
    # restore: the instances serve held actions from 0.5, 1.5, 2.5 and 2.5 s; the fifth would wait 3.5 s
    # (> 3 s) and starts on a free GPU now, as does the sixth
    pools = {f"gpu@{n}": PoolState(f"gpu@{n}", "gpu", n, 8, free, chunks=(free,) if free else (),
                                   resident=frozenset({"b@dop1"}), idle=())
             for n, free in (("n0", 4), ("n1", 0))}
    waiting = tuple(act(f"B{i}", "b", restore=3.0) for i in range(6))
    snap = Snapshot(pools=pools, nodes=("n0", "n1"), waiting=waiting, waiting_keys=tuple(float(i) for i in range(6)),
                    running_services={"b": ((2.5, 1), (0.5, 1))})
    assert sorted(d.action.id for d in plan(snap).dispatches) == ["B4", "B5"]


def test_a_running_action_at_a_dop_the_waiter_cannot_use_is_not_waited_for():
    # the only running b action is on an 8-GPU instance; the waiter runs at 1 or 2 GPUs. Its resident
    # 1-GPU instance is busy with nothing known to run on it: it frees evenly over the waiter's 1 s
    pools = {"gpu@n0": PoolState("gpu@n0", "gpu", "n0", 16, 2, chunks=(2,), resident=frozenset({"b@dop1"}), idle=())}
    a = act("B", "b", dop=(1, 2), t1=1.0, restore=20.0)
    snap = Snapshot(pools=pools, nodes=("n0",), waiting=(a,), waiting_keys=(0.0,), running_services={"b": ((0.1, 8),)})
    assert plan(snap).dispatches == ()  # held: 1 s (the even spread) < 20 s, not the 8-GPU action's 0.1 s
    a = act("B", "b", dop=(1, 2), t1=30.0, restore=20.0)
    snap = Snapshot(pools=pools, nodes=("n0",), waiting=(a,), waiting_keys=(0.0,), running_services={"b": ((0.1, 8),)})
    assert len(plan(snap).dispatches) == 1  # 30 s > 20 s: the 8-GPU instance freeing soon does not hold it


def test_the_engine_tells_the_policy_when_each_services_running_gpu_actions_end():
    clock = _Clock()
    eng = Engine([GpuManager([GpuNode("g0", 2, 100)], MODELS)], clock=clock, params=PolicyParams())
    (s,) = eng.submit(act("r0", "rm", t1=5.0))
    clock.t = 1.0
    (entry,) = eng.snapshot().running_services["rm"]
    assert entry == (pytest.approx(s.record.estimated_end - 1.0), 1)  # (seconds left, the instance's DoP)
    assert "judge" not in eng.snapshot().running_services
    eng.complete("r0")
    assert "rm" not in eng.snapshot().running_services


def test_an_instance_with_no_known_action_that_frees_first_holds_the_action():
    # b is resident and busy on two nodes: one instance's running action has 5 s left, the other's is not
    # known (it frees evenly over the waiter's 1 s: at 1 s). 1 s < the 3 s restore: held, not dispatched,
    # whichever order the known and the spread free times come in
    pools = {f"gpu@{n}": PoolState(f"gpu@{n}", "gpu", n, 8, free, chunks=(free,) if free else (),
                                   resident=frozenset({"b@dop1"}), idle=())
             for n, free in (("n0", 4), ("n1", 0))}
    for running in (((5.0, 1),), ((0.4, 1),)):
        snap = Snapshot(pools=pools, nodes=("n0", "n1"), waiting=(act("B", "b", t1=1.0, restore=3.0),),
                        waiting_keys=(0.0,), running_services={"b": running})
        assert plan(snap).dispatches == ()
