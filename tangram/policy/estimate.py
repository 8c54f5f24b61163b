"""The ACT approximation (paper Algorithm 2): how long the actions still waiting for a pool take.

Greedy eviction compares, for each prefix of the candidates it keeps, the
DPArrange optimum plus this estimate of the look-ahead's completion times:
each waiting action starts, in queue order, when the completion heap has
released enough units; the first ``depth - 1`` scalable ones try several
counts (a bounded search), later scalable ones take the count that ends them
soonest, fixed ones their minimum.
"""
from __future__ import annotations

import heapq
import math

from tangram.core.model import Action
from tangram.policy.rows import duration as _duration
from tangram.policy.rows import explored_options as _explored_options
from tangram.policy.rows import row as _row
from tangram.policy.snapshot import PoolState, Snapshot


def waiter(a: Action, pool: PoolState, snap: Snapshot):
    """``(min units, duration at min, options to explore)`` of a waiting action.

    The options, ``((units, duration), ...)``, are None for an action the
    look-ahead does not explore (not scalable on this pool). Those of a
    scalable action depend only on it and the pool's type and capacity:
    kept in its row's memo.
    """
    demand = a.demands.get(pool.rtype)
    if demand is None:
        return None
    if not (a.key == pool.rtype and a.t1_s is not None and a.elasticity is not None):  # a.scalable on this pool
        return demand.min, _duration(a, demand.min, snap), None
    r = _row(a)
    hit = r.waiter
    if hit is not None and hit[0] == pool.rtype and hit[1] == pool.capacity:
        return hit[2]
    options = _explored_options(r.options, pool.capacity)
    w = demand.min, _duration(a, demand.min, snap), tuple((u, a.duration(u)) for u in options)
    r.waiter = (pool.rtype, pool.capacity, w)
    return w


def estimate_rest(heap_items, free_units: int, waiters: list, explore: int) -> float:
    """Algorithm 2: ACT estimate of the actions still waiting for this pool.

    Each starts, in queue order, when the completion heap has released enough
    units; the first ``depth - 1`` scalable ones try several counts (a bounded
    search, see _explored_options), later scalable ones take their
    earliest-finishing count, fixed ones their minimum.
    """
    return estimate_from(completions(heap_items), free_units, waiters, explore)


def completions(items) -> list:
    """``(seconds left, units)`` pairs as the estimate reads them: what is overdue ends now."""
    return [(f if f > 0.0 else 0.0, u) for f, u in items]


def estimate_from(heap: list, free_units: int, waiters: list, explore: int) -> float:
    """:func:`estimate_rest` of pairs already passed through :func:`completions` (the list
    becomes the estimate's heap: the caller hands over a fresh one)."""
    heapq.heapify(heap)
    return _walk(heap, free_units, 0.0, waiters, 0, explore)


def _walk(heap, free, now, waiters, i, explore) -> float:
    total = 0.0
    push, pop = heapq.heappush, heapq.heappop
    n = len(waiters)
    if explore > 0:
        while i < n:
            umin, dmin, options = waiters[i]
            if options is not None:
                best = math.inf
                for u, d in options:
                    h = heap[:]
                    f, t = _start_time(h, free, now, u)
                    end = t + d
                    push(h, (end, u))
                    rest = end + _walk(h, f - u, t, waiters, i + 1, explore - 1)
                    if rest < best:
                        best = rest
                return total + best
            free, now = _start_time(heap, free, now, umin)
            total += now + dmin
            push(heap, (now + dmin, umin))
            free -= umin
            i += 1
        return total
    # nothing left to explore (the estimate's hot loop): a fixed waiter takes its
    # minimum; an elastic one the count that ends it soonest, as a round would give
    # it on its own (its minimum made "wait for many units" look worse than "start
    # now on one" whenever a node was briefly full)
    for umin, dmin, options in (waiters[i:] if i else waiters):
        if options is not None and len(options) > 1:
            umin, dmin = _earliest_finish(heap, free, now, options)
        while free < umin:  # _start_time, inlined
            if not heap:
                free = umin
                break
            t, u = pop(heap)
            free += u
            if t > now:
                now = t
        end = now + dmin
        total += end
        push(heap, (end, umin))
        free -= umin
    return total


def _earliest_finish(heap, free, now, options):
    """The ``(units, duration)`` among ``options`` (ascending units) whose start, when
    the completions in ``heap`` have freed its units, plus duration is smallest.
    Reads the heap only."""
    ends = sorted(heap)
    best, best_end, k, n = options[0], math.inf, 0, len(ends)
    for u, d in options:
        while free < u:
            if k == n:  # as _start_time: units the estimate does not know of are free
                free = u
                break
            t, got = ends[k]
            free += got
            if t > now:
                now = t
            k += 1
        if now + d < best_end:
            best, best_end = (u, d), now + d
    return best


def _start_time(heap, free, now, units):
    """Pop completions until ``units`` are free; returns (free, start time).

    An empty heap with too few units means the pool's accounting is not all
    known to the estimate (units held outside the engine): assume they are
    free rather than waiting forever.
    """
    while free < units:
        if not heap:
            return units, now
        t, u = heapq.heappop(heap)
        free += u
        if t > now:
            now = t
    return free, now
