"""Evict-on-execution service cache of one GPU node (paper §5.3, DESIGN.md §5).

A *service* is a model at one DoP: ``f"{model}@dop{k}"`` (different DoPs are
different services). An *instance* is a service resident on one chunk. Each
model keeps an immutable copy of its state in (pinned) CPU memory, held by
the executor; this module only keeps the books:

* on ``begin`` (an action got a chunk) the service is a *hit* if an instance
  already sits on exactly that chunk, else a *miss*: least-recently-used
  instances overlapping the chunk are evicted until every device of the chunk
  has memory for the service. Eviction only frees device memory, nothing is
  written back, so it costs nothing but a later restore.
* the executor carries the decision out (evict, restore, run) and reports the
  restore with ``restored``; an unconfirmed restore is dropped on ``end``, so a
  failed or cancelled restore never leaves a half-loaded service on the books.
* at most one action per device at a time: the buddy allocator guarantees
  it; ``begin`` asserts it.

Mechanical bookkeeping only: no policy, no torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from tangram.core.grants import CacheDecision, Chunk, Instance, parse_service, service_name  # noqa: F401 - re-exported


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model's device footprint.

    ``state_mb`` is the size of its state. Replicated (data-parallel, what the
    torch executor does) every device of a DoP-k instance holds all of it;
    ``sharded`` (tensor-parallel) each holds ``ceil(state_mb / k)``.
    ``overhead_mb`` per device covers activations and workspace.
    """

    name: str
    state_mb: int
    sharded: bool = False
    overhead_mb: int = 0

    def __post_init__(self) -> None:
        for f in ("state_mb", "overhead_mb"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{f}: must be a non-negative integer, got {v!r}")
        if not self.name or "@" in self.name:
            raise ValueError(f"name: a non-empty model name without '@', got {self.name!r}")

    def mb_per_device(self, dop: int) -> int:
        share = math.ceil(self.state_mb / dop) if self.sharded else self.state_mb
        return share + self.overhead_mb


@dataclass(slots=True)
class _Lease:
    decision: CacheDecision
    confirmed: bool


@dataclass(slots=True)
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    restores: int = 0  # misses whose restore the executor confirmed
    failed_restores: int = 0  # misses that ended unconfirmed (error, timeout, cancel)
    restore_s: float = 0.0
    evicted_mb: int = 0
    restored_mb: int = 0
    by_service: dict[str, dict[str, int]] = field(default_factory=dict)

    def as_dict(self) -> dict:
        total = self.hits + self.misses
        return {
            "hits": self.hits, "misses": self.misses, "evictions": self.evictions,
            "restores": self.restores, "failed_restores": self.failed_restores,
            "restore_s": self.restore_s, "evicted_mb": self.evicted_mb, "restored_mb": self.restored_mb,
            "hit_rate": (self.hits / total) if total else None,
            "mean_restore_s": (self.restore_s / self.restores) if self.restores else None,
            "by_service": {k: dict(v) for k, v in self.by_service.items()},
        }


class ServiceCache:
    """Residency, LRU order, device memory and exclusivity of one node's GPUs."""

    def __init__(self, num_gpus: int, memory_mb_per_gpu: int, models: Iterable[ModelSpec] = (),
                 *, unknown_model_mb: int | None = 0):
        if isinstance(memory_mb_per_gpu, bool) or not isinstance(memory_mb_per_gpu, int) or memory_mb_per_gpu < 0:
            raise ValueError(f"memory_mb_per_gpu: must be a non-negative integer, got {memory_mb_per_gpu!r}")
        self.num_gpus = num_gpus
        self.memory_mb_per_gpu = memory_mb_per_gpu
        self.models: dict[str, ModelSpec] = {}
        # None: an action naming an unregistered model is a bug; else its footprint
        self.unknown_model_mb = unknown_model_mb
        for m in models:
            self.register(m)
        self._resident: dict[tuple[str, int], Instance] = {}  # (service, chunk start) -> instance
        self._last_use: dict[tuple[str, int], int] = {}  # LRU: a logical clock, not wall time
        self._tick = 0
        self._used_mb = [0] * num_gpus
        self._busy: dict[int, str] = {}  # device -> holder running on it
        self._leases: dict[str, _Lease] = {}
        self.stats_ = CacheStats()

    # -- models ------------------------------------------------------------ #

    def register(self, spec: ModelSpec) -> None:
        """Make ``spec`` known; a model that fits no device even at DoP 8 is refused."""
        smallest = min(spec.mb_per_device(k) for k in (1, 2, 4, 8))
        if smallest > self.memory_mb_per_gpu:
            raise ValueError(
                f"model {spec.name!r} needs {smallest} MiB per GPU at best, a GPU has {self.memory_mb_per_gpu}"
            )
        self.models[spec.name] = spec

    def mb_per_device(self, service: str) -> int:
        model, dop = parse_service(service)
        spec = self.models.get(model)
        if spec is not None:
            return spec.mb_per_device(dop)
        if self.unknown_model_mb is None:
            raise KeyError(f"model {model!r} is not registered with the GPU manager")
        return self.unknown_model_mb

    def fits(self, service: str) -> bool:
        """Whether the service can ever be resident on this node (device memory alone)."""
        return self.mb_per_device(service) <= self.memory_mb_per_gpu

    # -- queries ----------------------------------------------------------- #

    def resident_services(self) -> frozenset[str]:
        return frozenset(s for s, _ in self._resident)

    def instances(self) -> list[Instance]:
        """Resident instances, least recently used first."""
        return [self._resident[k] for k in sorted(self._resident, key=self._last_use.__getitem__)]

    def chunks_of(self, service: str) -> list[Chunk]:
        return [inst.chunk for (s, _), inst in self._resident.items() if s == service]

    def is_resident(self, service: str, chunk: Chunk) -> bool:
        return (service, chunk.start) in self._resident and self._resident[(service, chunk.start)].chunk == chunk

    def free_mb(self, device: int) -> int:
        return self.memory_mb_per_gpu - self._used_mb[device]

    def busy(self) -> Mapping[int, str]:
        return dict(self._busy)

    def lease(self, holder: str) -> CacheDecision | None:
        lease = self._leases.get(holder)
        return None if lease is None else lease.decision

    def stats(self) -> dict:
        return self.stats_.as_dict()

    # -- the EOE protocol -------------------------------------------------- #

    def begin(self, holder: str, service: str | None, chunk: Chunk) -> CacheDecision:
        """``holder`` runs on ``chunk`` now: decide hit or miss and the evictions."""
        if holder in self._leases:
            raise ValueError(f"{holder} already holds devices {self._leases[holder].decision.chunk}")
        if chunk.end > self.num_gpus:  # on every begin: the message is built only when it fails
            raise AssertionError(f"chunk {chunk} past {self.num_gpus} GPUs")
        clash = {d: self._busy[d] for d in chunk.devices if d in self._busy}
        if clash:
            raise AssertionError(f"one action per GPU: {holder} on {chunk} clashes with {clash}")
        if service is None:  # a plain GPU action: exclusive devices, nothing cached
            decision = CacheDecision(holder, None, chunk, hit=True)
            self._take(holder, decision, confirmed=True)
            return decision
        if parse_service(service)[1] != chunk.size:  # a DoP-k service runs on exactly k devices
            raise ValueError(f"{service} cannot run on {chunk.size} devices ({chunk})")
        self._tick += 1
        key = (service, chunk.start)
        per = self.stats_.by_service.setdefault(service, {"hits": 0, "misses": 0, "evictions": 0})
        if key in self._resident and self._resident[key].chunk == chunk:
            self._last_use[key] = self._tick
            self.stats_.hits += 1
            per["hits"] += 1
            decision = CacheDecision(holder, service, chunk, hit=True)
            self._take(holder, decision, confirmed=True)
            return decision
        need = self.mb_per_device(service)
        if need > self.memory_mb_per_gpu:
            raise ValueError(f"{service} needs {need} MiB per GPU, a GPU has {self.memory_mb_per_gpu}")
        evicted = self._evict_for(chunk, need)
        inst = Instance(service, chunk, need)
        self._resident[key] = inst
        self._last_use[key] = self._tick
        for d in chunk.devices:
            self._used_mb[d] += need
        self.stats_.misses += 1
        per["misses"] += 1
        decision = CacheDecision(holder, service, chunk, hit=False, evict=tuple(evicted), restore_mb_per_device=need)
        self._take(holder, decision, confirmed=False)
        self._check()
        return decision

    def restored(self, holder: str, seconds: float = 0.0) -> bool:
        """The executor finished restoring ``holder``'s service; count the time. False where there was
        nothing to confirm (no lease, or confirmed already)."""
        lease = self._leases.get(holder)
        if lease is None or lease.confirmed:
            return False
        lease.confirmed = True
        d = lease.decision
        self.stats_.restores += 1
        self.stats_.restore_s += max(float(seconds), 0.0)
        self.stats_.restored_mb += d.restore_mb_per_device * d.chunk.size
        return True

    def end(self, holder: str) -> bool:
        """``holder`` is done; an unconfirmed restore is forgotten. Idempotent."""
        lease = self._leases.pop(holder, None)
        if lease is None:
            return False
        d = lease.decision
        for dev in d.chunk.devices:
            if self._busy.get(dev) != holder:
                raise AssertionError(f"device {dev} not held by {holder}")
            del self._busy[dev]
        if not lease.confirmed and d.service is not None:
            # the restore failed, timed out or was cancelled: whatever reached the
            # devices is garbage the executor drops; do not count it as resident
            self._drop((d.service, d.chunk.start))
            self.stats_.failed_restores += 1
        self._check()
        return True

    def forget(self, service: str, chunk: Chunk) -> bool:
        """The executor lost an instance (e.g. device reset): drop it from the books."""
        key = (service, chunk.start)
        if key not in self._resident or self._in_use(self._resident[key]):
            return False
        self._drop(key)
        return True

    # -- internals --------------------------------------------------------- #

    def _take(self, holder: str, decision: CacheDecision, confirmed: bool) -> None:
        for d in decision.chunk.devices:
            self._busy[d] = holder
        self._leases[holder] = _Lease(decision, confirmed)

    def _evict_for(self, chunk: Chunk, need: int) -> list[Instance]:
        short = {d for d in chunk.devices if self.free_mb(d) < need}
        evicted: list[Instance] = []
        if not short:
            return evicted
        overlapping = [k for k, inst in self._resident.items()
                       if inst.chunk.start < chunk.end and chunk.start < inst.chunk.end]
        for key in sorted(overlapping, key=self._last_use.__getitem__):  # least recently used first
            inst = self._resident[key]
            if not short.intersection(inst.chunk.devices):
                continue  # evicting it would free nothing where memory is short
            # An instance overlapping our chunk cannot be in use: running it needs its
            # whole chunk, and part of that is exclusively ours. (A larger instance may
            # still span devices where *other* services run; dropping its copy there
            # only frees memory they are not using.)
            if self._in_use(inst):
                raise AssertionError(f"evicting {inst} while it runs")
            self._drop(key)
            evicted.append(inst)
            self.stats_.evictions += 1
            self.stats_.evicted_mb += inst.mb_per_device * inst.chunk.size
            self.stats_.by_service.setdefault(inst.service, {"hits": 0, "misses": 0, "evictions": 0})["evictions"] += 1
            short = {d for d in short if self.free_mb(d) < need}
            if not short:
                break
        if short:
            raise AssertionError(f"cannot free {need} MiB on devices {sorted(short)} of {chunk}")
        return evicted

    def _in_use(self, inst: Instance) -> bool:
        return any(l.decision.service == inst.service and l.decision.chunk == inst.chunk
                   for l in self._leases.values())

    def _drop(self, key: tuple[str, int]) -> None:
        inst = self._resident.pop(key, None)
        self._last_use.pop(key, None)
        if inst is not None:
            for d in inst.chunk.devices:
                self._used_mb[d] -= inst.mb_per_device

    def check(self) -> None:
        self._check()

    def _check(self) -> None:
        used = [0] * self.num_gpus
        for (service, start), inst in self._resident.items():
            if inst.chunk.start != start or inst.service != service:
                raise AssertionError(f"resident key ({service}, {start}) names {inst}")
            for d in inst.chunk.devices:
                used[d] += inst.mb_per_device
        if used != self._used_mb:
            raise AssertionError(f"device memory books disagree: {used} != {self._used_mb}")
        if not all(0 <= u <= self.memory_mb_per_gpu for u in used):
            raise AssertionError(f"over capacity: {used}")
        holders = {h for h in self._busy.values()}
        if holders != set(self._leases):
            raise AssertionError(f"busy devices {self._busy} vs leases {sorted(self._leases)}")
