"""GPU manager: buddy chunks per node plus the evict-on-execution service cache.

Pools are ``gpu@<node>``; a grant is the :class:`Chunk` of devices the action
owns exclusively until it is released. An action that names a ``service``
(a model) runs it at DoP = chunk size, i.e. as service ``f"{model}@dop{k}"``;
the manager prefers, among equally small free chunks, one where that service
is already resident (then one where it fits without evicting anything), and
asks the node's :class:`ServiceCache` for the hit/miss decision and the LRU
evictions. The executor reads that decision with :meth:`GpuManager.lease`,
does the moving, and confirms the restore with :meth:`GpuManager.restored`.

Mechanism only: the policy chose the DoP and the node; "does not fit" never
reaches here, so a grant that cannot be honoured is an :class:`AllocationError`,
raised after giving back everything taken on the way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from tangram.core.errors import invariant
from tangram.core.model import Action
from tangram.managers.base import AllocationError, ResourceManager
from tangram.managers.buddy import SIZES, BuddyAllocator, Chunk
from tangram.managers.gpu_warm import warm_plan
from tangram.managers.service_cache import CacheDecision, ModelSpec, ServiceCache, service_name
from tangram.core.pools import PoolState

__all__ = ["BuddyAllocator", "Chunk", "GpuManager", "GpuNode", "ModelSpec", "CacheDecision", "service_name"]


@dataclass(frozen=True, slots=True)
class GpuNode:
    """One GPU node: ``num_gpus`` devices of ``memory_mb_per_gpu`` MiB each."""

    name: str
    num_gpus: int
    memory_mb_per_gpu: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "@" in self.name:
            raise ValueError(f"name: a non-empty node name without '@', got {self.name!r}")
        for f in ("num_gpus", "memory_mb_per_gpu"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{f}: must be a non-negative integer, got {v!r}")

    @property
    def pool(self) -> str:
        return f"gpu@{self.name}"


class GpuManager(ResourceManager):
    """Buddy chunks and a service cache per GPU node."""

    def __init__(self, nodes: Iterable[GpuNode], models: Iterable[ModelSpec] = (), *,
                 unknown_model_mb: int | None = 0):
        self.nodes: dict[str, GpuNode] = {}
        self._buddy: dict[str, BuddyAllocator] = {}
        self._cache: dict[str, ServiceCache] = {}
        self._holders: dict[str, dict[str, Chunk]] = {}
        self._warming: set[str] = set()  # the holders that are a warm start's loads (warm)
        self._stopping: set[str] = set()  # chunks kept from holders whose host has not stopped yet (detain)
        self._detained = 0
        self._restores: dict[str, _RestoreBooks] = {}  # pool -> its restores, by what asked for them
        models = list(models)
        for node in nodes:
            if node.pool in self.nodes:
                raise ValueError(f"nodes: {node.name!r} listed twice")
            self.nodes[node.pool] = node
            self._buddy[node.pool] = BuddyAllocator(node.num_gpus)
            self._cache[node.pool] = ServiceCache(node.num_gpus, node.memory_mb_per_gpu, models,
                                                  unknown_model_mb=unknown_model_mb)
            self._holders[node.pool] = {}
            self._restores[node.pool] = _RestoreBooks()

    # -- introspection ----------------------------------------------------- #

    def cache(self, pool_or_node: str) -> ServiceCache:
        return self._cache[self._pool(pool_or_node)]

    def buddy(self, pool_or_node: str) -> BuddyAllocator:
        return self._buddy[self._pool(pool_or_node)]

    def lease(self, pool: str, holder: str) -> CacheDecision | None:
        """What the executor must do for ``holder`` (evict, restore or nothing)."""
        return self._cache[self._pool(pool)].lease(holder)

    def restored(self, pool: str, holder: str, seconds: float = 0.0) -> None:
        """The executor restored ``holder``'s service; until then it is not resident."""
        pool, seconds = self._pool(pool), max(float(seconds), 0.0)
        if self._cache[pool].restored(holder, seconds):
            self._restores[pool].add(holder in self._warming, seconds)

    def restore_estimate(self, service: str) -> dict[int, float]:
        """Seconds a cache miss of ``service`` costs at each DoP, for the policy.

        The bytes a restore moves at that DoP over the restore bandwidth
        measured so far on these nodes; empty (no charge) until a restore was
        measured or for a model nobody registered.
        """
        seconds = sum(c.stats_.restore_s for c in self._cache.values())
        moved = sum(c.stats_.restored_mb for c in self._cache.values())
        spec = next((c.models[service] for c in self._cache.values() if service in c.models), None)
        if spec is None or not (seconds > 0 and moved > 0):
            return {}
        mb_per_s = moved / seconds
        return {k: spec.mb_per_device(k) * k / mb_per_s for k in SIZES}

    def warm_plan(self, pool: str) -> list[tuple[str, Chunk]]:
        """The instances a warm start loads on ``pool``'s node (:mod:`tangram.managers.gpu_warm`), beside
        what is resident there now."""
        pool = self._pool(pool)
        node, cache = self.nodes[pool], self._cache[pool]
        return warm_plan(node.num_gpus, cache.memory_mb_per_gpu, cache.models.values(),
                         [(i.service, i.chunk) for i in cache.instances()])

    def warm(self, pool: str, holder: str, service: str, chunk: Chunk) -> CacheDecision | None:
        """Take exactly ``chunk`` for ``holder`` to load ``service`` there (a warm start), as an action
        takes one: the executor restores it, :meth:`restored` confirms, :meth:`release` ends it.
        None, taking nothing, where the chunk is not free (a request holds part of it), where best fit
        would take a smaller free chunk elsewhere first (the allocator hands out no other), or where
        the service no longer fits beside what is resident (a request's restore came first): a warm
        load evicts nothing."""
        pool = self._pool(pool)
        cache, buddy = self._cache[pool], self._buddy[pool]
        if holder in self._holders[pool]:
            raise AllocationError(f"{holder} already holds {self._holders[pool][holder]} of {pool}")
        need = cache.mb_per_device(service)
        if cache.is_resident(service, chunk) or any(cache.free_mb(d) < need for d in chunk.devices):
            return None
        if not any(f.start <= chunk.start and chunk.end <= f.end for f in buddy.free_chunks()):
            return None
        got = buddy.allocate(chunk.size, lambda c: c.start <= chunk.start and chunk.end <= c.end)
        if got != chunk:  # best fit took a smaller free chunk elsewhere: give it back, load nothing
            if got is not None:
                buddy.release(got)
            return None
        try:
            decision = cache.begin(holder, service, chunk)
        except BaseException:
            buddy.release(chunk)
            raise
        self._holders[pool][holder] = chunk
        self._warming.add(holder)
        self._restores[pool].warm_begun += 1
        return decision

    def warm_next(self, pool: str, pending: list[tuple[str, Chunk]]
                  ) -> tuple[list[tuple[str, CacheDecision]], list[tuple[str, Chunk]]]:
        """Start every load of ``pending`` (entries of :meth:`warm_plan`, in order) whose chunk is free now:
        ``(holder, decision)`` of each one started (:meth:`warm`), and the entries left for later."""
        started, left = [], []
        for service, chunk in pending:
            holder = f"warm:{pool}:{service}:{chunk.start}"
            decision = self.warm(pool, holder, service, chunk)
            if decision is None:
                left.append((service, chunk))
            else:
                started.append((holder, decision))
        return started, left

    def register_model(self, spec: ModelSpec) -> None:
        for cache in self._cache.values():
            cache.register(spec)

    def stats(self) -> dict:
        """Cache counters summed over nodes, plus each node's own. A warm start's loads are among
        ``misses``, ``restores`` and ``restore_s``; ``warm_loads`` and ``warm_restore_s`` are theirs
        alone, ``request_restores`` and ``request_restore_s`` the requests', ``warming`` the loads under
        way, ``stopping`` the chunks kept for a host that has not stopped a call (``detain``);
        ``hit_rate`` is the requests' own (warm loads left out). Each sum but ``warming`` and ``stopping``
        (counts of now) only grows."""
        per = {}
        for pool, c in self._cache.items():
            books = self._restores[pool]
            per[pool] = {**c.stats(), **books.as_dict(),
                         "warming": sum(1 for h in self._holders[pool] if h in self._warming),
                         "stopping": sum(1 for h in self._holders[pool] if h in self._stopping)}
            per[pool]["hit_rate"] = _rate(per[pool]["hits"], per[pool]["misses"] - books.warm_begun)
        total = {k: 0 for k in ("hits", "misses", "evictions", "restores", "failed_restores", "evicted_mb",
                                "restored_mb", "warm_loads", "request_restores", "warming", "stopping")}
        total.update(restore_s=0.0, warm_restore_s=0.0, request_restore_s=0.0)
        for s in per.values():
            for k in total:
                total[k] += s[k]
        begun = sum(b.warm_begun for b in self._restores.values())
        total["hit_rate"] = _rate(total["hits"], total["misses"] - begun)
        total["nodes"] = per
        return total

    # -- ResourceManager --------------------------------------------------- #

    def pool_states(self) -> Iterable[PoolState]:
        for pool, node in self.nodes.items():
            buddy = self._buddy[pool]
            free = buddy.free_chunks()
            cache = self._cache[pool]
            yield PoolState(
                name=pool, rtype="gpu", node=node.name, capacity=node.num_gpus, free=buddy.free_devices,
                chunks=tuple(c.size for c in free),
                resident=cache.resident_services(),
                idle=_idle_instances(cache, free),
            )

    def allocate(self, pool: str, units: int, holder: str, action: Action | None = None) -> Chunk:
        if pool not in self.nodes:
            raise AllocationError(f"unknown pool {pool!r}")
        if holder in self._holders[pool]:
            raise AllocationError(f"{holder} already holds {self._holders[pool][holder]} of {pool}")
        if units not in SIZES:
            raise AllocationError(f"{pool}: a GPU grant is 1, 2, 4 or 8 devices, got {units!r}")
        cache = self._cache[pool]
        service = service_name(action.service, units) if action is not None and action.service else None
        need = 0
        if service is not None:
            try:
                need = cache.mb_per_device(service)
            except KeyError as e:
                raise AllocationError(f"{pool}: {e.args[0]}") from None
            if need > cache.memory_mb_per_gpu:
                raise AllocationError(f"{pool}: {service} needs {need} MiB per GPU, a GPU has {cache.memory_mb_per_gpu}")
        chunk = self._buddy[pool].allocate(units, self._affinity(cache, service, need))
        if chunk is None:
            raise AllocationError(f"{pool}: no free chunk of {units} GPUs (free: {self._buddy[pool].free_chunks()})")
        try:
            cache.begin(holder, service, chunk)
        except BaseException:
            self._buddy[pool].release(chunk)  # nothing leaks when the books refuse
            raise
        self._holders[pool][holder] = chunk
        return chunk

    def release(self, pool: str, holder: str) -> bool:
        chunk = self._holders.get(pool, {}).pop(holder, None)
        if chunk is None:
            return False
        self._warming.discard(holder)
        self._stopping.discard(holder)
        self._cache[pool].end(holder)
        self._buddy[pool].release(chunk)
        return True

    def detain(self, pool: str, holder: str, chunk: Chunk | None = None) -> str | None:
        """Keep ``holder``'s chunk taken once ``holder`` is done, under a holder of its own (returned) that
        ``release`` frees: its host has not stopped running there yet (a cancel it has not obeyed), and
        the next action on the chunk would find its devices busy. The cache forgets an unconfirmed
        restore as ``end`` does; the chunk is no longer a grant of the engine's (``held``). None:
        ``holder`` holds nothing here (the engine has already released it), or not ``chunk`` (given: the
        one its call ran on)."""
        held = self._holders.get(pool, {}).get(holder)
        if held is None or (chunk is not None and held != chunk):
            return None
        chunk = self._holders[pool].pop(holder)
        self._detained += 1
        key = f"{holder}#stopping-{self._detained}"  # unique: an id run again while its last run still stops
        self._warming.discard(holder)
        cache = self._cache[pool]
        cache.end(holder)
        cache.begin(key, None, chunk)  # a plain hold: nothing of a service counts as resident on it
        self._holders[pool][key] = chunk
        self._stopping.add(key)
        return key

    def check_invariants(self) -> None:
        for pool, node in self.nodes.items():
            buddy, cache, holders = self._buddy[pool], self._cache[pool], self._holders[pool]
            buddy.check()
            cache.check()
            allocated = buddy.allocated()
            if sorted(holders.values()) != allocated:
                raise AssertionError(f"{pool}: holders {holders} vs buddy {allocated}")
            held = sum(c.size for c in holders.values())
            invariant(buddy.free_devices + held == node.num_gpus, f"{pool}: free + allocated != capacity")
            books, counted = self._restores[pool], cache.stats()
            invariant(books.warm_loads + books.request_restores == counted["restores"]
                      and books.warm_loads <= books.warm_begun <= counted["misses"],
                      f"{pool}: restores by source {books} vs the cache's {counted['restores']}")
            busy = cache.busy()
            expect = {d: h for h, c in holders.items() for d in c.devices}
            if busy != expect:
                raise AssertionError(f"{pool}: cache busy devices {busy} vs grants {expect}")

    def held(self) -> Mapping[str, Mapping[str, Any]]:
        """The grants the engine gave (a warm start's loads and the chunks kept for a host that has not
        stopped are the manager's own: not here)."""
        return {p: {h: c for h, c in hs.items() if h not in self._warming and h not in self._stopping}
                for p, hs in self._holders.items()}

    # -- internals --------------------------------------------------------- #

    def _pool(self, pool_or_node: str) -> str:
        return pool_or_node if pool_or_node.startswith("gpu@") else f"gpu@{pool_or_node}"

    @staticmethod
    def _affinity(cache: ServiceCache, service: str | None, need: int):
        """Score a candidate chunk: 2 the service is resident in it, 1 it fits without evicting, 0 else."""
        if service is None:
            return None
        homes = cache.chunks_of(service)

        def score(c: Chunk) -> int:
            if any(h.start < c.end and c.start < h.end for h in homes):
                return 2
            if all(cache.free_mb(d) >= need for d in c.devices):
                return 1
            return 0

        return score


@dataclass(slots=True)
class _RestoreBooks:
    """One node's confirmed restores, by what asked: a request, or the node's warm start (each of whose
    loads begun is a cache miss). Kept apart, not subtracted: a metric read from them never decreases."""

    warm_begun: int = 0
    warm_loads: int = 0
    warm_s: float = 0.0
    request_restores: int = 0
    request_s: float = 0.0

    def add(self, warm: bool, seconds: float) -> None:
        if warm:
            self.warm_loads += 1
            self.warm_s += seconds
        else:
            self.request_restores += 1
            self.request_s += seconds

    def as_dict(self) -> dict:
        return {"warm_loads": self.warm_loads, "warm_restore_s": self.warm_s,
                "request_restores": self.request_restores, "request_restore_s": self.request_s}


def _rate(hits: int, misses: int) -> float | None:
    return hits / (hits + misses) if hits + misses else None


def _idle_instances(cache: ServiceCache, free: list[Chunk]) -> tuple[str, ...]:
    """Services resident on a chunk the buddy allocator would hand out now (one entry per instance).

    Best fit takes the smallest free chunk that holds a request, so an instance
    is reachable only inside a free chunk of that smallest size.
    """
    out = []
    for inst in cache.instances():
        size = inst.chunk.size
        smallest = min((f.size for f in free if f.size >= size), default=None)
        if smallest is not None and any(f.size == smallest and f.start <= inst.chunk.start and inst.chunk.end <= f.end
                                        for f in free):
            out.append(inst.service)
    return tuple(sorted(out))
