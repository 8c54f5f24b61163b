"""Buddy chunks of one GPU node (paper §5.3).

A chunk is ``(start, size)`` with ``size = 2^a``, ``a`` in 0..3 and
``start % size == 0``. Allocation takes the smallest free chunk that fits,
splitting larger ones in halves; release merges free buddies back.
Among equally small chunks the caller's preference (e.g. the service is
resident there) wins, then the lowest start.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

MAX_CHUNK = 8
SIZES = (1, 2, 4, 8)


@dataclass(frozen=True, slots=True, order=True)
class Chunk:
    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size

    @property
    def devices(self) -> range:
        return range(self.start, self.end)

    def buddy(self) -> "Chunk":
        return Chunk(self.start ^ self.size, self.size)


Prefer = Callable[[Chunk], bool] | Iterable[Chunk] | None


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
        # smallest first; a chunk overlapping a preferred one next; then lowest start
        best = min(fits, key=lambda c: (c.size, not liked(c), c.start))
        self._free.remove(best)
        while best.size > size:  # split, keeping the half that overlaps a preferred chunk
            half = best.size // 2
            lo, hi = Chunk(best.start, half), Chunk(best.start + half, half)
            keep, spare = (hi, lo) if (liked(hi) and not liked(lo)) else (lo, hi)
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

    def _check(self) -> None:
        covered = 0
        for c in self._free | self._allocated:
            assert c.size in SIZES and c.start % c.size == 0, f"misaligned chunk {c}"
            covered += c.size
        assert covered == self.num_gpus, f"chunks cover {covered} of {self.num_gpus} GPUs"
        assert not (self._free & self._allocated)


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


def _preference(prefer: Prefer) -> Callable[[Chunk], bool]:
    if prefer is None:
        return lambda c: False
    if callable(prefer):
        return prefer
    chunks = [c if isinstance(c, Chunk) else Chunk(*c) for c in prefer]
    return lambda c: any(c.start < p.end and p.start < c.end for p in chunks)
