"""The one interface through which the engine talks to every manager.

A manager owns some pools (``cpu@node0``, ``mem@node0``, ``gpu@node1``,
``api:search``). It reports their state, applies the grants of a plan and
takes them back. It never chooses: the policy decided what fits, so a grant
that does not fit is a bug (an exception), and "does not fit now" never
reaches a manager. ``free + allocated == capacity`` holds for every pool.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Iterable, Mapping

from tangram.core.errors import invariant
from tangram.core.grants import Grant
from tangram.core.model import Action
from tangram.managers.buddy import BuddyAllocator, Chunk
from tangram.core.pools import PoolState


class AllocationError(RuntimeError):
    """A grant the manager cannot honour: the policy and the manager disagree."""


class ResourceManager(ABC):
    """Accounting of a set of pools; subclasses add the real mechanism."""

    @abstractmethod
    def pool_states(self) -> Iterable[PoolState]:
        """The current state of every pool this manager owns."""

    @abstractmethod
    def allocate(self, pool: str, units: int, holder: str, action: Action | None = None) -> Grant:
        """Take ``units`` of ``pool`` for ``holder``; returns the grant (cores, a chunk or a count)."""

    @abstractmethod
    def release(self, pool: str, holder: str) -> bool:
        """Give back what ``holder`` holds in ``pool``; idempotent (False if nothing was held)."""

    def regrant(self, pool: str, units: int, holder: str, held: int, action: Action | None = None) -> Grant:
        """Change ``holder``'s ``held`` units of ``pool`` to ``units`` (a restart at another DoP), or raise
        AllocationError with the books unchanged. Here: release, then allocate (a count has no
        identity). A manager whose grants name real units keeps the held ones (CpuManager: the run
        being killed still uses them, so none may go to another action meanwhile)."""
        free = next((p.free for p in self.pool_states() if p.name == pool), None)
        if free is None or units - held > free:
            raise AllocationError(f"{pool}: {units} units requested in place of {held}, {free} free")
        self.release(pool, holder)
        return self.allocate(pool, units, holder, action)

    @abstractmethod
    def check_invariants(self) -> None:
        """Raise AssertionError if any pool's books do not balance."""

    def next_wakeup(self, now: float) -> float | None:
        """When the pools change on their own (a quota period refills), if ever."""
        return None

    def refilled_unseen(self, now: float) -> bool:
        """Whether pools gained units on their own since the engine last read them (a round is due
        now, though :meth:`next_wakeup`'s time for it has passed)."""
        return False

    def held(self) -> Mapping[str, Mapping[str, Any]]:
        """pool -> holder -> grant, for leak checks."""
        return {}


class CountingManager(ResourceManager):
    """Plain counters per pool, and buddy chunks for pools named ``gpu@...``.

    Enough for the engine's tests and for simulated hardware; the real CPU,
    GPU and API managers add core sets, service caches and quotas.
    """

    def __init__(self, capacities: Mapping[str, int]):
        self._capacity: dict[str, int] = {}
        self._holders: dict[str, dict[str, Any]] = {}
        self._used: dict[str, int] = {}
        self._buddies: dict[str, BuddyAllocator] = {}
        for name, cap in capacities.items():
            if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
                raise ValueError(f"capacities[{name!r}]: must be a non-negative integer, got {cap!r}")
            self._capacity[name] = cap
            self._holders[name] = {}
            self._used[name] = 0
            if name.startswith("gpu@"):
                self._buddies[name] = BuddyAllocator(cap)

    def pool_states(self) -> Iterable[PoolState]:
        for name, cap in self._capacity.items():
            rtype, _, node = name.partition("@")
            buddy = self._buddies.get(name)
            yield PoolState(
                name=name,
                rtype=rtype,
                node=node or None,
                capacity=cap,
                free=cap - self._used[name],
                chunks=tuple(c.size for c in buddy.free_chunks()) if buddy else None,
            )

    def allocate(self, pool: str, units: int, holder: str, action: Action | None = None) -> Any:
        if pool not in self._capacity:
            raise AllocationError(f"unknown pool {pool!r}")
        if holder in self._holders[pool]:
            raise AllocationError(f"{holder} already holds units of {pool}")
        if self._used[pool] + units > self._capacity[pool]:
            raise AllocationError(f"{pool}: {units} units requested, {self._capacity[pool] - self._used[pool]} free")
        grant: Any = units
        buddy = self._buddies.get(pool)
        if buddy is not None:
            grant = buddy.allocate(units)
            if grant is None:
                raise AllocationError(f"{pool}: no free chunk of {units} GPUs")
        self._holders[pool][holder] = grant
        self._used[pool] += units
        return grant

    def release(self, pool: str, holder: str) -> bool:
        grant = self._holders.get(pool, {}).pop(holder, None)
        if grant is None:
            return False
        if isinstance(grant, Chunk):
            self._buddies[pool].release(grant)
            self._used[pool] -= grant.size
        else:
            self._used[pool] -= grant
        return True

    def check_invariants(self) -> None:
        for name, cap in self._capacity.items():
            held = sum(g.size if isinstance(g, Chunk) else g for g in self._holders[name].values())
            invariant(held == self._used[name], f"{name}: holders have {held}, books say {self._used[name]}")
            invariant(0 <= self._used[name] <= cap, f"{name}: used {self._used[name]} of {cap}")
            buddy = self._buddies.get(name)
            if buddy is not None:
                invariant(buddy.free_devices == cap - self._used[name], f"{name}: buddy disagrees")

    def held(self) -> Mapping[str, Mapping[str, Any]]:
        return {p: dict(h) for p, h in self._holders.items()}
