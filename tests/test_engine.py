"""The clock-injected engine: submit, complete, cancel, timing, rejection, no starvation."""
from __future__ import annotations

import heapq
import random

import pytest

from tangram.core.errors import UnknownActionError, UnschedulableError
from tangram.managers.buddy import Chunk

from tests.helpers import make_action, make_engine, make_node


def _ids(started):
    return [s.action.id for s in started]


def test_timing_is_recorded_on_the_injected_clock():
    eng, clock = make_engine(make_node(cores=1))
    assert _ids(eng.submit(make_action("a", cpu=1))) == ["a"]
    assert eng.submit(make_action("b", cpu=1)) == []
    clock.advance(2.0)
    assert _ids(eng.complete("a")) == ["b"]
    clock.advance(3.0)
    eng.complete("b")
    b = eng.record("b")
    assert (b.queued_s, b.exec_s, b.act_s, b.state) == (2.0, 3.0, 5.0, "succeeded")


@pytest.mark.parametrize(
    "action, field",
    [
        (make_action("many-cores", cpu={"min": 16, "max": 32}), "resources.cpu"),  # more cores than any node
        (make_action("many-gpus", gpu=8), "resources.gpu"),  # node has 4 GPUs
        (make_action("no-api", api="nowhere"), "resources.api:nowhere"),  # unknown API pool
        (make_action("huge-mem", cpu=1, mem=1_000_000), "resources.mem_mb"),  # no node has that memory
    ],
)
def test_impossible_demands_are_rejected_never_queued(action, field):
    eng, _ = make_engine(make_node(cores=8, gpus=4))
    with pytest.raises(UnschedulableError) as e:
        eng.submit(action)
    assert e.value.field == field and e.value.reason
    assert not eng.waiting and not eng.running


def test_duplicate_id_rejected():
    eng, _ = make_engine(make_node())
    eng.submit(make_action("a", cpu=1))
    with pytest.raises(UnschedulableError):
        eng.submit(make_action("a", cpu=1))


def test_cancel_waiting_and_running_releases_everything():
    eng, _ = make_engine(make_node(cores=2), api={"s": 1})
    eng.submit(make_action("r", cpu=2, trajectory="t", mem=100))
    eng.submit(make_action("w", cpu=1))
    eng.submit(make_action("q", api="s"))
    eng.check_invariants()
    eng.cancel("w")
    assert _ids(eng.cancel("r")) == []  # nothing left waiting for cpu
    eng.cancel("q")
    eng.check_invariants()
    pools = eng.pool_states()
    assert pools["cpu@n0"].free == 2 and pools["api:s"].free == 1
    assert pools["mem@n0"].free == 10_000 - 100  # the trajectory still holds its memory
    eng.close_trajectory("t")
    assert eng.pool_states()["mem@n0"].free == 10_000
    assert eng.record("w").state == "cancelled"
    eng.cancel("w")  # idempotent for finished actions
    with pytest.raises(UnknownActionError):
        eng.cancel("nope")


def test_trajectory_memory_balances_across_nodes_and_pins():
    eng, clock = make_engine(make_node("n0", mem=1000), make_node("n1", mem=1000))
    started = eng.submit(make_action("a1", cpu=1, trajectory="ta", mem=600))
    started += eng.submit(make_action("b1", cpu=1, trajectory="tb", mem=600))
    nodes = {s.action.id: s.dispatch.node for s in started}
    assert nodes["a1"] != nodes["b1"]  # the second goes where memory is left
    eng.complete("a1")
    (s,) = eng.submit(make_action("a2", cpu=1, trajectory="ta", mem=600))
    assert s.dispatch.node == nodes["a1"] and s.dispatch.place_mem_mb == 0
    eng.check_invariants()


def test_gpu_actions_get_valid_buddy_chunks():
    eng, _ = make_engine(make_node(cores=1, gpus=8))
    started = []
    for i, dop in enumerate([4, 1, 2, 1]):
        started += eng.submit(make_action(f"g{i}", gpu=dop))
    chunks = [s.grants["gpu@n0"] for s in started]
    assert all(isinstance(c, Chunk) and c.start % c.size == 0 for c in chunks)
    covered = sorted(d for c in chunks for d in c.devices)
    assert covered == list(range(8))  # one action per GPU, all 8 used, no overlap
    for s in started:
        eng.cancel(s.action.id)
    eng.check_invariants()
    assert eng.pool_states()["gpu@n0"].chunks == (8,)  # buddies merged back


def test_class_average_estimates_unprofiled_actions():
    eng, clock = make_engine(make_node(cores=1))
    eng.submit(make_action("a", cpu=1, cls="shell"))
    clock.advance(0.5)
    eng.complete("a")
    assert eng.estimator.mean_duration("shell") == pytest.approx(0.5)
    assert eng.snapshot().class_estimates == {"shell": 0.5}


def test_no_starvation_under_a_stream_of_small_arrivals():
    """A 4-core action amid a stream of 1-core actions on 4 cores still runs, promptly."""
    eng, clock = make_engine(make_node(cores=4))
    rng = random.Random(7)
    events: list[tuple[float, int, str]] = []  # (time, seq, action id) completions
    seq = 0

    def run(started):
        nonlocal seq
        for s in started:
            seq += 1
            heapq.heappush(events, (clock.t + rng.uniform(0.5, 1.5), seq, s.action.id))

    arrivals = [(0.2 * i, f"small{i}") for i in range(200)]
    arrivals.insert(10, (2.0, "big"))
    for t, aid in arrivals:
        while events and events[0][0] <= t:
            clock.t, _, done = heapq.heappop(events)
            run(eng.complete(done))
        clock.t = t
        run(eng.submit(make_action(aid, cpu=4 if aid == "big" else 1)))
    while events:
        clock.t, _, done = heapq.heappop(events)
        run(eng.complete(done))
    big = eng.record("big")
    assert big.state == "succeeded"
    assert big.queued_s <= 1.5 + 1e-9  # waits only for the cores busy when it arrived
    assert all(r.state == "succeeded" for r in eng.records())
    eng.check_invariants()


def test_overdue_running_action_is_not_assumed_to_end_now():
    # an unprofiled 64-core action estimated at 1 s has run for 300 s: it is taken to
    # need ~150 s more, not 0, so a new elastic suite starts on the 2 free cores (~61 s)
    from tangram.policy.snapshot import PolicyParams

    eng, clock = make_engine(make_node(cores=66), params=PolicyParams(default_duration_s=1.0))
    eng.submit(make_action("long", cpu=64))
    clock.advance(300.0)
    (s,) = eng.submit(make_action("suite", cpu={"min": 1, "max": 64}, t1=120.0, serial=0.02))
    assert s.dispatch.units["cpu"] == 2


def test_a_range_past_every_node_is_capped_to_the_largest_pool_at_submit():
    eng, _ = make_engine(make_node("n0", cores=4), make_node("n1", cores=6))
    started = eng.submit(make_action("huge", cpu={"min": 1, "max": 10 ** 9}, t1=1.0, serial=0.0))
    rec = eng.running.get("huge") or eng.waiting["huge"]
    assert (rec.action.demands["cpu"].min, rec.action.demands["cpu"].max) == (1, 6)
    assert [s.dispatch.units["cpu"] for s in started] and all(s.dispatch.units["cpu"] <= 6 for s in started)
    with pytest.raises(UnschedulableError) as e:
        eng.submit(make_action("never", cpu=10 ** 9))
    assert e.value.field == "resources.cpu"


def test_check_invariants_names_a_leaked_and_a_missing_grant():
    eng, _ = make_engine(make_node("n0", cores=4))
    eng.submit(make_action("a", cpu=2))
    eng.check_invariants()  # balanced
    rec = eng.running.pop("a")  # the engine forgot it, the manager still holds its grant
    with pytest.raises(AssertionError, match=r"leaked \[\('cpu@n0', 'a'\)\]"):
        eng.check_invariants()
    eng.running["a"] = rec
    eng.running["ghost"] = type(rec)(rec.action, 0.0, grants={"cpu@n0": rec.grants["cpu@n0"]})  # never granted
    with pytest.raises(AssertionError, match=r"missing \[\('cpu@n0', 'ghost'\)\]"):
        eng.check_invariants()
