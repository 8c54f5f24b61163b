"""Queue order: FCFS (the paper's) and aging (shortest expected first, bounded)."""
from __future__ import annotations

import random

import pytest

from tangram.core.model import Action
from tangram.policy.order import expected_s, order_key
from tangram.policy.snapshot import PolicyParams
from tests.helpers import drive, make_action, make_engine, make_node


def _short(i):
    return make_action(f"s{i}", cpu=1, t1=1.0)


def test_aging_serves_short_work_first_and_fcfs_does_not():
    waits = {}
    for order in ("fcfs", "aging"):
        eng, clock = make_engine(make_node(cores=1), params=PolicyParams(order=order, aging_k=4.0))
        arrivals = [(0.0, make_action("busy", cpu=1, t1=5.0)), (0.1, make_action("long", cpu=1, t1=20.0)),
                    (0.2, _short(0))]
        drive(eng, clock, arrivals, lambda s: s.action.t1_s)
        waits[order] = (eng.record("s0").queued_s, eng.record("long").queued_s)
    assert waits["fcfs"][0] > waits["fcfs"][1]  # the short one waits behind the long one
    assert waits["aging"][0] < waits["aging"][1]  # and goes first under aging


@pytest.mark.parametrize("k", [1.0, 4.0])
def test_aging_is_starvation_free_under_a_stream_of_shorter_actions(k):
    """Arrivals after ``submitted + k * expected`` sort behind a waiting action: it starts by then
    plus the work queued ahead of it (here one core, 1 s actions every 0.5 s: twice overloaded)."""
    eng, clock = make_engine(make_node(cores=1), params=PolicyParams(order="aging", aging_k=k))
    arrivals = [(0.5 * i, _short(i)) for i in range(400)]
    arrivals.insert(4, (2.0, make_action("long", cpu=1, t1=10.0)))
    drive(eng, clock, arrivals, lambda s: s.action.t1_s)
    long = eng.record("long")
    assert long.state == "succeeded"
    key = 2.0 + k * 10.0
    # everything ahead of it arrived before its key; on one core that is at most key / 0.5 short actions
    ahead = sum(1 for i in range(400) if 0.5 * i + k * 1.0 < key)
    assert long.started_at <= 2.0 + ahead * 1.0 + 1.0
    # and it did not run last: later arrivals (larger keys) ran after it
    later = [eng.record(f"s{i}") for i in range(400) if 0.5 * i + k * 1.0 > key]
    assert later and all(r.started_at >= long.started_at for r in later)


@pytest.mark.parametrize("seed", range(4))
def test_every_action_finishes_under_aging_with_random_sizes(seed):
    rng = random.Random(seed)
    eng, clock = make_engine(make_node(cores=4), params=PolicyParams(order="aging", aging_k=2.0))
    arrivals = []
    for i in range(300):
        cpu = rng.choice((1, 1, 2, 4))
        arrivals.append((0.3 * i, make_action(f"a{i}", cpu=cpu, t1=rng.choice((0.5, 1.0, 8.0)))))
    drive(eng, clock, arrivals, lambda s: s.action.t1_s)
    recs = [eng.record(f"a{i}") for i in range(300)]
    assert all(r.state == "succeeded" for r in recs)
    for r in recs:  # each waits at most the work submitted up to its key, spread on 4 cores, plus one action
        key = r.submitted_at + 2.0 * r.action.t1_s
        ahead = sum(o.action.t1_s * o.action.demands["cpu"].min for o in recs if o.submitted_at <= key)
        assert r.queued_s <= ahead + 8.0


def test_a_capped_window_bounds_how_long_a_long_action_is_passed():
    """With aging_cap_s, arrivals more than the cap after a waiting action sort behind it, however
    long it is: the 40 s action (window 160 s uncapped) starts once the work submitted within
    10 s of it is done, not 160 s of it."""
    starts = {}
    for cap in (None, 10.0):
        eng, clock = make_engine(make_node(cores=1), params=PolicyParams(order="aging", aging_k=4.0, aging_cap_s=cap))
        arrivals = [(0.5 * i, _short(i)) for i in range(600)]
        arrivals.insert(4, (2.0, make_action("long", cpu=1, t1=40.0)))
        drive(eng, clock, arrivals, lambda s: s.action.t1_s)
        long = eng.record("long")
        assert long.state == "succeeded"
        starts[cap] = long.started_at
        key = 2.0 + (4.0 * 40.0 if cap is None else cap)
        ahead = sum(1 for i in range(600) if 0.5 * i + 4.0 * 1.0 < key)  # short ones sorting before it
        assert long.started_at <= 2.0 + ahead * 1.0 + 1.0
        later = [eng.record(f"s{i}") for i in range(600) if 0.5 * i + 4.0 * 1.0 > key]
        assert later and all(r.started_at >= long.started_at for r in later)
    assert starts[10.0] < starts[None] - 100.0


def test_the_cap_only_shortens_windows_longer_than_it():
    a = make_action("x", cpu=1, t1=3.0)
    assert order_key(a, 10.0, "aging", 4.0, {}, 1.0, aging_cap_s=5.0) == 15.0  # 12 s window capped
    assert order_key(a, 10.0, "aging", 4.0, {}, 1.0, aging_cap_s=20.0) == 22.0  # under the cap: as before
    assert order_key(a, 10.0, "fcfs", 4.0, {}, 1.0, aging_cap_s=5.0) == 10.0


def test_order_key_is_fixed_per_action():
    a = make_action("x", cpu=1, t1=3.0)
    assert order_key(a, 10.0, "fcfs", 4.0, {}, 1.0) == 10.0
    assert order_key(a, 10.0, "aging", 4.0, {}, 1.0) == 22.0
    unknown = make_action("y", cpu=1, cls="shell")
    assert expected_s(unknown, {"shell": 0.5}, 1.0) == 0.5  # its class's running average
    assert expected_s(unknown, {}, 2.0) == 2.0  # nothing known yet: the default
    elastic = Action.build("z", {"cpu": {"min": 2, "max": 8}}, t1_s=8.0)
    assert expected_s(elastic, {}, 1.0) == 8.0  # no elasticity model: T1 at its minimum


def test_progress_moves_the_key_earlier_per_ended_action_of_the_trajectory():
    a = make_action("x", api="search", t1=1.0, trajectory="t")
    assert order_key(a, 10.0, "aging", 4.0, {}, 1.0, progress_s=8.0, done=3) == 10.0 + 4.0 - 24.0
    assert order_key(a, 10.0, "aging", 4.0, {}, 1.0, progress_s=0.0, done=3) == 14.0  # off: as before
    assert order_key(a, 10.0, "fcfs", 4.0, {}, 1.0, progress_s=8.0, done=3) == 10.0  # FCFS stays the paper's


def test_a_trajectory_further_along_goes_first_with_progress_s():
    """One API slot; trajectory "old" has had two actions end, "new" none. With progress_s their next
    calls, submitted together, run old's first; without it, in arrival order (new's first). The
    generation credit is off: it would weigh old's quiet spells too."""
    calls = [(0.0, "old-0", 1.0, "old"), (1.0, "old-1", 1.0, "old"), (2.0, "busy", 3.0, None),
             (2.5, "new-0", 1.0, "new"), (2.6, "old-2", 1.0, "old")]
    first = {p: _first_on_one_slot(PolicyParams(order="aging", progress_s=p, generation_credit=0.0), calls,
                                   ("new-0", "old-2"))
             for p in (0.0, 5.0)}
    assert first == {0.0: "new-0", 5.0: "old-2"}


def _first_on_one_slot(params, calls, pair):
    """Which of ``pair`` starts first when ``calls`` [(time, id, seconds, trajectory)] share one API slot."""
    eng, clock = make_engine(api={"search": 1}, params=params)
    arrivals = [(t, make_action(i, api="search", t1=d, trajectory=traj)) for t, i, d, traj in calls]
    drive(eng, clock, arrivals, lambda s: s.action.t1_s)
    assert all(eng.record(i).state == "succeeded" for i in pair)
    return min(pair, key=lambda i: eng.record(i).started_at)


@pytest.mark.parametrize("progress", [0.0, 2.0])
def test_aging_with_progress_credit_is_starvation_free_within_its_documented_bound(progress):
    """docs/scheduling.md ("Order"): with ``progress_s`` an action can also be passed by one submitted
    up to ``progress_s x done`` after its own key, so with trajectories of at most ``length`` actions
    every arrival after ``key + progress_s x (length - 1)`` (minus its own window) sorts behind it.

    One core, 1 s actions every 0.9 s (1.1x overloaded) in trajectories of 6, one 10 s action at 2 s;
    its key is 2 + 4 x 10 = 42 s."""
    length, k, every = 6, 4.0, 0.9
    eng, clock = make_engine(make_node(cores=1), params=PolicyParams(order="aging", aging_k=k, progress_s=progress))
    n = 300

    def traj(i):  # 8 trajectories in flight, each gets every 8th arrival, 6 actions each
        return f"t{i // (8 * length)}-{i % 8}"
    arrivals = [(every * i, make_action(f"s{i}", cpu=1, t1=1.0, trajectory=traj(i))) for i in range(n)]
    arrivals.insert(3, (2.0, make_action("long", cpu=1, t1=10.0)))
    drive(eng, clock, arrivals, lambda s: s.action.t1_s)
    long = eng.record("long")
    assert long.state == "succeeded"
    key = 2.0 + k * 10.0
    # an arrival's key is at least its time + k x 1 s - progress x (length - 1)
    ahead = sum(1 for i in range(n) if every * i + k * 1.0 - progress * (length - 1) < key)
    assert long.started_at <= 2.0 + ahead * 1.0 + 1.0
    later = [eng.record(f"s{i}") for i in range(n) if every * i + k * 1.0 - progress * (length - 1) > key]
    assert later and all(r.started_at >= long.started_at for r in later)
    # the credit was used: with it, some arrival whose key without credit is after the long one's
    # started before it (without it, none did)
    passed = [i for i in range(n) if every * i + k * 1.0 > key and eng.record(f"s{i}").started_at < long.started_at]
    assert bool(passed) is (progress > 0)


def test_generation_credit_moves_an_api_actions_key_earlier_per_second_of_generation():
    call = make_action("x", api="search", t1=1.0, trajectory="t")
    shell = make_action("y", cpu=1, t1=1.0, trajectory="t")
    assert order_key(call, 10.0, "aging", 4.0, {}, 1.0, generation_credit=2.0, generated_s=30.0) == 10.0 + 4.0 - 60.0
    assert order_key(call, 10.0, "aging", 4.0, {}, 1.0, generation_credit=0.0, generated_s=30.0) == 14.0  # off
    assert order_key(call, 10.0, "fcfs", 4.0, {}, 1.0, generation_credit=2.0, generated_s=30.0) == 10.0
    # only calls of an API pool: on CPU and GPU pools the window by expected size orders the queue
    assert order_key(shell, 10.0, "aging", 4.0, {}, 1.0, generation_credit=2.0, generated_s=30.0) == 14.0
    # with progress_s both count
    assert order_key(call, 10.0, "aging", 4.0, {}, 1.0, progress_s=1.0, done=3, generation_credit=0.5,
                     generated_s=8.0) == 14.0 - 3.0 - 4.0


def test_the_trajectory_that_generated_longest_calls_first_with_generation_credit():
    """One API slot; trajectory "slow" generates 6.1 s between its two calls, "fast" 1 s and 3 s between
    its three; their last calls wait together behind a busy one. With the credit slow's goes first
    (key 7.1 + 4 - 6.1 against 7.0 + 4 - 4.0); without it, in arrival order (fast's first)."""
    calls = [(0.0, "slow-0", 1.0, "slow"), (1.0, "fast-0", 1.0, "fast"), (3.0, "fast-1", 1.0, "fast"),
             (3.5, "busy", 4.0, None), (7.0, "fast-2", 1.0, "fast"), (7.1, "slow-1", 1.0, "slow")]
    first = {c: _first_on_one_slot(PolicyParams(order="aging", generation_credit=c), calls, ("fast-2", "slow-1"))
             for c in (0.0, 1.0)}
    assert first == {0.0: "fast-2", 1.0: "slow-1"}


@pytest.mark.parametrize("credit", [0.0, 2.0])
def test_aging_with_generation_credit_is_starvation_free_within_its_documented_bound(credit):
    """docs/scheduling.md ("Order"): with ``generation_credit`` an API call can also be passed by one
    submitted up to ``generation_credit x G`` after its own key, G the passer's trajectory's generation
    so far; so every arrival after ``key + credit x G_max`` (minus its own window) sorts behind it,
    G_max the most any trajectory generated.

    One API slot, 1 s calls every 0.9 s (1.1x overloaded) in trajectories of 6 calls 7.2 s apart (each
    trajectory quiet while its call is done and the next not yet made), one 10 s call at 2 s; its key
    is 2 + 4 x 10 = 42 s."""
    length, k, every, in_flight = 6, 4.0, 0.9, 8
    eng, clock = make_engine(api={"search": 1},
                             params=PolicyParams(order="aging", aging_k=k, generation_credit=credit))
    n = 300

    def traj(i):
        return f"t{i // (in_flight * length)}-{i % in_flight}"
    arrivals = [(every * i, make_action(f"s{i}", api="search", t1=1.0, trajectory=traj(i))) for i in range(n)]
    arrivals.insert(3, (2.0, make_action("long", api="search", t1=10.0)))
    drive(eng, clock, arrivals, lambda s: s.action.t1_s)
    long = eng.record("long")
    assert long.state == "succeeded"
    key = 2.0 + k * 10.0
    # each trajectory's generation once its last call ended (now = 0: its closed quiet spells alone)
    g_max = max(eng._generating.generated_s(traj(i), 0.0) for i in range(n))
    assert g_max > 5.0  # the early trajectories were quiet for most of their 7.2 s between calls
    ahead = sum(1 for i in range(n) if every * i + k * 1.0 - credit * g_max < key)
    assert long.started_at <= 2.0 + ahead * 1.0 + 1.0
    later = [eng.record(f"s{i}") for i in range(n) if every * i + k * 1.0 - credit * g_max > key]
    assert later and all(r.started_at >= long.started_at for r in later)
    # the credit was used: some call whose key without it is after the long one's started first
    passed = [i for i in range(n) if every * i + k * 1.0 > key and eng.record(f"s{i}").started_at < long.started_at]
    assert bool(passed) is (credit > 0)


def test_generating_counts_a_trajectorys_generation_between_its_actions():
    from tangram.core.generating import Generating

    g = Generating()
    a, b, c = (make_action(i, api="search", trajectory="t") for i in "abc")
    g.submitted(a, 5.0)  # its first action: the engine did not see it start, nothing counted
    assert g.generated_s("t", 5.0) == 0.0
    g.ended(a, None, 6.0)
    assert g.generated_s("t", 9.5) == 3.5  # quiet since 6 s: the spell so far counts
    g.submitted(b, 10.0)
    assert g.generated_s("t", 50.0) == 4.0  # not quiet now: the closed spells alone
    g.ended(b, None, 11.0)
    g.submitted(c, 13.0)
    assert g.generated_s("t", 13.0) == 6.0
    assert g.order_inputs("t", 13.0, PolicyParams(generation_credit=1.0)) == (0, 6.0)
    assert g.order_inputs("t", 13.0, PolicyParams(progress_s=1.0, generation_credit=0.0)) == (2, 0.0)
    assert g.order_inputs(None, 13.0, PolicyParams(progress_s=1.0, generation_credit=1.0)) == (0, 0.0)
    g.closed("t")
    assert g.generated_s("t", 20.0) == 0.0


def test_generating_counts_ended_actions_per_trajectory_until_it_closes():
    from tangram.core.generating import Generating

    g = Generating()
    a, b = make_action("a", cpu=1, trajectory="t"), make_action("b", cpu=1, trajectory="t")
    for x in (a, b):
        g.submitted(x, 0.0)
    assert g.done("t") == 0
    g.ended(a, None, 1.0)
    g.ended(b, None, 2.0)
    assert g.done("t") == 2 and g.done("other") == 0
    g.closed("t")
    assert g.done("t") == 0


def test_order_is_validated():
    with pytest.raises(ValueError, match="order"):
        PolicyParams(order="sjf")
    with pytest.raises(ValueError, match="aging_k"):
        PolicyParams(aging_k=-1.0)
    for bad in (-1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="aging_cap_s"):
            PolicyParams(aging_cap_s=bad)
        with pytest.raises(ValueError, match="progress_s"):
            PolicyParams(progress_s=bad)
        with pytest.raises(ValueError, match="generation_credit"):
            PolicyParams(generation_credit=bad)


def test_the_cluster_config_chooses_the_order():
    from tangram.service.config import ConfigError, parse_config

    cfg = parse_config({"cpu_nodes": [], "gpu_nodes": [],
                        "scheduler": {"order": "fcfs", "aging_k": 2.5, "affinity_k": 0}})
    assert (cfg.order, cfg.aging_k, cfg.affinity_k) == ("fcfs", 2.5, 0)
    default = parse_config({"cpu_nodes": [], "gpu_nodes": []})
    d = PolicyParams()
    assert (default.order, default.aging_k, default.affinity_k) == (d.order, d.aging_k, d.affinity_k)
    with pytest.raises(ConfigError, match="scheduler.affinity_k"):
        parse_config({"cpu_nodes": [], "gpu_nodes": [], "scheduler": {"affinity_k": -1}})
    assert default.aging_cap_s is None
    capped = parse_config({"cpu_nodes": [], "gpu_nodes": [], "scheduler": {"aging_cap_s": 30}})
    assert capped.aging_cap_s == 30
    for bad in (-1, "30", True):
        with pytest.raises(ConfigError, match="scheduler.aging_cap_s"):
            parse_config({"cpu_nodes": [], "gpu_nodes": [], "scheduler": {"aging_cap_s": bad}})
        with pytest.raises(ConfigError, match="scheduler.progress_s"):
            parse_config({"cpu_nodes": [], "gpu_nodes": [], "scheduler": {"progress_s": bad}})
        with pytest.raises(ConfigError, match="scheduler.generation_credit"):
            parse_config({"cpu_nodes": [], "gpu_nodes": [], "scheduler": {"generation_credit": bad}})
    assert default.progress_s == 0.0
    assert parse_config({"cpu_nodes": [], "gpu_nodes": [], "scheduler": {"progress_s": 8}}).progress_s == 8.0
    assert default.generation_credit == PolicyParams().generation_credit == 1.5  # docs/results: measured best
    assert parse_config({"cpu_nodes": [], "gpu_nodes": [],
                         "scheduler": {"generation_credit": 1.5}}).generation_credit == 1.5


async def test_the_service_engine_gets_the_configured_cap():
    from tangram.service.build import build_runtime
    from tangram.service.config import parse_config

    cfg = parse_config({"cpu_nodes": [], "gpu_nodes": [], "api_pools": {"search": {"concurrency": 2}},
                        "scheduler": {"aging_cap_s": 12.5, "progress_s": 4, "generation_credit": 0.75}})
    async with await build_runtime(cfg) as rt:
        p = rt.engine.params
        assert (p.aging_cap_s, p.progress_s, p.generation_credit) == (12.5, 4.0, 0.75)
