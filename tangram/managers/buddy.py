"""Buddy chunks of one GPU node (paper §5.3).

A chunk is ``(start, size)`` with ``size = 2^a``, ``a`` in 0..3 and
``start % size == 0``. Allocation takes the smallest free chunk that fits,
splitting larger ones in halves; release merges free buddies back.
Among equally small chunks the caller's preference (e.g. the service is
resident there) wins, then the lowest start.

Why best fit is enough: sizes divide each other, so a set of requests packs
iff, for every size ``s``, the requests of size ``>= s`` fit in the free
space usable at granularity ``s``; taking the smallest chunk that fits keeps
every one of those margins as large as any other choice would, so the
allocator places any packable set in *any* order (tests/test_buddy.py checks
this against :func:`tangram.policy.arrange.packable` by brute force).
"""
from __future__ import annotations

from typing import Callable, Iterable

from tangram.core.errors import invariant
from tangram.core.grants import Chunk  # re-exported: the grant of a GPU pool

MAX_CHUNK = 8
SIZES = (1, 2, 4, 8)


# A predicate or a score (higher wins; bool counts as 0/1), or the chunks to overlap.
Prefer = Callable[[Chunk], "bool | float"] | Iterable[Chunk] | None


class BuddyAllocator:
    """Free/allocated buddy chunks over ``num_gpus`` devices."""

    def __init__(self, num_gpus: int):
        if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 0:
            raise ValueError(f"num_gpus: must be a non-negative integer, got {num_gpus!r}")
        self.num_gpus = num_gpus
        self._free: set[Chunk] = set(_initial_chunks(num_gpus))
        self._allocated: set[Chunk] = set()
        self._roots = frozenset(self._free)  # chunks never merged past these
        self._check()

    # -- queries ---------------------------------------------------------- #

    def free_chunks(self) -> list[Chunk]:
        return sorted(self._free)

    def allocated(self) -> list[Chunk]:
        return sorted(self._allocated)

    @property
    def free_devices(self) -> int:
        return sum(c.size for c in self._free)

    # -- mutation --------------------------------------------------------- #

    def allocate(self, size: int, prefer: Prefer = None) -> Chunk | None:
        """The smallest free chunk holding ``size`` devices, split to fit; None if none."""
        if size not in SIZES:
            raise ValueError(f"size: must be 1, 2, 4 or 8, got {size!r}")
        fits = [c for c in self._free if c.size >= size]
        if not fits:
            return None
        liked = _preference(prefer)
        # smallest first (never trade size for affinity: that would fragment);
        # the most preferred next; then the lowest start
        best = min(fits, key=lambda c: (c.size, -liked(c), c.start))
        self._free.remove(best)
        while best.size > size:  # split, keeping the better half (low one on a tie)
            half = best.size // 2
            lo, hi = Chunk(best.start, half), Chunk(best.start + half, half)
            keep, spare = (hi, lo) if liked(hi) > liked(lo) else (lo, hi)
            self._free.add(spare)
            best = keep
        self._allocated.add(best)
        self._check()
        return best

    def release(self, chunk: Chunk) -> bool:
        """Free ``chunk`` and merge buddies; idempotent (False if it was not allocated)."""
        if chunk not in self._allocated:
            return False
        self._allocated.remove(chunk)
        c = chunk
        while c not in self._roots:
            b = c.buddy()
            if b not in self._free:
                break
            self._free.remove(b)
            c = Chunk(min(c.start, b.start), c.size * 2)
        self._free.add(c)
        self._check()
        return True

    def check(self) -> None:
        """Assert the invariants: aligned chunks tile the devices exactly once; free buddies are merged."""
        self._check()

    def _check(self) -> None:
        owner = [0] * self.num_gpus
        for c in self._free | self._allocated:
            if c.size not in SIZES or c.start % c.size != 0:
                raise AssertionError(f"misaligned chunk {c}")
            if c.end > self.num_gpus:
                raise AssertionError(f"chunk {c} past the last of {self.num_gpus} GPUs")
            for d in c.devices:
                owner[d] += 1
        if not all(n == 1 for n in owner):
            raise AssertionError(f"chunks do not tile the GPUs exactly once: {owner}")
        invariant(not (self._free & self._allocated), "a chunk is both free and allocated")
        for c in self._free:  # a free chunk whose buddy is free too should have been merged
            if c not in self._roots and c.buddy() in self._free:
                raise AssertionError(f"unmerged free buddies {c}, {c.buddy()}")


def _initial_chunks(n: int) -> list[Chunk]:
    """Aligned power-of-two chunks covering 0..n-1, largest first."""
    out, start = [], 0
    while start < n:
        size = MAX_CHUNK
        while size > 1 and (start % size or start + size > n):
            size //= 2
        out.append(Chunk(start, size))
        start += size
    return out


def _preference(prefer: Prefer) -> Callable[[Chunk], float]:
    if prefer is None:
        return lambda c: 0
    if callable(prefer):
        return lambda c: float(prefer(c))
    chunks = [c if isinstance(c, Chunk) else Chunk(*c) for c in prefer]
    return lambda c: float(any(c.start < p.end and p.start < c.end for p in chunks))
