"""What the engine tells the policy about running actions: seconds left and units, per pool.

The snapshot's channel for running actions: per pool (``Snapshot.running``)
and, for GPU actions, per service (``Snapshot.running_services``).
"""
from __future__ import annotations

from typing import Mapping


def _seconds_left(started: float, estimated_end: float, now: float) -> float:
    """Expected time left of a running action.

    Past its estimate, an action is assumed to run half as long again as it
    has so far (the longer it ran, the longer it is likely to run), rather
    than "any moment now", which would make waiting for it look free.
    """
    if estimated_end > now:
        return estimated_end - now
    return 0.5 * (now - started)


class RunningView(Mapping[str, tuple[tuple[float, int], ...]]):
    """pool (or service) -> ``(seconds left, units)`` of its running actions, computed on demand.

    The policy reads it only for the pools it arranges elastically; building
    it for every pool on every round cost more than the round itself.
    """

    __slots__ = ("_by_pool", "_now")

    def __init__(self, by_pool: dict[str, dict[str, tuple[float, float, int]]], now: float):
        self._by_pool = by_pool
        self._now = now

    def __getitem__(self, pool: str) -> tuple[tuple[float, int], ...]:
        now = self._now
        # _seconds_left, inlined: a round reads every running action of each pool it arranges
        return tuple([(e - now if e > now else 0.5 * (now - b), u) for b, e, u in self._by_pool[pool].values()])

    def ids(self, pool: str) -> tuple[str, ...]:
        """The ids of ``pool``'s running actions, in start order (none: empty)."""
        running = self._by_pool.get(pool)
        return tuple(running) if running is not None else ()

    def get(self, pool: str, default=None):  # Mapping.get goes through a try/except per call
        return self[pool] if pool in self._by_pool else default

    def __iter__(self):
        return iter(self._by_pool)

    def __len__(self) -> int:
        return len(self._by_pool)
