"""Each scalable action's row: its worthwhile options of the key resource and their durations.

The DP and the ACT estimate read an action's options and durations many
times per round; they depend only on the frozen action, so they are built
once per action and kept in a bounded memo.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from tangram.core.model import Action
from tangram.policy.arrange import greedy_exact
from tangram.policy.snapshot import PolicyParams, PoolState, Snapshot

# an extra unit must buy at least 5% of the speedup it would give perfectly parallel work
_MIN_MARGINAL_GAIN = 0.05


def duration(a: Action, units: int, snap: Snapshot) -> float:
    if a.scalable:
        row_units, durs = full_row(a)
        if units == 0 or units == row_units[0]:
            return float(durs[0])
        return a.duration(units)
    d = a.t1_s
    if d is not None:
        return d
    return snap.class_estimates.get(a.action_class, snap.params.default_duration_s)


_ROWS: dict[int, tuple[Action, np.ndarray, np.ndarray, tuple[int, ...], bool]] = {}


def full_row(a: Action) -> tuple[np.ndarray, np.ndarray]:
    """The worthwhile options of ``a``'s key resource and their durations, once per action.

    A memo, not state: the arrays depend only on the frozen action. An
    option is worthwhile only if each unit it adds over the previous kept
    one buys at least ``_MIN_MARGINAL_GAIN`` of what a perfectly parallel
    action would gain: cores that speed nothing up would be held for nothing
    (the DP, which sums durations only, would take them for a 0.1% gain).
    """
    hit = _ROWS.get(id(a))
    if hit is not None and hit[0] is a:
        return hit[1], hit[2]
    return _build_row(a)[1:3]


def _build_row(a: Action):
    units = np.asarray(a.demands[a.key].options, dtype=np.int64)
    durs = a.elasticity.durations(a.t1_s, units)
    keep = [0]
    for i in range(1, len(units)):
        j = keep[-1]
        gain = durs[j] / durs[i] - 1.0
        if gain >= _MIN_MARGINAL_GAIN * (units[i] - units[j]) / units[j]:
            keep.append(i)
    if len(keep) < len(units):
        units, durs = units[keep], durs[keep]
    if len(_ROWS) >= 65536:
        _ROWS.clear()
    entry = _ROWS[id(a)] = (a, units, durs, tuple(int(u) for u in units), greedy_exact(units, durs))
    return entry


def convex_row(a: Action) -> bool:
    """Whether the greedy units operator is exact for ``a``'s row (and any DoP cap of it)."""
    hit = _ROWS.get(id(a))
    if hit is not None and hit[0] is a:
        return hit[4]
    return _build_row(a)[4]


def worthwhile_options(a: Action) -> tuple[int, ...]:
    hit = _ROWS.get(id(a))
    if hit is not None and hit[0] is a:
        return hit[3]
    return _build_row(a)[3]


def option_row(a: Action, cap: int, params: PolicyParams, pool: PoolState | None = None) -> tuple[np.ndarray, np.ndarray]:
    units, durs = full_row(a)
    limit = cap
    caps = params.dop_caps.get(a.action_class)
    if caps is not None:
        limit = min(limit, max(caps, int(units[0])))
    k = int(np.searchsorted(units, limit, side="right"))
    units, durs = units[:k], durs[:k]
    if a.restore_s and a.service is not None and pool is not None and pool.chunked:
        # evict-on-execution: a DoP whose service is not resident first pays its restore
        extra = [0.0 if f"{a.service}@dop{u}" in pool.resident else a.restore_s.get(int(u), 0.0) for u in units]
        durs = durs + np.asarray(extra)
    return units, durs


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
