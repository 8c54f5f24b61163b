"""The ACT estimate's hot loops (:mod:`tangram.policy.estimate` holds its model and API).

Plain Python, and the source of truth. When the package is installed with a C
compiler at hand, ``setup.py`` also compiles this file with Cython (C types for
its locals in ``walk.pxd``); the compiled module then shadows this one and
runs the same statements ~3-4x faster. ``tangram.policy.compiled`` decides
which one a process runs (``tangram.policy.compiled.walk_module``): this file
when the compiled one was built from other sources (a digest recorded beside
it) or ``TANGRAM_PURE_PYTHON=1`` is set. Units must be integers (C longs there).

The completions are kept as a sorted list of ``(end, units)`` read from index
``k`` on, not as a heap: the earliest-finish choice looks ahead without
taking, and a new completion (never earlier than the current time, so never
before index k) goes in with one bisection. Taking in sorted order is what a
heap's pops do.
"""
from __future__ import annotations

import math
from bisect import bisect_right

COMPILED = not __file__.endswith(".py")  # a compiled module's file is its shared library


def arrive(ends, free, units_before, total_before, leading, items):
    """Start each expected arrival once it has arrived and enough units are free; returns the sum
    of their completion times counted from their arrivals, and the walk's state after them
    (``estimate.Arrivals`` prepares ``units_before``, ``total_before``, ``leading`` and ``items``)."""
    # the leading arrivals that fit in ``free`` as they come: no completion taken, none waits
    j = bisect_right(units_before, free) - 1
    if j > 0:
        ends += leading[:j]
        ends.sort()  # the sorted list the insertions one by one would give
        free -= units_before[j]
    else:
        j = 0
    total = total_before[j]
    k = 0
    now = 0.0  # the latest completion taken: when the units taken so far were all free
    size = len(ends)
    for i in range(j, len(items)):
        r, units, d = items[i]
        while free < units:  # start_time, inlined
            if k == size:
                free = units
                break
            t, u = ends[k]
            k += 1
            free += u
            if t > now:
                now = t
        end = (now if now > r else r) + d
        total += end - r
        insert(ends, end, units, k)
        size += 1
        free -= units
    return total, k, free, now


def walk(ends, k, free, now, waiters, i, explore) -> float:
    total = 0.0
    n = len(waiters)
    if explore > 0:
        while i < n:
            umin, dmin, options = waiters[i]
            if options is not None:
                best = math.inf
                size = len(ends)
                # what follows this waiter: nothing (each count only reads ahead, no copy), one
                # unexplored waiter (it reads the completions with this one's end merged in), or
                # more (a copy of what is left, this end inserted, walked on)
                last = i + 1 == n
                one_after = not last and explore == 1 and i + 2 == n
                for u, d in options:
                    while free < u:  # start_time, continued from the previous count
                        if k == size:
                            free = u
                            break
                        t, got = ends[k]
                        k += 1
                        free += got
                        if t > now:
                            now = t
                    end = now + d
                    if last:
                        rest = end
                    elif one_after:
                        rest = end + last_end(ends, k, free - u, now, waiters[i + 1], (end, u))
                    else:
                        h = ends[k:]
                        insert(h, end, u, 0)
                        rest = end + walk(h, 0, free - u, now, waiters, i + 1, explore - 1)
                    if rest < best:
                        best = rest
                return total + best
            free, now, k = start_time(ends, k, free, now, umin)
            total += now + dmin
            insert(ends, now + dmin, umin, k)
            free -= umin
            i += 1
        return total
    # nothing left to explore (the estimate's hot loop): a fixed waiter takes its
    # minimum; an elastic one the count that ends it soonest, as a round would give
    # it on its own (its minimum made "wait for many units" look worse than "start
    # now on one" whenever a node was briefly full)
    size = len(ends)
    inf = math.inf  # a local: read once per waiter
    for umin, dmin, options in (waiters[i:] if i else waiters):
        if options is not None and len(options) > 1:
            # the count that ends soonest (the smallest on a tie), as a look-ahead:
            # each count needs the completions the one before needed, and more
            best_end = inf
            b_k = -1  # the first count is the best so far whatever it ends at (an end at inf too)
            for u, d in options:
                while free < u:
                    if k == size:  # as start_time: units the estimate does not know of are free
                        free = u
                        break
                    t, got = ends[k]
                    k += 1
                    free += got
                    if t > now:
                        now = t
                if now + d < best_end or b_k < 0:
                    best_end = now + d
                    umin, dmin, b_free, b_now, b_k = u, d, free, now, k
            free, now, k = b_free, b_now, b_k
        else:
            while free < umin:  # start_time, inlined
                if k == size:
                    free = umin
                    break
                t, u = ends[k]
                k += 1
                free += u
                if t > now:
                    now = t
        end = now + dmin
        total += end
        insert(ends, end, umin, k)
        size += 1
        free -= umin
    return total


def last_end(ends, k, free, now, waiter, extra) -> float:
    """The hot loop's end time for ``waiter``, the last one, reading ``ends`` from ``k`` with
    the completion ``extra`` merged in where insort would have put it (after equal ones)."""
    umin, dmin, options = waiter
    size = len(ends)
    pending = True
    best = math.inf
    for u, d in (options if options is not None and len(options) > 1 else ((umin, dmin),)):
        while free < u:
            if pending and (k == size or extra < ends[k]):
                t, got = extra
                pending = False
            elif k == size:
                free = u
                break
            else:
                t, got = ends[k]
                k += 1
            free += got
            if t > now:
                now = t
        if now + d < best:
            best = now + d
    return best


def insert(ends, end, units, lo) -> None:
    """``bisect.insort(ends, (end, units), lo)``: after every pair that sorts before or equal to it.
    Compiled, it compares C doubles and longs where insort compared Python tuples (0.93x of a
    256-core round, docs/scheduling.md); as plain Python it is slower than insort."""
    hi = len(ends)
    while lo < hi:
        mid = (lo + hi) // 2
        t, u = ends[mid]
        if end < t or (end == t and units < u):
            hi = mid
        else:
            lo = mid + 1
    ends.insert(lo, (end, units))


def start_time(ends, k, free, now, units):
    """Take completions from index ``k`` until ``units`` are free; returns (free, start time, k).

    No completion left with too few units means the pool's accounting is not
    all known to the estimate (units held outside the engine): assume they
    are free rather than waiting forever.
    """
    size = len(ends)
    while free < units:
        if k == size:
            return units, now, k
        t, u = ends[k]
        k += 1
        free += u
        if t > now:
            now = t
    return free, now, k
