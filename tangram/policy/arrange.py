"""DPArrange (paper Algorithm 3, DESIGN.md §4.5).

Assign each candidate one feasible unit count, minimising the sum of their
durations, subject to a topology operator:

* :class:`UnitsOperator` — ``sum(units) <= capacity`` (CPU cores of a node).
* :class:`ChunkOperator` — every count is a power of two and the whole set
  packs into the free buddy chunks (a larger chunk may be split).

Recurrence, over DP states ``s`` of the operator (units used, or the
mixed-radix encoded counts of requests per chunk size)::

    dp[0][0] = 0
    dp[i][s] = min over u in options_i, s - step(u) valid: dp[i-1][s - step(u)] + d_i(u)

Row ``i`` holds the optimum for the prefix ``C[:i]`` over every state, so the
best over all valid states of row ``t`` answers "arrange ``C[:t]``" for every
``t`` from one pass; greedy eviction reads them all. Rows are vectorised with
numpy (a min-plus product over shifted views of the previous row).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tangram.policy.greedy import Arrangement, GreedyTable, greedy_exact

CHUNK_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True, slots=True)
class UnitsOperator:
    """Interchangeable units: any set of counts whose sum fits the capacity."""

    capacity: int

    def __post_init__(self) -> None:
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, (int, np.integer)) or self.capacity < 0:
            raise ValueError(f"capacity: must be a non-negative integer, got {self.capacity!r}")


@dataclass(frozen=True, slots=True)
class ChunkOperator:
    """Free buddy chunks (sizes 1, 2, 4 or 8); requests must be powers of two."""

    free_chunks: tuple[int, ...]

    def __init__(self, free_chunks: Sequence[int]):
        chunks = tuple(int(c) for c in free_chunks)
        for c in chunks:
            if c not in CHUNK_SIZES:
                raise ValueError(f"free_chunks: chunk sizes must be 1, 2, 4 or 8, got {c}")
        object.__setattr__(self, "free_chunks", chunks)

    @property
    def capacity(self) -> int:
        return sum(self.free_chunks)


def packable(free_chunks: Sequence[int], requests: Sequence[int]) -> bool:
    """Whether power-of-two ``requests`` fit in the free buddy chunks.

    Largest request first, each into the smallest free chunk that holds it,
    splitting as the buddy allocator does; for power-of-two sizes this greedy
    packing is exact, and it is what :class:`BuddyAllocator` does when the
    engine applies a plan largest-first.
    """
    avail = {s: 0 for s in CHUNK_SIZES}
    for c in free_chunks:
        avail[c] += 1
    for r in sorted(requests, reverse=True):
        if not pack_one(avail, r):
            return False
    return True


def pack_one(avail: dict[int, int], r: int) -> bool:
    """Take ``r`` units from chunk counts ``avail`` in place (best fit, with splits)."""
    for c in CHUNK_SIZES:
        if c >= r and avail.get(c, 0) > 0:
            avail[c] -= 1
            half = c // 2
            while half >= r:  # the buddies split off stay free
                avail[half] = avail.get(half, 0) + 1
                half //= 2
            return True
    return False


# --------------------------------------------------------------------------- #
# option tables


def _option_arrays(options: Sequence[Mapping[int, float]], allowed) -> list[tuple[np.ndarray, np.ndarray]]:
    rows = []
    for i, opts in enumerate(options):
        units, durs = [], []
        for u, d in opts.items():
            if isinstance(u, bool) or not isinstance(u, (int, np.integer)) or u < 1:
                raise ValueError(f"options[{i}]: unit counts must be integers >= 1, got {u!r}")
            d = float(d)
            if not (d > 0) or math.isinf(d):
                raise ValueError(f"options[{i}][{u}]: duration must be positive and finite, got {d!r}")
            if allowed(int(u)):
                units.append(int(u))
                durs.append(d)
        order = np.argsort(units)
        rows.append((np.asarray(units, dtype=np.int64)[order], np.asarray(durs, dtype=np.float64)[order]))
    return rows


# --------------------------------------------------------------------------- #
# the DP, one pass for every prefix


class PrefixTable:
    """DP over every prefix; ``best(t)`` and ``units(t)`` answer for ``C[:t]``.

    ``choice(i, s)`` tells which count candidate ``i`` got in DP state ``s``
    (stored, or recomputed from the kept rows on the backtracking path only);
    ``step_of(u)`` is the state offset of ``u`` units.
    """

    def __init__(self, totals: np.ndarray, end_states: np.ndarray, choice, step_of, exact_from: int = 0,
                 dp: np.ndarray | None = None):
        self.exact_from = exact_from  # prefixes shorter than this were pruned away
        self._dp = dp  # dp[i, s], when the operator keeps its rows (units)
        self._totals = totals  # best total per prefix length (index 0 = empty prefix)
        self._ends = end_states  # state index achieving it
        self._choice = choice
        self._step_of = step_of

    def feasible(self, t: int) -> bool:
        if t < self.exact_from:
            raise ValueError(f"prefix {t} is shorter than the pruned table's bound {self.exact_from}")
        return bool(np.isfinite(self._totals[t]))

    def best(self, t: int) -> float:
        return float(self._totals[t])

    def units(self, t: int) -> tuple[int, ...]:
        if not self.feasible(t):
            raise ValueError(f"prefix {t} has no feasible arrangement")
        s = int(self._ends[t])
        out = [0] * t
        for i in range(t - 1, -1, -1):
            u = self._choice(i, s)
            out[i] = u
            s -= self._step_of(u)
        return tuple(out)

    def units_and_durations(self, t: int) -> tuple[tuple[int, ...], list[float] | None]:
        """``units(t)`` and, when the rows are kept, each candidate's duration on the path
        (read off the DP as ``dp[i+1][s] - dp[i][s-u]``, no re-evaluation of the model)."""
        units = self.units(t)
        if self._dp is None:
            return units, None
        dp, s, out = self._dp, int(self._ends[t]), [0.0] * t
        for i in range(t - 1, -1, -1):
            prev = s - self._step_of(units[i])
            out[i] = float(dp[i + 1, s] - dp[i, prev])
            s = prev
        return units, out

    def arrangement(self, t: int) -> Arrangement | None:
        if not self.feasible(t):
            return None
        return Arrangement(self.best(t), self.units(t))


def _units_table(rows, capacity: int, min_prefix: int = 0) -> PrefixTable:
    """Units DP; rows ``i < min_prefix - 1`` keep only states that can still
    extend to a prefix of length ``min_prefix`` (the later candidates' minimums
    must fit too), which is exact for every prefix ``t >= min_prefix``."""
    n = len(rows)
    width = capacity + 1
    rows = [(u, d) if (len(u) == 0 or u[-1] <= capacity) else (u[u <= capacity], d[u <= capacity]) for u, d in rows]
    maxu = max((int(u[-1]) for u, _ in rows if len(u)), default=1)
    # buf[maxu + j] = dp[i-1][j]; windows[j, w] = buf[j + w], so column maxu-u reads dp[i-1][j-u]
    buf = np.full(maxu + width, np.inf)
    windows = sliding_window_view(buf, maxu + 1)[:width]
    dp = np.full((n + 1, width), np.inf)
    dp[0, 0] = 0.0
    choices = np.zeros((n, width), dtype=np.int64)
    arange = np.arange(width)
    mins = [int(u[0]) if len(u) else capacity + 1 for u, _ in rows]
    # hi[i]: the largest state of row i+1 from which C[i+1:min_prefix] still fits
    hi = [capacity] * n
    tail = 0
    for i in range(min(min_prefix, n) - 2, -1, -1):
        tail += mins[i + 1]
        hi[i] = capacity - tail
    lo = 0  # states below the sum of minimums are unreachable
    for i, (units, durs) in enumerate(rows):
        lo += mins[i]
        top = hi[i] + 1
        if top <= lo:
            break  # the minimums alone overflow: no longer prefix is feasible
        buf[maxu:] = dp[i]
        cand = windows[lo:top, maxu - units] + durs
        arg = cand.argmin(axis=1)
        dp[i + 1, lo:top] = cand[arange[: top - lo], arg]
        choices[i, lo:top] = units[arg]
    ends = dp.argmin(axis=1)
    totals = dp[arange[: n + 1] if n + 1 <= width else np.arange(n + 1), ends]
    return PrefixTable(totals, ends, lambda i, s: int(choices[i, s]), lambda u: u, min_prefix, dp)


# --------------------------------------------------------------------------- #
# the units operator's fast path: greedy marginal allocation


def _units_prefix(rows, capacity: int, min_prefix: int = 0, convex: bool | None = None, clipped: bool = False):
    """The units operator: greedy when it is exact for every row, the DP otherwise.

    ``convex`` True: the caller knows every row passes :func:`greedy_exact`;
    ``clipped``: and no row offers more than ``capacity`` (nothing to cut).
    """
    if clipped and convex:
        return GreedyTable(rows, capacity)
    clipped = [(u, d) if (len(u) == 0 or u[-1] <= capacity) else (u[u <= capacity], d[u <= capacity]) for u, d in rows]
    if all(len(u) for u, _ in clipped) and (convex or (convex is None and all(greedy_exact(u, d) for u, d in clipped))):
        return GreedyTable(clipped, capacity)
    return _units_table(rows, capacity, min_prefix)


class _ChunkStates:
    """Mixed-radix encoding of request counts per chunk size (Algorithm 4).

    A state ``(a1, a2, a4, a8)`` counts the candidates given 1, 2, 4, 8 GPUs;
    it is valid only if those requests actually pack into the free chunks.
    Validity is downward closed, so masking each DP row is enough.
    """

    def __init__(self, free_chunks: Sequence[int], n: int):
        cap = sum(free_chunks)
        self.bounds = tuple(min(n, cap // s) for s in CHUNK_SIZES)
        radix = [b + 1 for b in self.bounds]
        self.strides = (1, radix[0], radix[0] * radix[1], radix[0] * radix[1] * radix[2])
        self.size = radix[0] * radix[1] * radix[2] * radix[3]
        grid = np.indices(radix).reshape(4, -1)  # grid[k, idx] is the count of size k, C-order
        # C-order indices enumerate the last axis fastest; re-encode with our strides
        codes = sum(grid[k] * self.strides[k] for k in range(4))
        counts = np.zeros((4, self.size), dtype=np.int64)
        counts[:, codes] = grid
        self.counts = counts
        # Divisible sizes: the requests pack iff, for every size s, those of
        # size >= s fit in the part of the free chunks usable at granularity s.
        self.valid = np.ones(self.size, dtype=bool)
        for k, s in enumerate(CHUNK_SIZES):
            need = sum(counts[j] * CHUNK_SIZES[j] for j in range(k, 4))
            usable = sum((c // s) * s for c in free_chunks)
            self.valid &= need <= usable

    def step(self, units: int) -> int:
        return self.strides[CHUNK_SIZES.index(units)]


@lru_cache(maxsize=256)
def _chunk_states(free_chunks: tuple[int, ...], n: int) -> _ChunkStates:
    return _ChunkStates(free_chunks, n)


def _chunk_table(rows, free_chunks: Sequence[int]) -> PrefixTable:
    n = len(rows)
    st = _chunk_states(tuple(sorted(free_chunks)), n)
    prev = np.full(st.size, np.inf)
    prev[0] = 0.0
    totals = np.full(n + 1, np.inf)
    ends = np.zeros(n + 1, dtype=np.int64)
    totals[0] = 0.0
    choices = np.zeros((n, st.size), dtype=np.int32)
    has = {s: st.counts[k] >= 1 for k, s in enumerate(CHUNK_SIZES)}
    for i, (units, durs) in enumerate(rows):
        cur = np.full(st.size, np.inf)
        choice = np.zeros(st.size, dtype=np.int32)
        for u, d in zip(units.tolist(), durs.tolist()):
            if st.bounds[CHUNK_SIZES.index(u)] == 0:
                continue
            stride = st.step(u)
            shifted = np.full(st.size, np.inf)
            shifted[stride:] = prev[:-stride] + d
            shifted[~has[u]] = np.inf  # no borrow from the next digit
            better = shifted < cur
            cur[better] = shifted[better]
            choice[better] = u
        cur[~st.valid] = np.inf
        choices[i] = choice
        prev = cur
        j = int(np.argmin(cur))
        totals[i + 1] = cur[j]
        ends[i + 1] = j
        if not np.isfinite(cur[j]):
            break
    return PrefixTable(totals, ends, lambda i, s: int(choices[i, s]), st.step)


def _is_pow2_chunk(u: int) -> bool:
    return u in CHUNK_SIZES


def prefix_table(options: Sequence[Mapping[int, float]], operator: UnitsOperator | ChunkOperator) -> PrefixTable:
    """Solve DPArrange for every prefix of ``options`` at once."""
    if isinstance(operator, UnitsOperator):
        rows = _option_arrays(options, lambda u: True)
        return _units_prefix(rows, int(operator.capacity))
    if isinstance(operator, ChunkOperator):
        return _chunk_table(_option_arrays(options, _is_pow2_chunk), operator.free_chunks)
    raise TypeError(f"operator: expected UnitsOperator or ChunkOperator, got {type(operator).__name__}")


def prefix_table_rows(
    rows: Sequence[tuple[np.ndarray, np.ndarray]],
    operator: UnitsOperator | ChunkOperator,
    min_prefix: int = 0,
    convex: bool | None = None,
    clipped: bool = False,
) -> PrefixTable | GreedyTable:
    """:func:`prefix_table` over already validated rows ``(units ascending, durations)``.

    The policy's hot path: it builds the rows with numpy from the action
    model instead of going through per-option dicts. With ``min_prefix`` the
    units DP prunes states that cannot reach that prefix; the table is then
    exact only for prefixes ``t >= min_prefix`` (greedy eviction asks for the
    longest prefixes first and rebuilds with a smaller bound if it goes on).
    """
    if isinstance(operator, UnitsOperator):
        return _units_prefix(rows, int(operator.capacity), min_prefix, convex, clipped)
    keep = [np.isin(u, CHUNK_SIZES) for u, _ in rows]
    return _chunk_table([(u[k], d[k]) for (u, d), k in zip(rows, keep)], operator.free_chunks)


def arrange(options: Sequence[Mapping[int, float]], operator: UnitsOperator | ChunkOperator) -> Arrangement | None:
    """Optimal arrangement of all candidates over every total <= capacity, or None."""
    options = list(options)
    return prefix_table(options, operator).arrangement(len(options))
