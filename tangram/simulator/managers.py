"""Simulated hardware behind the engine's manager interface.

Tangram itself runs on the real managers (``BasicManager`` for API pools,
``GpuManager`` for evict-on-execution); these are only what the simulator
needs besides them:

* :class:`CachedCountingManager` — CPU cores and memory as plain counters,
  with pool states rebuilt only when a pool changes (the engine asks for all
  of them every round).
* :class:`SimGpuManager` — the ``serverless`` baseline's GPUs: buddy chunks
  plus one model per GPU (loading a model evicts whatever was there), cold
  loads from disk, and no residency affinity.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from tangram.core.grants import restore_seconds
from tangram.core.model import Action
from tangram.managers.base import AllocationError, CountingManager
from tangram.managers.buddy import Chunk
from tangram.core.pools import PoolState


class CachedCountingManager(CountingManager):
    """A CountingManager that rebuilds a pool's state only after it changed.

    The engine asks every manager for every pool's state on each scheduling
    round; at cluster scale (dozens of pools, 10^5 rounds) rebuilding
    unchanged frozen states dominates the simulator's time.
    """

    def __init__(self, capacities: Mapping[str, int]):
        super().__init__(capacities)
        self._cache: dict[str, PoolState] = {p.name: p for p in super().pool_states()}

    def pool_states(self) -> Iterable[PoolState]:
        return self._cache.values()

    def _refresh(self, pool: str) -> None:
        for p in super().pool_states():
            if p.name == pool:
                self._cache[pool] = p
                return

    def _refresh_fast(self, pool: str) -> None:
        old = self._cache[pool]
        if old.chunks is not None:
            self._refresh(pool)
        else:
            self._cache[pool] = PoolState(name=old.name, rtype=old.rtype, node=old.node, capacity=old.capacity,
                                          free=old.capacity - self._used[pool])

    def allocate(self, pool: str, units: int, holder: str, action: Action | None = None) -> Any:
        grant = super().allocate(pool, units, holder, action)
        self._refresh_fast(pool)
        return grant

    def release(self, pool: str, holder: str) -> bool:
        done = super().release(pool, holder)
        if done:
            self._refresh_fast(pool)
        return done


@dataclass(slots=True)
class _Instance:
    service: str
    start: int
    dop: int
    gb_per_gpu: float
    last_used: float


class SimGpuManager(CountingManager):
    """Buddy chunks plus a per-GPU service cache; reports restore seconds per grant."""

    def __init__(self, capacities: Mapping[str, int], *, gpu_mem_gb: float, sizes_gb: Mapping[str, float],
                 restore_gbps: float, clock: Callable[[], float], exclusive: bool = False, affinity: bool = True):
        super().__init__(capacities)
        self._mem = gpu_mem_gb
        self._sizes = dict(sizes_gb)
        self._bw = restore_gbps
        self._clock = clock
        self._exclusive = exclusive
        self._affinity = affinity
        self._resident: dict[str, list[_Instance]] = {p: [] for p in capacities}
        self._restore: dict[str, float] = {}
        self.restores = 0
        self.hits = 0

    def pool_states(self) -> Iterable[PoolState]:
        for p in super().pool_states():
            res = self._resident.get(p.name)
            if res and self._affinity:
                p = PoolState(name=p.name, rtype=p.rtype, node=p.node, capacity=p.capacity, free=p.free,
                              chunks=p.chunks, resident=frozenset(i.service for i in res))
            yield p

    def allocate(self, pool: str, units: int, holder: str, action: Action | None = None) -> Any:
        service = action.service if action is not None else None
        if pool not in self._buddies or service is None:
            return super().allocate(pool, units, holder, action)
        if pool not in self._capacity:
            raise AllocationError(f"unknown pool {pool!r}")
        if holder in self._holders[pool]:
            raise AllocationError(f"{holder} already holds units of {pool}")
        res = self._resident[pool]
        prefer = None
        if self._affinity:
            mine = [i for i in res if i.service == service and i.dop == units]
            if mine:
                prefer = lambda c: any(c.start <= i.start and i.start + i.dop <= c.start + c.size for i in mine)  # noqa: E731
        chunk = self._buddies[pool].allocate(units, prefer=prefer)
        if chunk is None:
            raise AllocationError(f"{pool}: no free chunk of {units} GPUs")
        self._holders[pool][holder] = chunk
        self._used[pool] += units
        self._restore[holder] = self._touch(pool, chunk, service)
        return chunk

    def _touch(self, pool: str, chunk: Chunk, service: str) -> float:
        now = self._clock()
        res = self._resident[pool]
        for i in res:
            if i.service == service and i.start == chunk.start and i.dop == chunk.size:
                i.last_used = now
                self.hits += 1
                return 0.0
        need = self._sizes[service] / chunk.size
        lo, hi = chunk.start, chunk.start + chunk.size

        def overlaps(i: _Instance) -> bool:
            return i.start < hi and lo < i.start + i.dop

        if self._exclusive:
            res[:] = [i for i in res if not overlaps(i)]
        else:
            # evict least recently used instances on these GPUs until the weights fit on every one
            for i in sorted((i for i in res if overlaps(i)), key=lambda i: i.last_used):
                used = max(sum(j.gb_per_gpu for j in res if j.start <= g < j.start + j.dop) for g in range(lo, hi))
                if used + need <= self._mem:
                    break
                res.remove(i)
        res.append(_Instance(service, chunk.start, chunk.size, need, now))
        self.restores += 1
        return restore_seconds(need * 1024, self._bw)  # every GPU of the chunk loads its shard in parallel

    def take_restore_s(self, holder: str) -> float:
        return self._restore.pop(holder, 0.0)
