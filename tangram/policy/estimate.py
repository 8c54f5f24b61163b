"""The ACT approximation (paper Algorithm 2): how long the actions still waiting for a pool take.

Greedy eviction compares, for each prefix of the candidates it keeps, the
DPArrange optimum plus this estimate of the look-ahead's completion times:
each waiting action starts, in queue order, when the completion heap has
released enough units; the first ``depth - 1`` scalable ones try several
counts (a bounded search), later scalable ones take the count that ends them
soonest, fixed ones their minimum. The walk itself lives in ``walk.py`` (compiled
when the install could build it: ``tangram/policy/compiled.py``).
"""
from __future__ import annotations

from operator import index as _index

from tangram.core.model import Action
from tangram.policy.compiled import arrays_walk, walk_module
from tangram.policy.rows import duration as _duration
from tangram.policy.rows import explored_options as _explored_options
from tangram.policy.rows import row as _row
from tangram.policy.snapshot import PoolState, Snapshot

_hot = walk_module()  # the hot loops: compiled when built (tangram/policy/walk.py)
_walk = arrays_walk(_hot)  # _hot.walk, or the same walk on C arrays when built (walk_arrays.pyx)


def waiter(a: Action, pool: PoolState, snap: Snapshot):
    """``(min units, duration at min, options to explore)`` of a waiting action (on a GPU
    pool, each duration with the restore of a cache miss at that count).

    The options, ``((units, duration), ...)``, are None for an action the
    look-ahead does not explore (not scalable on this pool). Those of a
    scalable action depend only on it, the pool's type and capacity and its
    DoP cap: kept in its row's memo.
    """
    demand = a.demands.get(pool.rtype)
    if demand is None:
        return None
    if not (a.key == pool.rtype and a.t1_s is not None and a.elasticity is not None):  # a.scalable on this pool
        return demand.min, _duration(a, demand.min, snap), None
    r = _row(a)
    limit = pool.capacity
    caps = snap.params.dop_caps
    if caps and a.action_class in caps:  # a capped action waits for no more than its cap (rows._cut)
        limit = min(limit, max(caps[a.action_class], r.u0))
    hit = r.waiter
    if hit is not None and hit[0] == pool.rtype and hit[1] == limit:
        return hit[2]
    options = _explored_options(r.options, limit)
    restore = a.restore_s if (pool.chunked and a.service is not None) else None
    if restore:
        # a GPU waiter's future residency is unknown: it is charged what a miss costs at each
        # count, as a candidate without an idle instance is (rows.option_row)
        w = (demand.min, _duration(a, demand.min, snap) + restore.get(demand.min, 0.0),
             tuple((u, a.duration(u) + restore.get(u, 0.0)) for u in options))
    else:
        w = demand.min, _duration(a, demand.min, snap), tuple((u, a.duration(u)) for u in options)
    r.waiter = (pool.rtype, limit, w)
    return w


def arrivals(snap: Snapshot, pool: PoolState) -> list:
    """``(seconds until, units, duration)`` of the next actions the pool's node's trajectories in
    generation are expected to submit (their last action's shape). Elastic ones are left out:
    they take what is free when they come, while a fixed action needs its units."""
    if pool.chunked or pool.node is None or not snap.upcoming or not snap.params.expect_arrivals:
        return []
    expected = snap.upcoming.get(pool.node)
    if not expected:
        return []
    out = []
    rtype = pool.rtype
    for r, a in expected:
        d = a.demands.get(rtype)
        if d is None or (a.key == rtype and a.scalable):
            continue
        out.append((r, d.min, _duration(a, d.min, snap)))
    return out


def floor(waiters: list, arrivals) -> float:
    """A lower bound of any estimate of ``waiters`` and ``arrivals`` (whatever the completions and the
    units free): each ends no sooner than its shortest duration after it starts (an arrival: after
    it arrives). Lowered by a relative 1e-9 so that the estimate's own roundings stay above it."""
    total = 0.0
    for umin, dmin, options in waiters:
        total += min(dmin, min(d for _, d in options)) if options else dmin
    items = arrivals.items if isinstance(arrivals, Arrivals) else arrivals
    for _, _, d in items:
        total += d
    return total * (1.0 - 1e-9) if total > 0.0 else total


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


def estimate_from(ends: list, free_units: int, waiters: list, explore: int, arrivals=()) -> float:
    """:func:`estimate_rest` of pairs already passed through :func:`completions` (the list
    becomes the estimate's own: the caller hands over a fresh one).

    ``arrivals``: ``(seconds until it arrives, units, duration)`` of fixed actions expected
    soon, soonest first. They go ahead of the waiters (the order key of a short action
    arriving in a moment sorts before a long one's that waits) and each counts from its
    arrival.
    """
    ends.sort()
    return estimate_sorted(ends, free_units, waiters, explore, arrivals)


class Arrivals:
    """Expected arrivals prepared once for every estimate of a group: ``items`` as
    :func:`arrivals` gives them, with the sums of their leading units and completion times.

    The leading arrivals that fit in the units free from the start take no completion: each
    ends at its arrival plus its duration whatever the rest of the walk holds, so an
    estimate takes them all at once (one merge instead of an insertion each).
    """

    __slots__ = ("items", "units_before", "total_before", "ends")

    def __init__(self, items):
        self.items = items
        self.units_before = [0]  # [i]: units of the first i arrivals
        self.total_before = [0.0]  # [i]: their completion times counted from their arrivals, summed in order
        self.ends = []  # (end, units) of each, starting on arrival
        units = 0
        total = 0.0
        for r, u, d in items:
            end = (0.0 if 0.0 > r else r) + d  # as _arrive computes it with nothing taken yet
            units += u
            total += end - r
            self.units_before.append(units)
            self.total_before.append(total)
            self.ends.append((end, u))

    def __len__(self) -> int:
        return len(self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


def _arrive(ends, free, arrivals):
    """Start each expected arrival once it has arrived and enough units are free; returns the sum
    of their completion times counted from their arrivals, and the walk's state after them."""
    if not isinstance(arrivals, Arrivals):
        arrivals = Arrivals(arrivals)
    free = _index(free)  # as estimate_sorted
    return _hot.arrive(ends, free, arrivals.units_before, arrivals.total_before, arrivals.ends, arrivals.items)


def estimate_sorted(ends: list, free_units: int, waiters: list, explore: int, arrivals=()) -> float:
    """:func:`estimate_from` of pairs already sorted (a round inserts its few candidates'
    ends into the sorted running ones instead of sorting them all again)."""
    # units are integers (a manager's free units are the one input the model does not check); a
    # float here is refused, as the compiled walk would otherwise truncate it where the source does not
    free_units = _index(free_units)
    if not arrivals:
        return _walk(ends, 0, free_units, 0.0, waiters, 0, explore)
    total, k, free, now = _arrive(ends, free_units, arrivals)
    return total + _walk(ends, k, free, now, waiters, 0, explore)
