"""The units operator's fast path: greedy marginal allocation (docs/scheduling.md,
"DPArrange at the speed of its inputs").

When every row's marginal gains never grow, each prefix of the candidates starts
at its minimums and spends the capacity left on the largest positive gains. The
answer is defined as numpy's arrays give it (``argpartition`` over the
concatenated gains, ``sum`` over the chosen durations); the list paths below
reach the same counts and floats without numpy's fixed cost per call, and hand
over to the arrays whenever the budget ends inside a run of equal gains, where
the answer is the one ``argpartition`` happens to pick.
"""
from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Arrangement:
    """An optimal assignment: ``units[i]`` for candidate ``i``, summing to ``total`` seconds."""

    total: float
    units: tuple[int, ...]


def greedy_exact(units: np.ndarray, durs: np.ndarray) -> bool:
    """Consecutive counts whose marginal gains never grow (Amdahl, most measured tables).

    Then each row's duration is a convex function of its units, and for a
    sum of separable convex functions under ``sum(units) <= capacity`` giving
    every next unit to the largest marginal gain is optimal (the classic
    greedy for separable convex resource allocation). Any prefix of such a
    row (a DoP cap) keeps the property.
    """
    n = len(units)
    if n <= 1:
        return n == 1
    if int(units[-1]) - int(units[0]) != n - 1:
        return False
    gains = durs[:-1] - durs[1:]
    return bool(np.all(gains[1:] <= gains[:-1] + 1e-12 * np.abs(durs[:-2])))


# The lists select while the budget, or what it leaves out, is at most this many gains (a heap
# merge of the rows: one pop per gain); beyond it one argpartition over the arrays is cheaper.
_MERGE_LIMIT = 48
# numpy sums fewer than this many float64 left to right, more pairwise (8 accumulators)
_PAIRWISE_FROM = 8
_PAIRWISE_BLOCK = 128  # numpy's PW_BLOCKSIZE: longer runs are halved (at a multiple of 8)


def _numpy_sum(values: list[float]) -> float:
    """``float(np.array(values).sum())``, bit for bit, in numpy's own order (Python's ``sum``
    compensates rounding from 3.12 on, so it may differ): the reduction's identity plus numpy's
    pairwise sum. Here rather than through numpy, whose fixed cost per call (building the array,
    the reduction's set-up) was a tenth of a compiled round."""
    return 0.0 + _pairwise_sum(values if type(values) is list else list(values), 0, len(values))


def _pairwise_sum(values: list[float], lo: int, n: int) -> float:
    """numpy's ``pairwise_sum`` of ``values[lo:lo + n]`` (numpy/_core/src/umath/loops_utils.h.src):
    left to right below 8 values; up to a block of 128, eight running sums over strides of 8,
    added in pairs, then the rest left to right; a longer run halved at a multiple of 8.
    ``values`` is a list (``greedy.pxd`` types it so when compiled): :func:`_numpy_sum` sees to it."""
    if n < _PAIRWISE_FROM:
        total = -0.0  # numpy's start: keeps a lone -0.0
        for i in range(lo, lo + n):
            total += values[i]
        return total
    if n > _PAIRWISE_BLOCK:
        half = n // 2
        half -= half % 8
        return _pairwise_sum(values, lo, half) + _pairwise_sum(values, lo + half, n - half)
    r0 = values[lo]
    r1 = values[lo + 1]
    r2 = values[lo + 2]
    r3 = values[lo + 3]
    r4 = values[lo + 4]
    r5 = values[lo + 5]
    r6 = values[lo + 6]
    r7 = values[lo + 7]
    i = lo + 8
    stop = lo + n - n % 8
    while i < stop:
        r0 += values[i]
        r1 += values[i + 1]
        r2 += values[i + 2]
        r3 += values[i + 3]
        r4 += values[i + 4]
        r5 += values[i + 5]
        r6 += values[i + 6]
        r7 += values[i + 7]
        i += 8
    total = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    for i in range(stop, lo + n):
        total += values[i]
    return total


class RowArrays(tuple):
    """A row's ``(units, durations)`` kept by the policy's row memo (rows.py): the greedy keeps
    the row's Python lists on it (:func:`_lists`), built once per action instead of per round."""

    greedy = None


def _lists(row) -> tuple | None:
    """``(minimum, durations, positive gains descending)`` of one row, as Python numbers; None
    for an empty row. A gain ``d[j] - d[j+1]`` is the float numpy's ``durs[:-1] - durs[1:]`` gives.
    """
    units, durs = row
    if not len(units):
        return None
    dl = durs.tolist()
    desc = sorted((g for g in map(operator.sub, dl, dl[1:]) if g > 0), reverse=True)
    out = (int(units[0]), dl, desc)
    if isinstance(row, RowArrays):
        row.greedy = out
    return out


class GreedyTable:
    """Same answers as :class:`~tangram.policy.arrange.PrefixTable` for the units operator when
    every row is convex: each prefix starts all its candidates at their minimum and spends the
    capacity left on the largest positive marginal gains (the first ``t`` rows' gains are a
    prefix of one concatenated array)."""

    def __init__(self, rows, capacity: int):
        self.exact_from = 0
        self._capacity = capacity
        self._cache: dict[int, tuple[float, tuple[int, ...], list[float]]] = {}
        self._rows = rows
        self._arrays_built = False
        self._by_largest = self._by_smallest = None  # rows by their largest / smallest gain, when asked
        self._merge: _Merge | None = None  # the largest-first merge of the last prefix it served
        self._lists = lists = []
        self._min_sum = min_sum = [0]
        self._pos_count = pos_count = [0]  # positive gains of the first t rows
        for r in rows:
            entry = getattr(r, "greedy", None) or _lists(r)
            if entry is None:  # an empty row (the policy hands over none): the arrays decide
                self._lists = None
                self._arrays()
                self._min_sum = self._min_sum_arr.tolist()
                return
            lists.append(entry)
            min_sum.append(min_sum[-1] + entry[0])
            pos_count.append(pos_count[-1] + len(entry[2]))
        self._min_units = [u0 for u0, _, _ in lists]  # each row at its minimum (sliced copies per prefix)
        self._at_min = [dl[0] for _, dl, _ in lists]
        self._all = None  # each row with all its positive gains, when a prefix takes them all

    def _arrays(self) -> None:
        self._arrays_built = True
        rows = self._rows
        n = len(rows)
        if not n:
            self._mins = np.zeros(0, dtype=np.int64)
            self._row_start = self._pos_end = self._min_sum_arr = np.zeros(1, dtype=np.int64)
            self._durs = self._neg_gains = np.zeros(0)
            self._owner = np.zeros(0, dtype=np.int64)
            return
        units, durs = zip(*rows)
        lens = np.fromiter(map(len, units), dtype=np.int64, count=n)
        self._row_start = np.zeros(n + 1, dtype=np.int64)  # into the flat durations
        np.cumsum(lens, out=self._row_start[1:])
        self._mins = np.concatenate(units)[self._row_start[:-1]]
        self._min_sum_arr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(self._mins, out=self._min_sum_arr[1:])
        self._durs = np.concatenate(durs)
        gains = self._durs[:-1] - self._durs[1:]
        # drop the pairs that straddle two rows, and the gains that are not gains at all
        keep = gains > 0
        keep[self._row_start[1:-1] - 1] = False
        owner = np.repeat(np.arange(n), lens)[:-1]
        self._neg_gains = -gains[keep]  # row by row, in order: a prefix of rows is a prefix here
        self._owner = owner[keep]
        self._pos_end = np.zeros(n + 1, dtype=np.int64)  # positive gains of the first t rows
        np.cumsum(np.bincount(self._owner, minlength=n), out=self._pos_end[1:])

    def feasible(self, t: int) -> bool:
        return self._min_sum[t] <= self._capacity

    def _solve(self, t: int):
        hit = self._cache.get(t)
        if hit is not None:
            return hit
        if not self.feasible(t):
            raise ValueError(f"prefix {t} has no feasible arrangement")
        out = None
        if self._lists is not None:
            out = self._solve_merge(t)
        if out is None:  # e.g. a tie at the budget's edge: numpy's choice among the tied gains decides
            out = self._solve_arrays(t)
        self._cache[t] = out
        return out

    def _solve_arrays(self, t: int):
        if not self._arrays_built:
            self._arrays()
        budget = self._capacity - int(self._min_sum[t])
        end = int(self._pos_end[t])
        starts = self._row_start[:t]
        if budget > 0 and end:
            owner = self._owner[:end]
            if end > budget:
                owner = owner[np.argpartition(self._neg_gains[:end], budget - 1)[:budget]]
            extra = np.bincount(owner, minlength=t)
            durs = self._durs[starts + extra]
            units = (self._mins[:t] + extra).tolist()
        else:
            durs = self._durs[starts]
            units = self._mins[:t].tolist()
        return float(durs.sum()), tuple(units), durs.tolist()

    def _solve_merge(self, t: int):
        """:meth:`_solve_arrays` on the rows' lists, or None where the arrays must decide (a tie at
        the budget's edge, or more gains to pick or leave than ``_MERGE_LIMIT``).

        Each row's positive gains are kept sorted, so a heap merge of the rows meets them in
        the order of the whole table: the budget largest are the first ``budget`` it pops (or
        all but the last ``end - budget`` of them). The chosen durations are summed by numpy
        itself, so the float is the arrays' own.
        """
        lists = self._lists
        budget = self._capacity - self._min_sum[t]
        end = self._pos_count[t]
        if budget <= 0 or not end:
            durs, units = self._at_min[:t], self._min_units[:t]
        elif end <= budget:  # every positive gain is taken
            durs, units = self._at_all(t)
        elif budget <= end - budget:
            if budget > _MERGE_LIMIT:
                return None
            if self._by_largest is None:
                self._by_largest = _by_first(lists, _largest_first)
            taken = self._largest(t, budget)
            if taken is None:
                return None
            durs, units = self._at_min[:t], self._min_units[:t]
            for i, x in taken.items():  # the few rows given more than their minimum
                durs[i] = lists[i][1][x]
                units[i] += x
        else:
            if end - budget > _MERGE_LIMIT:
                return None
            if self._by_smallest is None:
                self._by_smallest = _by_first(lists, _smallest_first)
            left_out = _popped(lists, end - budget, t, self._by_smallest, _smallest_first)
            if left_out is None:
                return None
            durs, units = self._at_all(t)
            for i, x in left_out.items():  # the few rows given fewer than all their positive gains
                x = len(lists[i][2]) - x
                durs[i] = lists[i][1][x]
                units[i] = lists[i][0] + x
        return _numpy_sum(durs), tuple(units), durs

    def _largest(self, t: int, n: int) -> dict[int, int] | None:
        """:func:`_popped` for the ``n`` largest gains of the first ``t`` rows, going on from the merge
        of a longer prefix: greedy eviction asks for shorter and shorter prefixes, and a shorter
        prefix's gains are the longer one's less its last rows', its budget larger by their minimums.
        So its merge is the longer one's with those rows' pops handed back, popped further."""
        merge = self._merge
        if merge is None or merge.t < t or not merge.shorten(t, n):
            merge = self._merge = _Merge(t)
        return merge.pop_to(n, self._lists, self._by_largest)

    def _at_all(self, t: int) -> tuple[list[float], list[int]]:
        """Copies of the first ``t`` rows' durations and units with every positive gain taken."""
        if self._all is None:
            self._all = ([dl[len(desc)] for _, dl, desc in self._lists],
                         [u0 + len(desc) for u0, _, desc in self._lists])
        return self._all[0][:t], self._all[1][:t]

    def best(self, t: int) -> float:
        return self._solve(t)[0] if self.feasible(t) else float("inf")

    def units(self, t: int) -> tuple[int, ...]:
        return self._solve(t)[1]

    def units_and_durations(self, t: int) -> tuple[tuple[int, ...], list[float]]:
        _, units, durs = self._solve(t)
        return units, list(durs)

    def arrangement(self, t: int) -> Arrangement | None:
        if not self.feasible(t):
            return None
        return Arrangement(self.best(t), self.units(t))


def _by_first(lists, nth) -> list[int]:
    """The rows that have positive gains, by ``-nth(desc, 0)`` descending (the order :func:`_popped`
    reads them in; ties in row order)."""
    if nth is _largest_first:  # -nth(desc, 0), without a call per row
        first = [desc[0] if desc else 0.0 for _, _, desc in lists]
    else:
        first = [-nth(desc, 0) if desc else 0.0 for _, _, desc in lists]
    rows = [i for i, (_, _, desc) in enumerate(lists) if desc]
    rows.sort(key=first.__getitem__, reverse=True)
    return rows


def _contributors(order: list[int], value, t: int, k: int) -> list[int]:
    """The rows below ``t`` whose ``value`` is among the ``k`` largest of those rows', ties included
    (``order``: rows by ``value`` descending). Only they can hold one of the k gains a merge pops
    first: a row outside has its first below k rows' first, each a gain popped before it."""
    picked: list[int] = []
    edge = None
    for i in order:
        if i >= t:
            continue
        v = value(i)
        if edge is not None and v < edge:
            break
        picked.append(i)
        if len(picked) == k:
            edge = v
    return picked


def _largest_first(desc: list[float], j: int) -> float:
    return -desc[j]  # a row's gains as a merge for the largest pops them: its j-th largest


def _smallest_first(desc: list[float], j: int) -> float:
    return desc[-1 - j]  # ... for the smallest: its j-th smallest


def _popped(lists, n: int, t: int, order: list[int], nth) -> dict[int, int] | None:
    """Per row of the first ``t`` (those with any), how many of its positive gains a heap merge of
    the rows pops first among ``n``: the ``n`` largest gains (``nth`` :func:`_largest_first`) or
    the ``n`` smallest (:func:`_smallest_first`); None when the n-th and the (n+1)-th are equal
    (the set is not unique). ``order``: the rows by ``-nth(desc, 0)``, descending."""
    rows = _contributors(order, lambda i: -nth(lists[i][2], 0), t, n)
    if len(rows) > n and nth(lists[rows[0]][2], 0) == nth(lists[rows[n]][2], 0):
        return None  # n + 1 rows share the first gain of all: the n-th and (n+1)-th are equal (twins)
    heap = [(nth(lists[i][2], 0), i) for i in rows]
    heapq.heapify(heap)
    out: dict[int, int] = {}
    last = 0.0
    for _ in range(n):
        last, i = heapq.heappop(heap)
        j = out[i] = out.get(i, 0) + 1
        desc = lists[i][2]
        if j < len(desc):
            heapq.heappush(heap, (nth(desc, j), i))
    # the (n+1)-th: the heap's top (a row outside ``rows`` has its first below the n-th)
    if heap and heap[0][0] == last:
        return None
    return out


class _Merge:
    """A heap merge of the first ``t`` rows' positive gains, largest first, that can be shortened
    to fewer rows and popped further. The rows join the heap in the order of their first gain
    (``order``), each once its first gain is at least the heap's top: then every pop is the
    largest gain left, as in a merge of all the rows at once (ties in any order: the counts
    per row are the same unless the n-th and (n+1)-th are equal, which is answered None)."""

    __slots__ = ("t", "counts", "heap", "joined", "total")

    def __init__(self, t: int) -> None:
        self.t = t
        self.counts: dict[int, int] = {}  # row -> gains popped from it
        self.heap: list[tuple[float, int]] = []  # (-its next gain, row); a row's entry outlives it when shortened
        self.joined = 0  # rows of ``order`` that joined the heap (or were passed over, being >= t)
        self.total = 0  # gains popped, of rows below t

    def shorten(self, t: int, n: int) -> bool:
        """Drop rows ``t`` and on; False when the merge already popped more than ``n`` of the rest or
        as many (the n-th would then be a pop of a row dropped now: start over)."""
        counts = self.counts
        for r in range(t, self.t):
            self.total -= counts.pop(r, 0)
        self.t = t
        return self.total < n

    def _top(self, lists, order) -> float | None:
        """The key of the next pop (heap entries of dropped rows discarded, rows joined), or None."""
        heap, t = self.heap, self.t
        while heap and heap[0][1] >= t:
            heapq.heappop(heap)
        while self.joined < len(order):
            r = order[self.joined]
            if r >= t:
                self.joined += 1
                continue
            first = -lists[r][2][0]
            if heap and first > heap[0][0]:
                break  # its first gain comes after the top, and so do all rows after it in ``order``
            heapq.heappush(heap, (first, r))
            self.joined += 1
        return heap[0][0] if heap else None

    def pop_to(self, n: int, lists, order) -> dict[int, int] | None:
        """Pop until ``n`` gains of rows below ``t`` are popped: their counts per row, or None when
        the n-th and the (n+1)-th are equal."""
        heap, counts = self.heap, self.counts
        last = None
        while self.total < n:
            last = self._top(lists, order)
            if last is None:
                return None  # fewer than n positive gains: the caller never asks for more than there are
            _, i = heapq.heappop(heap)
            j = counts[i] = counts.get(i, 0) + 1
            desc = lists[i][2]
            if j < len(desc):
                heapq.heappush(heap, (-desc[j], i))
            self.total += 1
        if last is not None and self._top(lists, order) == last:
            return None
        return dict(counts)
