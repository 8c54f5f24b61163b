"""Simulated hardware behind the engine's manager interface.

* :class:`SimApiManager` — API pools with a concurrency limit and/or a quota
  per period (fixed windows on the virtual clock); ``next_wakeup`` is the next
  refill, so the simulator ticks the engine then.
* :class:`SimGpuManager` — buddy chunks (the CountingManager's) plus a small
  LRU service cache per GPU: evict-on-execution (several services resident,
  least recently used evicted until the weights fit, restore from pinned CPU
  memory) or the serverless variant (one model per GPU, cold load from disk,
  no affinity). It stands in for ``tangram/managers/gpu.py`` in the simulator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from tangram.core.model import Action
from tangram.managers.base import AllocationError, CountingManager, ResourceManager
from tangram.managers.buddy import Chunk
from tangram.policy.snapshot import PoolState


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


class SimApiManager(ResourceManager):
    """Concurrency slots and per-period quotas on a virtual clock."""

    def __init__(self, pools: Mapping[str, tuple[int | None, int | None, float]], clock: Callable[[], float]):
        self._clock = clock
        self._conc: dict[str, int | None] = {}
        self._quota: dict[str, int | None] = {}
        self._period: dict[str, float] = {}
        self._window: dict[str, int] = {}
        self._used_in_window: dict[str, int] = {}
        self._holders: dict[str, dict[str, int]] = {}
        for name, (conc, quota, period) in pools.items():
            self._conc[name], self._quota[name], self._period[name] = conc, quota, period
            self._window[name] = 0
            self._used_in_window[name] = 0
            self._holders[name] = {}

    def _roll(self, name: str, now: float) -> None:
        w = int(now // self._period[name])
        if w != self._window[name]:
            self._window[name] = w
            self._used_in_window[name] = 0

    def _free(self, name: str) -> tuple[int, int]:
        self._roll(name, self._clock())
        conc, quota = self._conc[name], self._quota[name]
        in_flight = sum(self._holders[name].values())
        cap = conc if conc is not None else quota
        free_c = conc - in_flight if conc is not None else math.inf
        free_q = quota - self._used_in_window[name] if quota is not None else math.inf
        return cap, int(min(free_c, free_q))

    def pool_states(self) -> Iterable[PoolState]:
        for name in self._conc:
            cap, free = self._free(name)
            yield PoolState(name=name, rtype=name, node=None, capacity=cap, free=max(free, 0))

    def allocate(self, pool: str, units: int, holder: str, action: Action | None = None) -> Any:
        if pool not in self._conc:
            raise AllocationError(f"unknown pool {pool!r}")
        _, free = self._free(pool)
        if units > free:
            raise AllocationError(f"{pool}: {units} requested, {free} free")
        self._holders[pool][holder] = units
        self._used_in_window[pool] += units
        return units

    def release(self, pool: str, holder: str) -> bool:
        return self._holders.get(pool, {}).pop(holder, None) is not None

    def check_invariants(self) -> None:
        for name, conc in self._conc.items():
            held = sum(self._holders[name].values())
            assert conc is None or held <= conc, f"{name}: {held} in flight > {conc}"

    def next_wakeup(self, now: float) -> float | None:
        times = []
        for name, quota in self._quota.items():
            if quota is not None and self._used_in_window[name] > 0:
                self._roll(name, now)
                if self._used_in_window[name] > 0:
                    times.append((self._window[name] + 1) * self._period[name])
        return min(times) if times else None

    def held(self) -> Mapping[str, Mapping[str, Any]]:
        return {p: dict(h) for p, h in self._holders.items()}


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
        return need / self._bw  # every GPU of the chunk loads its shard in parallel

    def take_restore_s(self, holder: str) -> float:
        return self._restore.pop(holder, 0.0)
