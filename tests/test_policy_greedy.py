"""The units operator's greedy fast path agrees with the DP (and brute force)."""
from __future__ import annotations

import importlib
import itertools
import math
import random

import numpy as np
import pytest

from tangram.core.model import Elasticity
from tangram.policy import UnitsOperator, arrange
from tangram.policy.arrange import GreedyTable, PrefixTable, _units_table, prefix_table, prefix_table_rows

arrange_module = importlib.import_module("tangram.policy.arrange")  # the package's `arrange` is the function


def _convex_row(rng: random.Random, lo: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Consecutive counts, decreasing durations, non-increasing marginal gains."""
    d0 = rng.uniform(1.0, 100.0)
    gains = sorted((rng.uniform(0.0, d0 / (2 * n)) for _ in range(n - 1)), reverse=True)
    if rng.random() < 0.3 and n > 2:  # ties and flat tails happen in measured tables
        gains[-1] = gains[-2]
        gains.append(0.0)
        gains = gains[: n - 1]
    durs = d0 - np.concatenate(([0.0], np.cumsum(gains)))
    return np.arange(lo, lo + n, dtype=np.int64), durs


def _nonconvex_row(rng: random.Random, lo: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    units = np.array(sorted(rng.sample(range(lo, lo + 2 * n), n)), dtype=np.int64)
    return units, np.array([rng.uniform(0.5, 50.0) for _ in range(n)])


def _assert_same(fast, dp, rows, cap):
    for t in range(len(rows) + 1):
        assert fast.feasible(t) == dp.feasible(t)
        if not dp.feasible(t):
            continue
        assert math.isclose(fast.best(t), dp.best(t), rel_tol=1e-9, abs_tol=1e-9)
        units, durs = fast.units_and_durations(t)
        assert sum(units) <= cap
        for (u, d), got, dur in zip(rows, units, durs):
            assert got in u.tolist()
            assert math.isclose(dur, float(d[u.tolist().index(got)]))
        assert math.isclose(sum(durs), dp.best(t), rel_tol=1e-9, abs_tol=1e-9)


@pytest.mark.parametrize("seed", range(8))
def test_greedy_equals_dp_on_random_convex_tables(seed):
    rng = random.Random(seed)
    for _ in range(40):
        rows = [_convex_row(rng, rng.randint(1, 4), rng.randint(1, 12)) for _ in range(rng.randint(0, 10))]
        cap = rng.randint(0, 80)
        fast = prefix_table_rows(rows, UnitsOperator(cap))
        assert isinstance(fast, GreedyTable) == all(int(u[0]) <= cap for u, _ in rows)
        _assert_same(fast, _units_table(rows, cap), rows, cap)


@pytest.mark.parametrize("seed", range(4))
def test_nonconvex_tables_take_the_dp_and_agree_with_it(seed):
    rng = random.Random(100 + seed)
    for _ in range(40):
        rows = [_nonconvex_row(rng, rng.randint(1, 3), rng.randint(2, 6)) for _ in range(rng.randint(1, 8))]
        cap = rng.randint(0, 40)
        table = prefix_table_rows(rows, UnitsOperator(cap))
        if any(int(u[-1]) - int(u[0]) != len(u) - 1 for u, _ in rows if int(u[-1]) <= cap):
            assert isinstance(table, PrefixTable)  # a gap in the counts: the greedy may be wrong
        _assert_same(table, _units_table(rows, cap), rows, cap)


@pytest.mark.parametrize("seed", range(4))
def test_greedy_matches_brute_force_on_amdahl(seed):
    rng = random.Random(200 + seed)
    for _ in range(30):
        n = rng.randint(1, 4)
        cap = rng.randint(0, 16)
        options = []
        for _ in range(n):
            lo, hi = rng.randint(1, 3), rng.randint(3, 7)
            el = Elasticity.amdahl(rng.uniform(0.0, 0.6))
            t1 = rng.uniform(1.0, 60.0)
            options.append({u: el.duration(t1, u) for u in range(lo, hi + 1)})
        got = arrange(options, UnitsOperator(cap))
        best = None
        for combo in itertools.product(*[sorted(o.items()) for o in options]):
            if sum(u for u, _ in combo) <= cap:
                total = sum(d for _, d in combo)
                best = total if best is None else min(best, total)
        if best is None:
            assert got is None
        else:
            assert got is not None and math.isclose(got.total, best, rel_tol=1e-9)
            assert isinstance(prefix_table(options, UnitsOperator(cap)), GreedyTable)


def test_policy_sized_amdahl_rows_take_the_fast_path():
    """256 candidates x 1,024 units x 32 options (the policy's large case) need no DP."""
    rng = random.Random(0)
    rows = []
    for _ in range(256):
        el = Elasticity.amdahl(rng.uniform(0.01, 0.3))
        units = np.arange(1, 33, dtype=np.int64)
        rows.append((units, el.durations(rng.uniform(5, 120), units)))
    table = prefix_table_rows(rows, UnitsOperator(1024))
    assert isinstance(table, GreedyTable)
    units, _ = table.units_and_durations(256)
    assert sum(units) == 1024  # every gain is positive: the whole capacity is used


@pytest.mark.parametrize("seed", range(6))
def test_small_tables_on_lists_give_the_arrays_floats(seed, monkeypatch):
    """Up to ``_SMALL_TABLE`` rows the greedy runs on Python lists: the same counts and the
    same floats as on arrays, with tied gains across identical rows too."""
    rng = random.Random(300 + seed)
    cases = []
    for _ in range(80):
        rows = [_convex_row(rng, rng.randint(1, 4), rng.randint(1, 12))
                for _ in range(rng.randint(0, arrange_module._SMALL_TABLE - 1))]
        if rows and rng.random() < 0.4:
            rows.append(rows[rng.randrange(len(rows))])  # a twin: equal gains at the budget's edge
        cases.append((rows, rng.randint(0, 60)))
    small = [GreedyTable(rows, cap) for rows, cap in cases]
    monkeypatch.setattr(arrange_module, "_SMALL_TABLE", -1)
    for (rows, cap), fast in zip(cases, small):
        ref = GreedyTable(rows, cap)
        for t in range(len(rows) + 1):
            assert fast.feasible(t) == ref.feasible(t)
            if ref.feasible(t):
                assert fast.best(t) == ref.best(t)
                assert fast.units_and_durations(t) == ref.units_and_durations(t)
