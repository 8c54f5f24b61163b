"""Basic manager: concurrency and quota limits of API pools (DESIGN.md §5).

Each pool ``api:<name>`` may have

* a **concurrency** limit: at most ``concurrency`` units in flight; a unit is
  taken at grant and given back at release (the call returned);
* a **quota**: at most ``quota`` units granted per ``period_s``. A granted
  unit stays *consumed* after release until its window has passed, so
  release never gives quota back. Two window kinds:

  - ``sliding`` (default): any interval of length ``period_s`` contains at
    most ``quota`` grants; a unit granted at ``t`` is usable again at
    ``t + period_s``. This is the stricter kind: it also satisfies a server
    that counts in fixed windows (and one that counts sliding windows, up to
    network jitter: give the manager a ``period_s`` slightly longer than the
    server's).
  - ``fixed``: windows ``[origin + k*period, origin + (k+1)*period)``; the
    whole quota refills at each boundary (``origin`` is the manager's
    creation time on its clock).

The policy sees each pool's ``free = min(concurrency free, quota left)``
and ``capacity = min(concurrency, quota)`` (the most it can ever grant at
once); :meth:`BasicManager.next_wakeup` says when consumed quota comes back,
so the engine waits for capacity instead of letting a call fail with a 429.

Books (checked by :meth:`check_invariants`): ``slots_free + in_flight ==
concurrency`` and ``quota_left + consumed_in_window == quota``.

The clock is injected (``time.monotonic`` by default) so the simulator can
drive the very same manager with a virtual clock.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from tangram.core.model import Action
from tangram.managers.base import AllocationError, ResourceManager
from tangram.policy.snapshot import PoolState

SLIDING, FIXED = "sliding", "fixed"


@dataclass(frozen=True, slots=True)
class ApiLimit:
    """Limits of one API pool; at least one of ``concurrency`` and ``quota``."""

    concurrency: int | None = None
    quota: int | None = None
    period_s: float | None = None
    window: str = SLIDING

    def validate(self, field: str) -> None:
        for name in ("concurrency", "quota"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{field}.{name}: must be a positive integer, got {v!r}")
        if self.concurrency is None and self.quota is None:
            raise ValueError(f"{field}: needs a concurrency limit, a quota, or both")
        if self.quota is not None:
            p = self.period_s
            if p is None or isinstance(p, bool) or not isinstance(p, (int, float)) or not (p > 0) or math.isinf(p):
                raise ValueError(f"{field}.period_s: a quota needs a positive finite period, got {p!r}")
        elif self.period_s is not None:
            raise ValueError(f"{field}.period_s: given without a quota")
        if self.window not in (SLIDING, FIXED):
            raise ValueError(f"{field}.window: must be 'sliding' or 'fixed', got {self.window!r}")

    @classmethod
    def parse(cls, raw: "ApiLimit | Mapping[str, Any]", field: str) -> "ApiLimit":
        if isinstance(raw, ApiLimit):
            lim = raw
        elif isinstance(raw, Mapping):
            unknown = set(raw) - {"concurrency", "quota", "period_s", "window"}
            if unknown:
                raise ValueError(f"{field}: unknown keys {sorted(unknown)} "
                                 "(expected concurrency, quota, period_s, window)")
            lim = cls(**raw)
        else:
            raise ValueError(f"{field}: expected an ApiLimit or a mapping, got {type(raw).__name__}")
        lim.validate(field)
        return lim


class _Pool:
    """Books of one API pool."""

    __slots__ = ("name", "limit", "holders", "in_flight", "grants", "consumed", "window_start")

    def __init__(self, name: str, limit: ApiLimit, origin: float):
        self.name = name
        self.limit = limit
        self.holders: dict[str, int] = {}
        self.in_flight = 0
        self.grants: deque[tuple[float, int]] = deque()  # sliding: (granted at, units)
        self.consumed = 0  # quota units consumed in the current window
        self.window_start = origin  # fixed windows only

    @property
    def capacity(self) -> int:
        caps = [c for c in (self.limit.concurrency, self.limit.quota) if c is not None]
        return min(caps)

    def refresh(self, now: float) -> None:
        """Return to the quota what has left its window by ``now``."""
        lim = self.limit
        if lim.quota is None:
            return
        period = float(lim.period_s)
        if lim.window == SLIDING:
            while self.grants and self.grants[0][0] + period <= now:
                self.consumed -= self.grants.popleft()[1]
        elif now >= self.window_start + period:
            self.window_start += math.floor((now - self.window_start) / period) * period
            self.consumed = 0

    def quota_left(self) -> int | None:
        return None if self.limit.quota is None else self.limit.quota - self.consumed

    def slots_free(self) -> int | None:
        return None if self.limit.concurrency is None else self.limit.concurrency - self.in_flight

    def free(self) -> int:
        vals = [v for v in (self.slots_free(), self.quota_left()) if v is not None]
        return max(min(vals), 0)

    def refill_at(self) -> float | None:
        """When consumed quota next comes back (None if nothing is consumed)."""
        if self.limit.quota is None or self.consumed == 0:
            return None
        period = float(self.limit.period_s)
        if self.limit.window == SLIDING:
            return self.grants[0][0] + period
        return self.window_start + period


class BasicManager(ResourceManager):
    """Concurrency slots and quotas of ``api:<name>`` pools (no policy: it only counts)."""

    def __init__(self, limits: Mapping[str, ApiLimit | Mapping[str, Any]], *,
                 clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        origin = clock()
        self._pools: dict[str, _Pool] = {}
        for key, raw in limits.items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"limits: pool names must be non-empty strings, got {key!r}")
            name = key if key.startswith("api:") else f"api:{key}"
            if len(name) <= 4:
                raise ValueError(f"limits[{key!r}]: empty API name")
            if name in self._pools:
                raise ValueError(f"limits[{key!r}]: pool {name!r} configured twice")
            self._pools[name] = _Pool(name, ApiLimit.parse(raw, f"limits[{key!r}]"), origin)

    # ------------------------------------------------------------------ #

    def _pool(self, pool: str) -> _Pool:
        p = self._pools.get(pool)
        if p is None:
            raise AllocationError(f"unknown pool {pool!r} (this manager owns {sorted(self._pools)})")
        return p

    def pool_states(self) -> Iterable[PoolState]:
        now = self.clock()
        for p in self._pools.values():
            p.refresh(now)
            yield PoolState(name=p.name, rtype=p.name, node=None, capacity=p.capacity, free=p.free())

    def allocate(self, pool: str, units: int, holder: str, action: Action | None = None) -> int:
        p = self._pool(pool)
        if isinstance(units, bool) or not isinstance(units, int) or units < 1:
            raise AllocationError(f"{pool}: units must be a positive integer, got {units!r}")
        if holder in p.holders:
            raise AllocationError(f"{pool}: {holder!r} already holds {p.holders[holder]} units")
        now = self.clock()
        p.refresh(now)
        free = p.free()
        if units > free:
            raise AllocationError(f"{pool}: {units} units requested, {free} free "
                                  f"(slots free {p.slots_free()}, quota left {p.quota_left()})")
        p.holders[holder] = units
        p.in_flight += units
        if p.limit.quota is not None:
            p.consumed += units
            if p.limit.window == SLIDING:
                p.grants.append((now, units))
        return units

    def release(self, pool: str, holder: str) -> bool:
        p = self._pools.get(pool)
        if p is None:
            return False
        units = p.holders.pop(holder, None)
        if units is None:
            return False
        p.in_flight -= units  # quota stays consumed until its window passes
        return True

    def next_wakeup(self, now: float) -> float | None:
        times = []
        for p in self._pools.values():
            p.refresh(now)
            t = p.refill_at()
            if t is not None:
                times.append(t)
        return min(times) if times else None

    def check_invariants(self) -> None:
        for p in self._pools.values():
            held = sum(p.holders.values())
            assert held == p.in_flight, f"{p.name}: holders have {held}, books say {p.in_flight} in flight"
            lim = p.limit
            if lim.concurrency is not None:
                assert p.slots_free() + p.in_flight == lim.concurrency, f"{p.name}: concurrency books"
                assert 0 <= p.in_flight <= lim.concurrency, f"{p.name}: {p.in_flight} in flight of {lim.concurrency}"
            if lim.quota is not None:
                assert 0 <= p.consumed <= lim.quota, f"{p.name}: consumed {p.consumed} of quota {lim.quota}"
                assert p.quota_left() + p.consumed == lim.quota, f"{p.name}: quota books"
                if lim.window == SLIDING:
                    assert sum(u for _, u in p.grants) == p.consumed, f"{p.name}: window grants disagree"

    def held(self) -> Mapping[str, Mapping[str, Any]]:
        return {name: dict(p.holders) for name, p in self._pools.items()}

    def limits(self) -> Mapping[str, ApiLimit]:
        return {name: p.limit for name, p in self._pools.items()}
