"""DPArrange against brute force, for both topology operators (contract API)."""
from __future__ import annotations

import itertools
import math
import random

import pytest

from tangram.policy import Arrangement, ChunkOperator, UnitsOperator, arrange, prefix_table


def _exhaustively_packable(free_chunks, requests) -> bool:
    """Independent check: place every request at an aligned offset inside one free chunk."""
    segments = []
    base = 0
    for c in free_chunks:
        segments.append((base, c))
        base += 8  # chunks live on separate aligned slots
    used: set[int] = set()

    def place(i: int) -> bool:
        if i == len(requests):
            return True
        r = requests[i]
        for start, size in segments:
            for off in range(start, start + size - r + 1, r):
                cells = set(range(off, off + r))
                if not cells & used:
                    used.update(cells)
                    if place(i + 1):
                        return True
                    used.difference_update(cells)
        return False

    return place(0)


def _brute(options, feasible):
    best = None
    for combo in itertools.product(*[sorted(o.items()) for o in options]):
        units = tuple(u for u, _ in combo)
        if not feasible(units):
            continue
        total = sum(d for _, d in combo)
        if best is None or total < best - 1e-12:
            best = total
    return best


@pytest.mark.parametrize("seed", range(6))
def test_units_operator_matches_brute_force(seed):
    rng = random.Random(seed)
    for _ in range(80):
        n = rng.randint(0, 4)
        cap = rng.randint(0, 12)
        options = [
            {u: rng.uniform(0.1, 10.0) for u in rng.sample(range(1, 9), rng.randint(1, 4))}
            for _ in range(n)
        ]
        got = arrange(options, UnitsOperator(cap))
        want = _brute(options, lambda us: sum(us) <= cap)
        if want is None:
            assert got is None
            continue
        assert got is not None and math.isclose(got.total, want, rel_tol=1e-9)
        assert sum(got.units) <= cap
        assert all(u in o for u, o in zip(got.units, options))
        assert math.isclose(sum(o[u] for u, o in zip(got.units, options)), got.total, rel_tol=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_chunk_operator_matches_brute_force(seed):
    rng = random.Random(100 + seed)
    for _ in range(60):
        n = rng.randint(0, 4)
        chunks = [rng.choice([1, 2, 4, 8]) for _ in range(rng.randint(0, 3))]
        options = [
            {u: rng.uniform(0.1, 10.0) for u in rng.sample([1, 2, 4, 8], rng.randint(1, 4))}
            for _ in range(n)
        ]
        got = arrange(options, ChunkOperator(chunks))
        want = _brute(options, lambda us: _exhaustively_packable(chunks, list(us)))
        if want is None:
            assert got is None, (chunks, options, got)
            continue
        assert got is not None and math.isclose(got.total, want, rel_tol=1e-9), (chunks, options, got, want)
        assert _exhaustively_packable(chunks, list(got.units))


def test_optimum_over_all_totals_not_only_full_capacity():
    # using the spare unit would make it slower: the optimum leaves it free
    got = arrange([{1: 1.0, 2: 5.0}], UnitsOperator(2))
    assert got == Arrangement(1.0, (1,))


def test_every_prefix_from_one_pass():
    options = [{1: 8.0, 2: 4.0, 4: 2.0}, {1: 6.0, 2: 3.0}, {1: 5.0}]
    table = prefix_table(options, UnitsOperator(4))
    assert table.arrangement(1) == Arrangement(2.0, (4,))
    assert table.arrangement(2) == Arrangement(7.0, (2, 2))  # 4 + 3 beats 2 + 6 and 8 + 3
    assert table.arrangement(3) == Arrangement(15.0, (2, 1, 1))  # 4 + 6 + 5 beats 8 + 3 + 5


def test_infeasible_is_none_not_an_error():
    assert arrange([{2: 1.0}, {2: 1.0}], UnitsOperator(3)) is None
    assert arrange([{4: 1.0}], ChunkOperator([2, 2])) is None  # two 2-chunks are not one 4-chunk
    assert arrange([{3: 1.0}], ChunkOperator([4])) is None  # 3 GPUs is no buddy chunk
    assert arrange([], UnitsOperator(0)) == Arrangement(0.0, ())


def test_chunk_split_and_fragmentation():
    # an 8-chunk can be split into 4 + 2 + 1 + 1
    got = arrange([{4: 1.0}, {2: 1.0}, {1: 1.0}, {1: 1.0}], ChunkOperator([8]))
    assert got is not None and sorted(got.units) == [1, 1, 2, 4]
    # fragmented free space: 1 + 1 + 2 cannot hold a 4 even though 4 GPUs are free
    got = arrange([{1: 10.0, 4: 1.0}], ChunkOperator([1, 1, 2]))
    assert got == Arrangement(10.0, (1,))


@pytest.mark.parametrize(
    "options, match",
    [
        ([{0: 1.0}], "unit counts"),
        ([{1: 0.0}], "duration"),
        ([{1: float("nan")}], "duration"),
    ],
)
def test_malformed_options_raise(options, match):
    with pytest.raises(ValueError, match=match):
        arrange(options, UnitsOperator(4))


def test_operator_validation():
    with pytest.raises(ValueError, match="free_chunks"):
        ChunkOperator([3])
    with pytest.raises(ValueError, match="capacity"):
        UnitsOperator(-1)


@pytest.mark.parametrize("seed", range(4))
def test_pruned_table_is_exact_for_long_prefixes(seed):
    # the policy prunes states that cannot reach the last few prefixes; those must not change
    import numpy as np

    from tangram.policy.arrange import prefix_table_rows

    rng = random.Random(seed)
    rows = []
    for _ in range(10):
        lo = rng.randint(1, 3)
        units = np.arange(lo, lo + rng.randint(1, 6))
        rows.append((units, np.array([rng.uniform(1, 9) / u for u in units])))
    full = prefix_table_rows(rows, UnitsOperator(24))
    pruned = prefix_table_rows(rows, UnitsOperator(24), min_prefix=7)
    for t in range(7, 11):
        assert full.feasible(t) == pruned.feasible(t)
        if full.feasible(t):
            assert pruned.best(t) == pytest.approx(full.best(t))
            assert sum(pruned.units(t)) <= 24
    with pytest.raises(ValueError):
        pruned.feasible(3)
