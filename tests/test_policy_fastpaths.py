"""The policy's fast paths agree with their plain reference versions on random inputs.

A round reads per-action memos (rows, waiters, demands) and walks the ACT
estimate with a specialised loop; each is checked here against the direct
computation it replaces, and whole rounds against rounds with cold memos.
"""
from __future__ import annotations

import heapq
import math
import random
from dataclasses import replace
from functools import partial

import numpy as np
import pytest

from tangram.core.model import Action, Elasticity
from tangram.core.pools import pool_name
from tangram.policy import estimate, needs, rows, schedule
from tangram.policy.schedule import plan
from tangram.policy.snapshot import PolicyParams, PoolState, Snapshot
from tests.helpers import make_engine, make_node

CHUNKS = [(8,), (4, 4), (4, 2, 1, 1), (2, 2, 1), (1,), (), (4,), (2, 1)]


def _elasticity(rng: random.Random) -> Elasticity:
    if rng.random() < 0.6:
        return Elasticity.amdahl(rng.choice([0.0, rng.uniform(0.0, 0.5), 0.95]))
    table, e = {}, 1.0
    for m in sorted(rng.sample(range(1, 17), rng.randint(1, 5))):  # measured tables need not be convex
        e = max(0.05, min(1.0, e * rng.uniform(0.6, 1.05)))
        table[m] = e if m > 1 else 1.0
    return Elasticity.from_table(table)


def _action(rng: random.Random, i: int, pools, trajectories) -> Action:
    kw = {}
    if rng.random() < 0.5:
        kw = {"trajectory": rng.choice(trajectories), "mem_mb": rng.choice([0, 1024, 8192])}
    cls = f"c{rng.randint(0, 3)}"
    k = rng.random()
    if k < 0.45:
        lo = rng.randint(1, 4)
        demands = {"cpu": {"min": lo, "max": lo + rng.randint(0, 20)}}
        apis = [p for p in pools if p.startswith("api:")]
        if apis and rng.random() < 0.1:
            demands[rng.choice(apis)] = 1
        return Action.build(f"a{i}", demands, t1_s=rng.uniform(0.5, 100), elasticity=_elasticity(rng),
                            action_class=cls, **kw)
    if k < 0.6:
        return Action.build(f"a{i}", {"cpu": rng.randint(1, 4)}, t1_s=rng.choice([None, rng.uniform(0.1, 5)]),
                            action_class=cls, **kw)
    if k < 0.75:
        return Action.build(f"a{i}", {rng.choice(["api:search", "api:llm", "api:other"]): 1},
                            t1_s=rng.choice([None, 1.0]), action_class=cls)
    opts = sorted(rng.sample([1, 2, 4, 8], rng.randint(1, 4)))
    service = rng.choice([None, "m1", "m2"])
    restore = {o: rng.uniform(0, 5) for o in opts} if service and rng.random() < 0.5 else None
    return Action.build(f"a{i}", {"gpu": opts}, t1_s=rng.uniform(0.5, 50), elasticity=_elasticity(rng),
                        action_class=cls, service=service, restore_s=restore)


def _snapshot(seed: int) -> Snapshot:
    """A random round: 1-3 nodes (cores, memory, sometimes GPUs in buddy chunks), API pools,
    running actions, placed and unplaced trajectories, every knob of the policy."""
    rng = random.Random(seed)
    nodes = tuple(f"n{i}" for i in range(rng.randint(1, 3)))
    pools, running = {}, {}
    for n in nodes:
        cap = rng.choice([4, 8, 16, 32, 64])
        free = rng.randint(0, cap)
        pools[f"cpu@{n}"] = PoolState(f"cpu@{n}", "cpu", n, cap, free)
        if cap > free and rng.random() < 0.8:
            left, held = cap - free, []
            while left > 0:
                u = rng.randint(1, left)
                left -= u
                held.append((rng.uniform(0, 30), u))
            running[f"cpu@{n}"] = tuple(held)
        mem = rng.choice([8192, 32768, 1 << 20])
        pools[f"mem@{n}"] = PoolState(f"mem@{n}", "mem", n, mem, rng.randint(0, mem))
        if rng.random() < 0.5:
            chunks = rng.choice(CHUNKS)
            resident = frozenset(rng.sample(["m1@dop1", "m1@dop2", "m2@dop4", "m2@dop8"], rng.randint(0, 2)))
            pools[f"gpu@{n}"] = PoolState(f"gpu@{n}", "gpu", n, 8, sum(chunks), chunks=tuple(sorted(chunks)),
                                          resident=resident)
            if sum(chunks) < 8 and rng.random() < 0.5:
                running[f"gpu@{n}"] = ((rng.uniform(0, 20), 8 - sum(chunks)),)
    for api in ("api:search", "api:llm")[: rng.randint(0, 2)]:
        cap = rng.randint(1, 6)
        pools[api] = PoolState(api, api, None, cap, rng.randint(0, cap))
    trajectories = [f"t{i}" for i in range(rng.randint(1, 8))]
    placement = {t: rng.choice(nodes) for t in trajectories if rng.random() < 0.4}
    waiting = tuple(_action(rng, i, pools, trajectories) for i in range(rng.randint(0, 60)))
    params = PolicyParams(depth=rng.choice([1, 2, 2, 3]), lookahead=rng.choice([0, 4, 32]),
                          dop_caps={"c1": rng.randint(1, 8)} if rng.random() < 0.3 else {},
                          fixed_dop=rng.choice([None] * 6 + [2, 4]))
    estimates = {f"c{j}": rng.uniform(0.1, 10) for j in range(4) if rng.random() < 0.5}
    return Snapshot(pools=pools, nodes=nodes, waiting=waiting, running=running, placement=placement,
                    class_estimates=estimates, params=params)


def _digest(p) -> tuple:
    return (tuple((d.action.id, d.node, sorted(d.units.items()), sorted(d.pools.items()), d.place_mem_mb,
                   d.estimated_s) for d in p.dispatches), sorted(p.unfit.items()))


def _cold(snap: Snapshot) -> tuple:
    rows._ROWS.clear()
    needs._NEEDS.clear()
    return _digest(plan(replace(snap, waiting=tuple(replace(a) for a in snap.waiting))))


@pytest.mark.parametrize("seed", range(6))
def test_rounds_with_cold_and_warm_memos_agree(seed):
    """The memos are keyed by action: fresh copies of the same actions plan the same,
    and so do the same actions in a round whose pools have other capacities."""
    for k in range(60):
        snap = _snapshot(1000 * seed + k)
        warm = _digest(plan(snap))
        assert _digest(plan(snap)) == warm  # memos filled by the first call
        assert _cold(snap) == warm
        plan(snap)
        resized = replace(snap, pools={n: replace(p, capacity=p.capacity * 2, free=p.free * 2) if p.chunks is None else p
                                       for n, p in snap.pools.items()})
        assert _digest(plan(resized)) == _cold(resized)


# --------------------------------------------------------------------------- #
# the ACT estimate against the plain walk it specialises


def _reference_rest(heap_items, free, waiters, explore) -> float:
    """The estimate as first written: one loop, each waiter's durations from its model."""
    heap = [(f if f > 0.0 else 0.0, u) for f, u in heap_items]
    heapq.heapify(heap)

    def start(h, free, now, units):
        while free < units:
            if not h:
                return units, now
            t, u = heapq.heappop(h)
            free += u
            now = max(now, t)
        return free, now

    def walk(h, free, now, i, explore):
        total = 0.0
        while i < len(waiters):
            umin, dmin, action, options = waiters[i]
            if explore > 0 and action is not None:
                best = math.inf
                for u in options:
                    h2 = list(h)
                    f, t = start(h2, free, now, u)
                    end = t + action.duration(u)
                    heapq.heappush(h2, (end, u))
                    best = min(best, end + walk(h2, f - u, t, i + 1, explore - 1))
                return total + best
            if action is not None and len(options) > 1:
                # beyond the search: the count that ends it soonest, the smallest on a tie
                def end_at(u):
                    return start(list(h), free, now, u)[1] + action.duration(u)
                umin = min(options, key=lambda u: (end_at(u), u))
                dmin = action.duration(umin)
            free, now = start(h, free, now, umin)
            total += now + dmin
            heapq.heappush(h, (now + dmin, umin))
            free -= umin
            i += 1
        return total

    return walk(heap, free, 0.0, 0, explore)


@pytest.mark.parametrize("seed", range(6))
def test_estimate_matches_the_plain_walk(seed):
    rng = random.Random(500 + seed)
    for _ in range(120):
        cap = rng.choice([4, 16, 64])
        pool = PoolState("cpu@n0", "cpu", "n0", cap, rng.randint(0, cap))
        snap = Snapshot(pools={pool.name: pool}, nodes=("n0",), waiting=(),
                        class_estimates={"c0": rng.uniform(0.1, 5)})
        acts = [_action(rng, i, {}, ["t0"]) for i in range(rng.choice([rng.randint(0, 3), rng.randint(0, 40)]))]
        fast = [w for a in acts if (w := estimate.waiter(a, pool, snap)) is not None]
        plain = []
        for a in acts:
            d = a.demands.get("cpu")
            if d is None:
                continue
            explored = a.scalable and a.key == "cpu"
            options = rows.explored_options(rows.worthwhile_options(a), cap) if explored else ()
            plain.append((d.min, rows.duration(a, d.min, snap), a if explored else None, options))
        assert [w[:2] for w in fast] == [w[:2] for w in plain]
        heap = [(rng.uniform(-1, 40), rng.randint(1, 8)) for _ in range(rng.randint(0, 30))]
        free = rng.randint(0, cap)
        for explore in range(3):
            assert estimate.estimate_rest(heap, free, fast, explore) == _reference_rest(heap, free, plain, explore)


@pytest.mark.parametrize("seed", range(4))
def test_option_rows_match_the_cut_full_row(seed):
    """The shared full row when nothing caps it; otherwise the prefix up to the cap, with restores."""
    rng = random.Random(700 + seed)
    for i in range(200):
        a = _action(rng, i, {}, ["t0"])
        if not a.scalable:
            continue
        units, durs = rows.full_row(a)
        cap = rng.randint(1, 24)
        params = PolicyParams(dop_caps={a.action_class: rng.randint(1, 8)} if rng.random() < 0.4 else {})
        chunked = a.key == "gpu"
        pool = PoolState("p", a.key, "n0", 8, 8, chunks=(8,) if chunked else None,
                         resident=frozenset({"m1@dop2"}) if rng.random() < 0.5 else frozenset())
        limit = cap
        if a.action_class in params.dop_caps:
            limit = min(limit, max(params.dop_caps[a.action_class], int(units[0])))
        k = int(np.searchsorted(units, limit, side="right"))
        want_u, want_d = units[:k], durs[:k]
        if a.restore_s and a.service is not None and chunked:
            want_d = want_d + np.array([0.0 if f"{a.service}@dop{u}" in pool.resident else a.restore_s.get(int(u), 0.0)
                                        for u in want_u])
        got_u, got_d = rows.option_row(a, cap, params, pool)
        assert got_u.tolist() == want_u.tolist() and got_d.tolist() == want_d.tolist()


def test_estimate_takes_an_elastic_waiter_whose_every_count_ends_at_infinity():
    """A completion at +inf (the engine's running view of an action without a finite estimate):
    every count of the waiter behind it ends at inf; the estimate still picks one (the smallest),
    as the plain walk does, instead of failing or reusing another waiter's choice."""
    cap = 8
    pool = PoolState("cpu@n0", "cpu", "n0", cap, 1)
    acts = [Action.build(f"w{i}", {"cpu": {"min": 1, "max": 4}}, t1_s=10.0, elasticity=Elasticity.amdahl(0.1))
            for i in range(8)]
    snap = Snapshot(pools={pool.name: pool}, nodes=("n0",), waiting=tuple(acts),
                    running={pool.name: ((math.inf, 7),)})
    fast = [estimate.waiter(a, pool, snap) for a in acts]
    plain = [(1, a.duration(1), a, rows.explored_options(rows.worthwhile_options(a), cap)) for a in acts]
    for explore in range(3):
        for held, free in (((math.inf, 7),), 1), (((math.inf, 8),), 0):
            got = estimate.estimate_rest(list(held), free, fast, explore)
            assert got == _reference_rest(list(held), free, plain, explore)
            assert (got == math.inf) == (free == 0)
    p = plan(snap)  # one unit free: the head starts on it, the rest wait behind the unending holder
    assert [d.action.id for d in p.dispatches] == ["w0"]
    assert p.dispatches[0].units["cpu"] == 1


def test_a_duration_that_overflows_is_refused_at_build():
    from tangram.core.errors import DemandError

    with pytest.raises(DemandError) as e:
        Action.build("x", {"cpu": {"min": 1, "max": 4}}, t1_s=1e308, elasticity=Elasticity.from_table({1: 0.1}))
    assert e.value.field == "t1_s" and "overflows" in str(e.value)
    ok = Action.build("y", {"cpu": {"min": 1, "max": 4}}, t1_s=1e300, elasticity=Elasticity.from_table({1: 0.1}))
    assert math.isfinite(ok.duration(1))


def test_new_dispatch_builds_the_same_frozen_dispatch():
    """The policy's constructor sets every field of Dispatch, and the object stays frozen."""
    import dataclasses
    from types import MappingProxyType

    from tangram.policy.snapshot import Dispatch, new_dispatch

    a = Action.build("d", {"cpu": {"min": 2, "max": 8}}, t1_s=4.0, elasticity=Elasticity.amdahl(0.1))
    args = (a, "n1", MappingProxyType({"cpu": 4}), MappingProxyType({"cpu": "cpu@n1"}), 512, 1.25)
    fast, slow = new_dispatch(*args), Dispatch(*args)
    assert fast == slow and repr(fast) == repr(slow) and type(fast) is Dispatch
    assert [getattr(fast, f.name) for f in dataclasses.fields(Dispatch)] == list(args)  # a new field fails here
    assert fast.dop == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.node = "n2"


@pytest.mark.parametrize("seed", range(3))
def test_needs_match_their_definition(seed):
    """The single-demand fast path of Needs gives the fields the general definition gives."""
    rng = random.Random(900 + seed)
    pools = ["cpu@n0", "gpu@n0", "api:search", "api:llm"]
    for i in range(300):
        a = _action(rng, i, pools, ["t0", "t1"])
        if rng.random() < 0.2:  # a multi-demand action of every kind
            a = Action.build(f"m{i}", {"cpu": 2, "api:llm": 1, "gpu": [1, 2]}, action_class="m")
        nd = needs.Needs(a)
        types = tuple(a.demands)
        assert nd.local == tuple(t for t in types if t in ("cpu", "gpu"))
        assert nd.api == tuple(t for t in types if t not in ("cpu", "gpu"))
        assert nd.not_gpu == tuple(t for t in types if t != "gpu")
        assert (nd.has_cpu, nd.has_gpu, nd.scalable) == ("cpu" in types, "gpu" in types, a.scalable)
        assert nd.mins == {t: d.min for t, d in a.demands.items()}
        assert nd.shape == tuple((t, d.lo, d.hi, d.picks) for t, d in sorted(a.demands.items()))

        for node in ("n0", "n1", None):
            local, by_type = nd.on(node)
            assert by_type == {t: pool_name(t, node) for t in types}
            assert list(by_type) == list(types)  # the order Dispatch.pools reads
            assert local == tuple(pool_name(t, node) for t in nd.local)


def test_needs_on_is_shared_by_actions_of_the_same_types_and_bounded():
    """Actions with the same resource types share one answer per node (built once), other types or
    nodes get their own, and the memo is cleared past its bound without changing an answer."""
    needs._ON.clear()
    a = Action.build("a", {"cpu": 2, "api:llm": 1}, action_class="x")
    b = Action.build("b", {"cpu": {"min": 1, "max": 8}, "api:llm": 3}, action_class="y")
    c = Action.build("c", {"api:llm": 1, "cpu": 2}, action_class="x")  # other order: its own
    na, nb, nc = needs.Needs(a), needs.Needs(b), needs.Needs(c)
    assert na.on("n0") is nb.on("n0")
    assert na.on("n1") is not na.on("n0") and na.on("n1")[1] == {"cpu": "cpu@n1", "api:llm": "api:llm"}
    assert nc.on("n0") is not na.on("n0") and list(nc.on("n0")[1]) == ["api:llm", "cpu"]
    for i in range(65536):
        needs._ON[((f"t{i}",), "n0")] = ((), {})
    before = na.on("n2")  # past the bound: the memo starts over
    assert len(needs._ON) == 1 and before == (("cpu@n2",), {"cpu": "cpu@n2", "api:llm": "api:llm"})


def test_a_snapshot_with_its_nodes_in_a_list_plans_as_with_a_tuple():
    for seed in range(20):
        snap = _snapshot(seed)
        want, got = plan(snap), plan(replace(snap, nodes=list(snap.nodes)))
        assert [(d.action.id, d.node, dict(d.units)) for d in got.dispatches] == [
            (d.action.id, d.node, dict(d.units)) for d in want.dispatches]
        assert dict(got.unfit) == dict(want.unfit)


def _spread_snapshot(seed: int) -> Snapshot:
    """Many nodes (some without free cores or memory, some without a memory pool, some with GPUs;
    now and then a CPU pool in chunks or a node listed twice, where the ranking steps aside) and
    actions free to go to any of them, with memory to place or none: the node ranking's inputs
    (policy/node_rank.py)."""
    rng = random.Random(seed)
    names = [f"n{i}" for i in range(rng.randint(2, 16))]
    pools, running = {}, {}
    for n in names:
        cap = rng.choice([4, 8, 32, 256])
        free = rng.choice([0, 0, 1, rng.randint(0, cap), cap])
        chunks = rng.choice(CHUNKS) if rng.random() < 0.03 else None
        pools[f"cpu@{n}"] = PoolState(f"cpu@{n}", "cpu", n, cap, sum(chunks) if chunks else free, chunks=chunks)
        if free < cap:
            running[f"cpu@{n}"] = ((rng.uniform(0, 30), cap - free),)
        if rng.random() < 0.8:
            mem = rng.choice([8192, 65536])
            pools[f"mem@{n}"] = PoolState(f"mem@{n}", "mem", n, mem, rng.choice([0, 2048, mem // 2, mem]))
        if rng.random() < 0.2:
            chunks = rng.choice(CHUNKS)
            pools[f"gpu@{n}"] = PoolState(f"gpu@{n}", "gpu", n, 8, sum(chunks), chunks=tuple(sorted(chunks)))
    if rng.random() < 0.5:
        pools["api:search"] = PoolState("api:search", "api:search", None, 4, rng.randint(0, 4))
    trajectories = [f"t{i}" for i in range(rng.randint(1, 6))]
    placement = {t: rng.choice(names) for t in trajectories if rng.random() < 0.3}
    waiting = []
    for i in range(rng.randint(1, 120)):
        if rng.random() < 0.6:  # free to go anywhere: the ranking decides
            lo = rng.choice([1, 1, 2, 4, 8])
            demands = {"cpu": {"min": lo, "max": lo + rng.randint(0, 16)} if rng.random() < 0.5 else lo}
            if "api:search" in pools and rng.random() < 0.1:
                demands["api:search"] = 1
            kw = {"mem_mb": rng.choice([0, 0, 1024, 4096, 16384])}
            if rng.random() < 0.3:
                kw["trajectory"] = rng.choice(trajectories)
            waiting.append(Action.build(f"a{i}", demands, t1_s=rng.uniform(0.5, 60), elasticity=_elasticity(rng),
                                        action_class=f"c{rng.randint(0, 3)}", **kw))
        else:
            waiting.append(_action(rng, i, pools, trajectories))
    hostable = {t: tuple(rng.sample(names, rng.randint(1, len(names)))) for t in trajectories
                if t not in placement and rng.random() < 0.3}
    if rng.random() < 0.05:
        names.append(rng.choice(names))  # listed twice
    nodes = names if rng.random() < 0.3 else tuple(names)
    params = PolicyParams(lookahead=rng.choice([0, 4, 32]), fixed_dop=rng.choice([None] * 4 + [1, 4]),
                          order=rng.choice(["fcfs", "aging"]))
    return Snapshot(pools=pools, nodes=nodes, waiting=tuple(waiting), running=running, placement=placement,
                    hostable=hostable, params=params)


def _round_with_lookahead(snap: Snapshot) -> tuple:
    """The plan, and what candidate selection alone returns (candidates, look-ahead, unfit)."""
    cands, lookahead, unfit = schedule._select_candidates(snap)
    p = plan(snap)
    return (_digest(p), sorted(p.holdouts.items()),
            [(c.action.id, c.node, sorted(c.units.items()), c.place_mem) for c in cands],
            sorted((k, [a.id for a in v]) for k, v in lookahead.items()), sorted(unfit.items()))


@pytest.mark.parametrize("seed", range(4))
def test_the_node_ranking_picks_what_a_scan_of_every_node_picks(seed, monkeypatch):
    """An action free to go anywhere takes the first node in rank order that fits it instead of
    asking every node; the rounds are the same as with the scan, and so is everything selection
    records on the way (the look-ahead, and the pools it closes and reports as unfit): with memory
    to place or none, next to nodes listed twice or CPU pools in chunks (where it steps aside)."""
    ranked_calls = []
    ranked_fit = schedule._ranked_fit
    monkeypatch.setattr(schedule, "_ranked_fit", lambda *a: ranked_calls.append(1) or ranked_fit(*a))
    for k in range(80):
        snap = _spread_snapshot(1000 * seed + k)
        with_rank = _round_with_lookahead(snap)
        with monkeypatch.context() as m:
            m.setattr(schedule, "NodeRank", lambda *a: None)  # every node asked, as before the ranking
            assert _round_with_lookahead(snap) == with_rank, k
    assert len(ranked_calls) > 500  # the ranking did decide


# --------------------------------------------------------------------------- #
# the memos hold waiting actions only (policy/memo.py)


def _elastic(i: int) -> Action:
    return Action.build(f"e{i}", {"cpu": {"min": 1, "max": 8}}, t1_s=4.0, elasticity=Elasticity.amdahl(0.1))


def test_a_memo_entry_goes_when_its_action_is_freed():
    a = _elastic(0)
    key = id(a)
    nd, r = needs.needs(a), rows.row(a)
    assert needs.needs(a) is nd and rows.row(a) is r  # kept while the action lives
    assert needs._NEEDS[key] is nd and rows._ROWS[key] is r
    del a  # nothing else holds it: freed now, and its entries with it
    assert key not in needs._NEEDS and key not in rows._ROWS


def test_an_entry_goes_with_its_action_after_a_memo_restart():
    """An entry from before the memo restarted, still held elsewhere, and the one after it: the
    action's death removes its current entry either way."""
    a = _elastic(1)
    first = needs.needs(a)
    needs._NEEDS.clear()  # what the backstop bound does
    second = needs.needs(a)
    assert second is not first and needs._NEEDS[id(a)] is second
    key = id(a)
    del a
    assert key not in needs._NEEDS and first.ref() is None and second.ref() is None


def test_the_removal_callback_runs_no_python_code():
    """Lookups trust that no entry outlives its action; the callback that removes it is the memo's own
    dict.pop bound to the key, so no signal handler or exception can cut it short."""
    a = _elastic(3)
    for table, entry in ((needs._NEEDS, needs.needs(a)), (rows._ROWS, rows.row(a))):
        callback = entry.ref.__callback__
        assert isinstance(callback, partial) and callback.func == table.pop and callback.args == (id(a),)


def test_an_engine_keeps_memo_entries_of_waiting_actions_only():
    """A service keeps many finished records (and their actions) alive: the memos must not. An entry
    is built when a round reads a waiting action and goes when it is dispatched."""
    needs._NEEDS.clear()
    rows._ROWS.clear()
    eng, clock = make_engine(make_node(cores=8))
    actions = [_elastic(i) for i in range(40)]
    started = []
    for a in actions:
        started += eng.submit(a)
    assert started and eng.waiting  # 8 cores: some start, most wait
    read_waiting = 0  # rounds after which a waiting action had its entries
    for _ in range(len(actions) + 1):  # bounded: an engine that left actions waiting fails, not hangs
        if not (started or eng.waiting):
            break
        assert not any(id(s.record.action) in needs._NEEDS or id(s.record.action) in rows._ROWS for s in started)
        read_waiting += any(id(a) in needs._NEEDS and id(a) in rows._ROWS for a in actions if a.id in eng.waiting)
        clock.advance(1.0)
        done, started = started, []
        for s in done:
            started += eng.complete(s.record.action.id)
    assert not (started or eng.waiting)
    assert read_waiting  # the memos did serve waiting actions
    assert len(eng.finished) == len(actions)  # every action is still alive in its record
    assert not any(id(a) in needs._NEEDS or id(a) in rows._ROWS for a in actions)


def test_an_action_leaving_the_queue_unstarted_takes_its_memo_entries():
    """Cancelled while waiting (or failed there): its record is kept, its memo entries are not."""
    eng, clock = make_engine(make_node(cores=8))
    actions = [_elastic(i) for i in range(6)]
    for a in actions:
        eng.submit(a)
    waiting = [a for a in actions if a.id in eng.waiting]
    assert waiting
    for a in waiting:  # the policy's entries, as a round that read them would leave them
        needs.needs(a), rows.row(a)
    for a in waiting:
        eng.cancel(a.id)
    assert all(eng.record(a.id).state == "cancelled" for a in waiting)
    assert not any(id(a) in needs._NEEDS or id(a) in rows._ROWS for a in waiting)
