"""Elastic allocation per key pool (steps 2 and 3 of a round, DESIGN.md §4).

The scalable candidates are grouped by key pool; each group gets its units from the
DPArrange prefix table, or greedy eviction with the ACT approximation (Algorithm 2,
estimate.py) keeps a prefix and makes the rest wait. A group a round made wait in full is
a holdout: not searched again until one of its inputs changes (docs/scheduling.md).
"""
from __future__ import annotations

from bisect import insort
from typing import Sequence

from tangram.core.errors import invariant
from tangram.policy.arrange import CHUNK_SIZES, ChunkOperator, UnitsOperator, pack_one, prefix_table_rows
from tangram.policy.estimate import Arrivals as _Arrivals
from tangram.policy.estimate import arrivals as _arrivals
from tangram.policy.estimate import completions as _completions
from tangram.policy.estimate import estimate_sorted as _estimate_sorted
from tangram.policy.estimate import floor as _estimate_floor
from tangram.policy.estimate import waiter as _waiter
from tangram.policy.rows import group_rows as _group_rows
from tangram.policy.rows import run_estimate
from tangram.policy.snapshot import PoolState, Snapshot, running_ids, upcoming_inputs

_EPS = 1e-9
# greedy eviction rarely evicts many; the DP is pruned for the last few prefixes first
_EVICTION_WINDOW = 8


def elastic_allocation(snap: Snapshot, cands: list, lookahead) -> tuple[dict[str, tuple], frozenset[str]]:
    """Arrange each key pool's elastic group; returns the holdouts (pool -> inputs of a group made
    to wait) and the action classes whose class estimate their inputs read (Plan.holdout_classes).

    ``cands``: the round's candidates (``action``, ``pools`` by resource type, ``units``,
    ``hits``, ``slot``: its index in ``cands``); a kept one's key units are set here, an evicted
    one is replaced by None in place.
    """
    if snap.params.fixed_dop is not None:
        return {}, frozenset()  # the fixed-DoP baseline: FCFS at N units, no eviction
    groups: dict[str, list] = {}
    users: dict[str, list[int]] = {}  # pool -> indices of the candidates taking units of it
    for i, c in enumerate(cands):
        if c.group is not None:
            groups.setdefault(c.group, []).append(c)
        for pname in c.pools.values():
            users.setdefault(pname, []).append(i)
    holdouts = {}
    classes: set[str] = set()
    # GPU groups first: a CPU group reads the other candidates on its pool at the units they will
    # run at, and a GPU group may still change those of an action elastic on GPUs (a holdout's
    # inputs assume the others run next round as this round read them)
    held = []
    for pname, group in sorted(groups.items(), key=lambda g: not snap.pools[g[0]].chunked):
        inputs = _arrange_group(snap, snap.pools[pname], group, cands, users[pname], lookahead.get(pname, ()))
        if inputs is not None:
            held.append((pname, inputs))
    for pname, (inputs, keyed) in held:
        # a later group gave one of its other candidates other units (an action elastic on another
        # pool): those run for another time than the decision read, so the group is re-decided
        if all(c.units[c.action.key] == u for c, u in keyed):
            holdouts[pname] = inputs
            classes.update(cls for cls, _ in inputs[-1])
    return holdouts, frozenset(classes)


def _holdout_inputs(snap: Snapshot, pool: PoolState, capacity: int, group, others, waiting_after) -> tuple:
    """Everything a CPU group's decision reads but the clock (docs/scheduling.md, "Holdouts").

    The other candidates start this round: next round they are running for the time the search
    read (their dispatches' estimates), the same inputs. The last entry, the class estimates read
    (the durations of unprofiled actions in the look-ahead and the arrivals), is also read by
    elastic_allocation."""
    upcoming = ()
    if pool.node is not None and snap.params.expect_arrivals and snap.upcoming:
        upcoming = upcoming_inputs(snap.upcoming, pool.node)
    # not the other candidates' classes: next round they run, for the time their dispatches' estimates
    # said (the running ids below), whatever their class estimate says by then
    read = [a for a in waiting_after if a.t1_s is None and pool.rtype in a.demands]
    if upcoming:
        read += [a for _, a in upcoming[1] if a.t1_s is None]
    estimates = snap.class_estimates
    default = snap.params.default_duration_s
    return (
        capacity, pool.capacity, snap.params,
        tuple([c.action.id for c in group]), tuple(waiting_after),  # the queue's own action objects
        # a set: the engine starts this round's dispatches in its own order
        frozenset(running_ids(snap.running, pool.name)).union([c.action.id for c in others]),
        upcoming,
        tuple([(cls, estimates.get(cls, default)) for cls in sorted({a.action_class for a in read})]),
    )


def _arrange_group(snap, pool: PoolState, group, cands, users, waiting_after) -> tuple | None:
    """Give ``group`` its units, or evict a suffix of it; returns the group's inputs and its others'
    elastic units (_keyed) when all of it waits.

    A group the previous round made wait in full, on a pool none of whose inputs changed since
    (_holdout_inputs), waits again without the search (see docs/scheduling.md, "Holdouts"):
    what moves meanwhile is only the clock.
    """
    # ``users``: indices of the candidates on this pool (an earlier group's evicted ones are None now)
    name = pool.name
    others = [c for i in users if (c := cands[i]) is not None and c.group != name]
    other_units = [c.units[_rtype_of(c, pool.name)] for c in others]
    inputs = None
    if pool.chunked:
        rest = _chunks_left(pool.chunks, other_units)
        operator = ChunkOperator(rest)
        capacity = sum(rest)
        # a GPU group also reads idle instances and restores: always re-decided
    else:
        capacity = pool.free - sum(other_units)
        operator = UnitsOperator(max(capacity, 0))
        if pool.name in snap.holdouts:
            inputs = _holdout_inputs(snap, pool, capacity, group, others, waiting_after)
            if snap.holdouts[pool.name] == inputs:
                for c in group:
                    cands[c.slot] = None
                return inputs, _keyed(others)
    actions = [c.action for c in group]
    hits = [c.hits for c in group]
    rows, convex = _group_rows(actions, capacity, snap.params, pool, hits)
    if pool.chunked:
        convex = None
    n = len(group)

    seed = list(snap.running.get(pool.name, ()))
    # the others at what their dispatches will say (their units, a GPU miss's restore): next round they run so
    seed += [(run_estimate(c.action, c.units, c.hits, snap), u) for c, u in zip(others, other_units)]
    seed = _completions(seed)  # the candidates' durations below are positive: nothing to clamp
    seed.sort()  # once: each prefix's estimate then sorts this run plus its candidates' ends
    tail = [w for a in waiting_after if (w := _waiter(a, pool, snap)) is not None]
    evicted: list = []  # waiters of group[t:], built as eviction goes deeper (it rarely does)

    def waiters(t: int) -> list:
        while n - len(evicted) > t:
            evicted.insert(0, _waiter(group[n - len(evicted) - 1].action, pool, snap))
        return evicted[len(evicted) - (n - t):] + tail

    expected = _arrivals(snap, pool)
    arrivals = _Arrivals(expected) if expected else ()  # prepared once for every estimate below
    tables: list = []
    best = _evict(snap, rows, operator, convex, n, capacity, seed, waiters, arrivals, group, tables=tables)
    need = arrivals.units_before[-1] if arrivals else 0
    if arrivals and best is not None and (best[1] < n or capacity - sum(best[2]) < need):
        # Headroom: the group may leave part of the pool to the actions the node's
        # trajectories in generation are about to submit; the estimate says how much.
        # (When the whole group starts and leaves room for them all, less for it cannot help.)
        floor = _estimate_floor(tail, arrivals)  # under any estimate of this group's
        whole = _below_any_headroom(tables[0], n)
        for h in sorted({need, need // 2, need // 4}, reverse=True):
            if not 0 < h < capacity:
                continue
            # the whole group on less: headroom is the alternative to evicting (waiting); one whose
            # arrangement alone, plus the floor, is no better than the best so far is not estimated
            # (nor built, when the arrangement on all of the capacity already is not)
            unless_above = best[0] - _EPS - floor
            if whole >= unless_above:
                continue
            rows_h, convex_h = _group_rows(actions, capacity - h, snap.params, pool, hits)
            b = _evict(snap, rows_h, UnitsOperator(capacity - h), convex_h, n, capacity, seed, waiters, arrivals,
                       group, lowest=n, unless_above=unless_above)
            if b is not None and (best is None or b[0] < best[0] - _EPS):
                best = b
    if best is None:  # cannot happen when minimums fit; keep minimums
        return None
    _, t, units = best
    for i, c in enumerate(group):
        if i < t:
            c.units[c.action.key] = units[i]
        else:
            cands[c.slot] = None  # evicted: keeps its queue position
    if t > 0 or pool.chunked:
        return None
    return inputs or _holdout_inputs(snap, pool, capacity, group, others, waiting_after), _keyed(others)


def _below_any_headroom(table, n: int) -> float:
    """A lower bound of the whole group's arrangement on any part of the capacity, from its table
    on all of it: on less it has a subset of the same allocations (its rows cut to fewer units),
    so its optimum is no lower. Lowered by a relative 1e-9: two tables may round a sum apart."""
    return table.best(n) * (1.0 - 1e-9)


def _keyed(others) -> list:
    """The other candidates elastic on another pool, with the units of it the decision read."""
    return [(c, c.units[c.action.key]) for c in others if c.action.key is not None and c.action.key in c.units]


def _evict(snap, rows, operator, convex, n, capacity, seed, waiters, arrivals, group, lowest=0, unless_above=None,
           tables=None):
    """Greedy eviction over the DPArrange prefix table of ``rows`` under ``operator``: the best
    ``(objective, prefix kept, its units)`` among the prefixes of ``lowest`` or more, or None.
    ``capacity`` is the pool's part the estimate counts as free (the operator's may be
    smaller: headroom). ``unless_above`` (the whole group only, ``lowest == n``): None, without
    an estimate, when the arrangement's own objective is that or more."""
    exact_from = max(1, n - _EVICTION_WINDOW)
    table = prefix_table_rows(rows, operator, max(exact_from, lowest), convex, clipped=True)
    if tables is not None:
        tables.append(table)
    if unless_above is not None:
        invariant(lowest == n, "a bound on the whole group's objective only")
        if not table.feasible(n) or table.best(n) >= unless_above:
            return None
    depth = snap.params.depth - 1
    best = None
    # Evicting the whole group (t = 0: wait) is allowed only while something
    # holds units of this pool: its completion is the event that reschedules.
    # A lone elastic action then may wait a moment for many cores instead of
    # starting at once on the few that happen to be free.
    last = max(lowest, 0 if seed else 1)
    for t in range(n, last - 1, -1):
        if t == 0:
            obj = _estimate_sorted(list(seed), capacity, waiters(0), depth, arrivals)
            if best is None or obj < best[0] - _EPS:
                best = (obj, 0, ())
            break
        if t < table.exact_from:  # eviction went deeper than the pruned table is exact for
            table = prefix_table_rows(rows, operator, 1, convex, clipped=True)
        if not table.feasible(t):
            continue
        units, durs = table.units_and_durations(t)
        if durs is None:
            durs = [group[i].action.duration(u) for i, u in enumerate(units)]
        rest = waiters(t)
        # nothing waits or comes: the estimate is 0 (the walk would only sort the completions)
        obj = table.best(t) + (_estimate_sorted(
            _with_ends(seed, durs, units),
            capacity - sum(units),
            rest,
            depth,
            arrivals,
        ) if rest or arrivals else 0.0)
        if best is None or obj < best[0] - _EPS:
            best = (obj, t, units)
        else:
            break  # evicting one more did not lower the objective
    return best


def _with_ends(seed: list, durs, units) -> list:
    """The sorted ``seed`` with the kept candidates' ``(duration, units)`` inserted in order."""
    ends = list(seed)
    if len(durs) > 8:
        ends += zip(durs, units)
        ends.sort()
        return ends
    for end in zip(durs, units):
        insort(ends, end)
    return ends


def _rtype_of(c, pname: str) -> str:
    for t, p in c.pools.items():
        if p == pname:
            return t
    raise KeyError(pname)


def _chunks_left(free_chunks: Sequence[int], taken: Sequence[int]) -> tuple[int, ...]:
    avail = {s: 0 for s in CHUNK_SIZES}
    for c in free_chunks:
        avail[c] += 1
    for r in sorted(taken, reverse=True):
        pack_one(avail, r)
    return tuple(s for s in CHUNK_SIZES for _ in range(avail[s]))
