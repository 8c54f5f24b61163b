"""What the engine tells the policy about running actions: seconds left and units, per pool.

The snapshot's channel for running actions: per pool (``Snapshot.running``)
and, for GPU actions, per service (``Snapshot.running_services``).
"""
from __future__ import annotations

from typing import Iterable, Mapping


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


class RunBooks:
    """The engine's books of its running actions, per pool and per GPU service (what :class:`RunningView`
    shows), and its restartable CPU runs, each in start order: entered when a run starts, re-entered when
    it is restarted, left when it ends. One place, so a start, a restart and an end keep them alike."""

    __slots__ = ("by_pool", "by_service", "restartable")

    def __init__(self) -> None:
        self.by_pool: dict[str, dict[str, tuple[float, float, int]]] = {}  # pool -> id -> (start, est. end, units)
        self.by_service: dict[str, dict[str, tuple[float, float, int]]] = {}  # the GPU runs, by service
        self.restartable: dict[str, None] = {}  # running restartable CPU runs in start order (not a set's hash order)

    def enter(self, action, pools: Mapping[str, str], units: Mapping[str, int], now: float, estimated_end: float,
              restartable: bool) -> None:
        """``action`` started now on ``pools`` (resource type -> pool) with ``units`` (resource type -> units)."""
        for rtype, pname in pools.items():
            self.by_pool.setdefault(pname, {})[action.id] = (now, estimated_end, units[rtype])
        if action.service is not None and "gpu" in units:
            self.by_service.setdefault(action.service, {})[action.id] = (now, estimated_end, units["gpu"])
        if restartable:
            self.restartable[action.id] = None

    def restarted(self, action_id: str, pool: str, now: float, estimated_end: float, units: int) -> None:
        """A restartable run started again now on ``pool`` with ``units``: re-entered last, as a new start is
        (the ACT estimate reads a pool's runs in start order)."""
        running = self.by_pool[pool]
        del running[action_id]
        running[action_id] = (now, estimated_end, units)
        del self.restartable[action_id]
        self.restartable[action_id] = None

    def withdraw(self, action_id: str) -> None:
        """Never offer ``action_id`` for a restart again (the driver is cancelling its run: a restart would only
        start a run bound to be cancelled, and count it)."""
        self.restartable.pop(action_id, None)

    def leave(self, action_id: str, pools: Iterable[str], service: str | None) -> None:
        """The run of ``action_id`` ended (or was re-queued): out of every book it is in."""
        self.restartable.pop(action_id, None)
        for pname in pools:
            held = self.by_pool.get(pname)
            if held is not None and held.pop(action_id, None) is not None and not held:
                del self.by_pool[pname]
        held = self.by_service.get(service) if service is not None else None
        if held is not None and held.pop(action_id, None) is not None and not held:
            del self.by_service[service]
