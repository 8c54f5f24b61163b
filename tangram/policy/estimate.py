"""The ACT approximation of the actions still waiting for a pool (paper Algorithm 2).

Pure functions over a completion heap: each waiting action gets its minimum
and starts, in queue order, when the heap has released enough units; the
first ``depth - 1`` scalable ones try several counts instead.
"""
from __future__ import annotations

import heapq
import math
from functools import lru_cache


@lru_cache(maxsize=4096)
def explored_options(options: tuple[int, ...], cap: int) -> tuple[int, ...]:
    """The counts the look-ahead tries for one waiting action (depth > 1).

    The minimum, the powers of two and the largest feasible count: a
    geometric subset keeps the bounded search cheap on 256-core nodes while
    still seeing "wait for many cores" against "start now on few".
    """
    feasible = [o for o in options if o <= cap]
    if len(feasible) <= 8:
        return tuple(feasible)
    keep = {feasible[0], feasible[-1]}
    keep.update(o for o in feasible if o & (o - 1) == 0)
    return tuple(sorted(keep))


def estimate_rest(heap_items, free_units: int, waiters: list, explore: int) -> float:
    """Algorithm 2: ACT estimate of the actions still waiting for this pool.

    Each gets its minimum and starts, in queue order, when the completion heap
    has released enough units; the first ``depth - 1`` scalable ones try
    several counts instead (a bounded search, see _explored_options).
    """
    heap = [(f if f > 0.0 else 0.0, u) for f, u in heap_items]
    heapq.heapify(heap)
    return _walk(heap, free_units, 0.0, waiters, 0, explore)


def _walk(heap, free, now, waiters, i, explore) -> float:
    total = 0.0
    push, pop = heapq.heappush, heapq.heappop
    n = len(waiters)
    while i < n:
        umin, dmin, action, options = waiters[i]
        if explore > 0 and action is not None:
            best = math.inf
            for u in options:
                h = list(heap)
                f, t = _start_time(h, free, now, u)
                end = t + action.duration(u)
                push(h, (end, u))
                best = min(best, end + _walk(h, f - u, t, waiters, i + 1, explore - 1))
            return total + best
        while free < umin:  # _start_time, inlined: this loop is the estimate's hot path
            if not heap:
                free = umin
                break
            t, u = pop(heap)
            free += u
            if t > now:
                now = t
        total += now + dmin
        push(heap, (now + dmin, umin))
        free -= umin
        i += 1
    return total


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
