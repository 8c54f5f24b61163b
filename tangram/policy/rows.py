"""Each scalable action's row: its worthwhile options of the key resource and their durations.

The DP and the ACT estimate read an action's options and durations many
times per round; they depend only on the frozen action, so they are built
once per action and kept in a memo (:mod:`tangram.policy.memo`).
"""
from __future__ import annotations

from bisect import bisect_right
from functools import lru_cache
from typing import Mapping

import numpy as np

from tangram.core.model import Action
from tangram.policy.greedy import RowArrays, greedy_exact
from tangram.policy.memo import register, remember
from tangram.policy.snapshot import PolicyParams, PoolState, Snapshot

# an extra unit must buy at least 5% of the speedup it would give perfectly parallel work
_MIN_MARGINAL_GAIN = 0.05


class Row:
    """What the policy reads of one scalable action, built once per action."""

    __slots__ = ("ref", "units", "durs", "pair", "options", "convex", "top", "u0", "d0", "waiter", "at")

    def __init__(self, a: Action, units: np.ndarray, durs: np.ndarray):
        self.ref = None  # to ``a``, weak (memo.remember)
        self.units = units
        self.durs = durs
        self.pair = RowArrays((units, durs))
        self.options = tuple(int(u) for u in units)  # worthwhile options, ascending
        self.convex = greedy_exact(units, durs)
        self.top = self.options[-1]
        self.u0 = self.options[0]
        self.d0 = float(durs[0])
        self.waiter = None  # (rtype, capacity, the waiter tuple), see estimate.waiter
        self.at: dict[int, float] = {}  # units -> a.duration(units), as the rounds asked for them


_ROWS: dict[int, Row] = register({})  # id(action) -> its Row, while the action waits (policy.memo)


def row(a: Action) -> Row:
    """The memo entry of ``a`` (a scalable action)."""
    hit = _ROWS.get(id(a))
    if hit is not None:
        return hit
    return _build_row(a)


def duration(a: Action, units: int, snap: Snapshot) -> float:
    if a.key is not None and a.t1_s is not None and a.elasticity is not None:  # a.scalable, inlined
        r = row(a)
        if units == 0 or units == r.u0:
            return r.d0
        d = r.at.get(units)
        if d is None:
            d = r.at[units] = a.duration(units)
        return d
    d = a.t1_s
    if d is not None:
        return d
    return snap.class_estimates.get(a.action_class, snap.params.default_duration_s)


def run_estimate(a: Action, units: Mapping[str, int], hits, snap: Snapshot) -> float:
    """How long ``a`` runs at ``units`` (a dispatch's ``estimated_s``), a GPU miss's restore included
    (``hits``: the GPU DoPs at which an idle instance of its service is its own)."""
    d = duration(a, units.get(a.key, 0) if a.key else 0, snap)
    gpu = units.get("gpu")
    if gpu is not None and a.restore_s and gpu not in hits:
        d += a.restore_s.get(gpu, 0.0)
    return d


def full_row(a: Action) -> tuple[np.ndarray, np.ndarray]:
    """The worthwhile options of ``a``'s key resource and their durations, once per action.

    A memo, not state: the arrays depend only on the frozen action. An
    option is worthwhile only if each unit it adds over the previous kept
    one buys at least ``_MIN_MARGINAL_GAIN`` of what a perfectly parallel
    action would gain: cores that speed nothing up would be held for nothing
    (the DP, which sums durations only, would take them for a 0.1% gain).
    """
    r = row(a)
    return r.units, r.durs


def _build_row(a: Action) -> Row:
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
    return remember(_ROWS, a, Row(a, units, durs))


def convex_row(a: Action) -> bool:
    """Whether the greedy units operator is exact for ``a``'s row (and any DoP cap of it)."""
    return row(a).convex


def worthwhile_options(a: Action) -> tuple[int, ...]:
    return row(a).options


def option_row(a: Action, cap: int, params: PolicyParams, pool: PoolState | None = None,
               hits: frozenset[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``a``'s options up to ``cap`` and their durations; on a GPU pool a DoP pays its restore first
    unless it is in ``hits`` (an idle instance of the service at that DoP is ``a``'s to take;
    None: any DoP whose service is resident on the pool counts as a hit)."""
    return _cut(a, row(a), cap, params, pool, hits)


def _cut(a: Action, r: Row, cap: int, params: PolicyParams, pool: PoolState | None, hits) -> tuple[np.ndarray, np.ndarray]:
    limit = cap
    caps = params.dop_caps.get(a.action_class) if params.dop_caps else None
    if caps is not None:
        limit = min(limit, max(caps, r.u0))
    restores = a.restore_s and a.service is not None and pool is not None and pool.chunked
    if r.top <= limit and not restores:
        return r.pair  # the common case: nothing to cut or add
    k = bisect_right(r.options, limit)
    units, durs = r.units[:k], r.durs[:k]
    if restores:
        # evict-on-execution: a DoP whose service is not resident first pays its restore
        if hits is None:
            hits = frozenset(int(u) for u in units if f"{a.service}@dop{u}" in pool.resident)
        extra = [0.0 if int(u) in hits else a.restore_s.get(int(u), 0.0) for u in units]
        durs = durs + np.asarray(extra)
    return units, durs


def group_rows(actions, cap: int, params: PolicyParams, pool: PoolState, hits=None) -> tuple[list, bool]:
    """:func:`option_row` of each action (``hits[i]``: action i's, see there; none above
    ``cap``), and whether every row is convex and not empty (the greedy units operator
    is exact for them)."""
    rows, convex = [], True
    caps = params.dop_caps
    chunked = pool is not None and pool.chunked
    memo = _ROWS
    for i, a in enumerate(actions):
        r = memo.get(id(a))  # row(a), its memo read inline
        if r is None:
            r = _build_row(a)
        if r.top <= cap and not (caps and a.action_class in caps) and not (
                chunked and a.restore_s and a.service is not None):
            rows.append(r.pair)  # _cut's common case: nothing to cut or add
            convex = convex and r.convex
            continue
        cut = _cut(a, r, cap, params, pool, None if hits is None else hits[i])
        rows.append(cut)
        convex = convex and r.convex and len(cut[0]) > 0
    return rows, convex


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
