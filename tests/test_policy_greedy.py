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

greedy_module = importlib.import_module("tangram.policy.greedy")


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
def test_small_tables_on_lists_give_the_arrays_floats(seed):
    """Tables of fewer rows than numpy sums pairwise run on the lists too: the same counts and the
    same floats as on the arrays, with tied gains across identical rows too."""
    rng = random.Random(300 + seed)
    merged = 0
    for _ in range(80):
        rows = [_convex_row(rng, rng.randint(1, 4), rng.randint(1, 12))
                for _ in range(rng.randint(0, greedy_module._PAIRWISE_FROM - 2))]
        if rows and rng.random() < 0.4:
            rows.append(rows[rng.randrange(len(rows))])  # a twin: equal gains at the budget's edge
        cap = rng.randint(0, 60)
        fast, ref = GreedyTable(rows, cap), GreedyTable(rows, cap)
        for t in range(len(rows) + 1):
            assert fast.feasible(t) == ref.feasible(t)
            if ref.feasible(t):
                merged += fast._solve_merge(t) is not None
                assert fast._solve(t) == ref._solve_arrays(t)  # floats compared exactly
    assert merged > 100


@pytest.mark.parametrize("as_run", [True, False], ids=["as-installed", "source"])
def test_list_sums_are_numpys_bit_for_bit(as_run):
    """numpy sums a short array left to right and a long one pairwise (blocks of 128 with eight
    running sums, longer runs halved); Python's ``sum`` compensates rounding from 3.12 on, so the
    lists must not use it. Signs, zeros of both signs and magnitudes 40 decades apart included;
    the module as it runs (compiled, after an install) and its plain source."""
    from tangram.policy import compiled

    module = greedy_module if as_run else compiled.source_module("greedy")
    rng = random.Random(7)
    for _ in range(6000):
        n = rng.choice([rng.randint(0, 20), rng.randint(0, 300), rng.randint(100, 2000)])
        values = [rng.choice([rng.uniform(0.1, 100.0) * 10.0 ** rng.randint(-8, 8), rng.uniform(-1e6, 1e6),
                              rng.random() * 10.0 ** rng.randint(-20, 20), 0.0, -0.0]) for _ in range(n)]
        want = float(np.array(values, dtype=np.float64).sum())
        got = module._numpy_sum(values)
        assert got == want and math.copysign(1.0, got) == math.copysign(1.0, want), (n, got, want)
    assert math.copysign(1.0, module._numpy_sum([-0.0])) == math.copysign(1.0, float(np.sum([-0.0])))


def _table_cases(rng: random.Random, rows_lo: int, rows_hi: int) -> list:
    cases = []
    for _ in range(60):
        rows = [_convex_row(rng, rng.randint(1, 4), rng.randint(1, 40)) for _ in range(rng.randint(rows_lo, rows_hi))]
        if rng.random() < 0.4:  # twins: equal gains across rows, at the budget's edge too
            rows += [rows[rng.randrange(len(rows))] for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.2:  # gains that grow within the convexity test's tolerance
            u, d = rows[0]
            if len(d) > 3:
                d = d.copy()
                d[2] = d[1] - (d[1] - d[2]) * (1 - 1e-15) if d[1] > d[2] else d[2]
                rows[0] = (u, d)
        lists = rng.random() < 0.5  # half as the policy's memo rows, which keep their lists
        rows = [greedy_module.RowArrays(r) if lists else r for r in rows]
        cap = sum(int(u[0]) for u, _ in rows) + rng.choice([0, 1, 2, rng.randint(0, 400)])
        cases.append((rows, cap))
    return cases


@pytest.mark.parametrize("seed", range(6))
def test_large_tables_on_lists_give_the_arrays_floats(seed, monkeypatch):
    """Larger tables select on the rows' lists by a heap merge too: the same
    counts and the same floats as ``argpartition`` over the arrays, or it hands over to them."""
    rng = random.Random(700 + seed)
    merged = handed_over = 0
    for rows, cap in _table_cases(rng, greedy_module._PAIRWISE_FROM, 70):
        fast = GreedyTable(rows, cap)
        ref = GreedyTable(rows, cap)
        for t in range(len(rows) + 1):
            assert fast.feasible(t) == ref.feasible(t)
            if not ref.feasible(t):
                continue
            want = ref._solve_arrays(t)
            got = fast._solve_merge(t)
            if got is None:
                handed_over += 1
            else:
                merged += 1
                assert got == want  # floats compared exactly: the same bits
            assert fast._solve(t) == want
    assert merged > 100 and handed_over > 0  # both paths ran


@pytest.mark.parametrize("seed", range(6))
def test_prefixes_asked_shortest_last_go_on_from_the_longer_merge(seed):
    """Greedy eviction asks for prefixes n, n-1, n-2, ...: each merge goes on from the last one's
    (GreedyTable._largest). The same counts and floats as the arrays, or a hand-over, in that
    order and in any other (a longer prefix after a shorter starts a merge over)."""
    rng = random.Random(900 + seed)
    merged = handed_over = went_on = 0
    for rows, cap in _table_cases(rng, greedy_module._PAIRWISE_FROM, 70):
        n = len(rows)
        ref = GreedyTable(rows, cap)
        for ts in (list(range(n, -1, -1)), rng.sample(range(n + 1), n + 1)):
            fast = GreedyTable(rows, cap)
            for t in ts:
                if not ref.feasible(t):
                    continue
                before = fast._merge
                got = fast._solve_merge(t)
                went_on += before is not None and fast._merge is before
                if got is None:
                    handed_over += 1
                else:
                    merged += 1
                    assert got == ref._solve_arrays(t)  # floats compared exactly: the same bits
    assert merged > 300 and handed_over > 0 and went_on > 200


def test_the_merge_hands_over_on_a_tie_at_the_budgets_edge():
    row = (np.arange(1, 5, dtype=np.int64), np.array([8.0, 6.0, 5.0, 4.5]))  # gains 2, 1, 0.5
    rows = [row] * 8 + [(np.arange(1, 3, dtype=np.int64), np.array([9.0, 8.5]))] * 2  # gains 0.5
    table = GreedyTable(rows, 10 + 8)  # budget 8: the eight gains of 2 exactly
    assert table._solve_merge(10) == table._solve_arrays(10)
    assert table._solve_merge(10)[1] == (2,) * 8 + (1, 1)
    table = GreedyTable(rows, 10 + 9)  # budget 9: one of eight tied gains of 1
    assert table._solve_merge(10) is None
    table = GreedyTable(rows, 10 + 8 * 3 + 1)  # budget 25: one of ten tied gains of 0.5 is left out
    assert table._solve_merge(10) is None
    table = GreedyTable(rows, 10 + 8 * 3 + 2)  # every positive gain
    assert table._solve_merge(10)[1] == (4,) * 8 + (2, 2)


def test_twin_rows_hand_over_before_the_merge():
    """Rows that all share their first gain tie at any budget's edge below their count: the
    merge says so at once (the arrays decide which twin gets the unit) and the answer is theirs."""
    units = np.arange(1, 33, dtype=np.int64)
    row = (units, Elasticity.amdahl(0.1).durations(60.0, units))
    rows = [row] * 64
    for budget in (5, 30, 45):
        table = GreedyTable(rows, 64 + budget)
        assert table._solve_merge(64) is None
        assert table.units_and_durations(64) == GreedyTable(rows, 64 + budget)._solve_arrays(64)[1:]
