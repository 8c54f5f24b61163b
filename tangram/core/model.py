"""The action model (paper §4.1, DESIGN.md §3).

An *action* is one atomic external call. It demands, for every resource type
it uses, a set of feasible unit counts; at most one type (the *key elastic
resource*) offers more than one count. Its duration on ``m`` units of the key
resource is ``T1 / (E(m) * m)`` where ``T1`` is the single-unit duration and
``0 < E(m) <= 1`` the parallel efficiency.

Resource types are plain strings: ``cpu`` (cores), ``mem`` (MiB, reserved per
trajectory), ``gpu`` (devices, in buddy chunks) and ``api:<name>`` (slots).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterable, Mapping

import numpy as np

from tangram.core.errors import DemandError

GPU_DOPS = (1, 2, 4, 8)
NODE_LOCAL_TYPES = frozenset({"cpu", "mem", "gpu"})
PARALLEL_NUM = "${parallel_num}"


def is_api_type(rtype: str) -> bool:
    return rtype.startswith("api:") and len(rtype) > 4


def _check_type(rtype: str, field_name: str) -> None:
    if rtype not in NODE_LOCAL_TYPES and not is_api_type(rtype):
        raise DemandError(field_name, f"unknown resource type {rtype!r} (expected cpu, mem, gpu or api:<name>)")


# Largest unit count a demand may name: far above any node (the engine caps a
# range to the largest pool at submit), and still an int32 wherever numpy sees it
MAX_UNITS = (1 << 31) - 1
# Longest explicit list of feasible counts (a range needs no list)
MAX_CHOICES = 256


def _check_count(v: Any, field: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise DemandError(field, f"must be an integer, got {v!r}")
    if v < 1:
        raise DemandError(field, f"must be >= 1, got {v}")
    if v > MAX_UNITS:
        raise DemandError(field, f"must be <= {MAX_UNITS}, got {v}")
    return v


@dataclass(frozen=True, slots=True)
class Demand:
    """Feasible unit counts of one resource type: every count in ``[lo, hi]``
    (``picks`` None) or the listed ``picks`` (sorted, within ``[lo, hi]``).

    A range is never materialised: ``{"min": 1, "max": 1000000}`` costs three
    integers. :attr:`options` lists the counts; the engine caps a demand to
    the largest pool that could host it (:meth:`capped`) before the policy
    ever asks for them.
    """

    lo: int
    hi: int
    picks: tuple[int, ...] | None = None

    @classmethod
    def fixed(cls, n: int, *, field: str = "demand") -> "Demand":
        return cls.choices((n,), field=field)

    @classmethod
    def range(cls, lo: int, hi: int, *, field: str = "demand") -> "Demand":
        for name, v in (("min", lo), ("max", hi)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise DemandError(f"{field}.{name}", f"must be an integer, got {v!r}")
        if lo < 1:
            raise DemandError(f"{field}.min", f"must be >= 1, got {lo}")
        if hi < lo:
            raise DemandError(f"{field}.max", f"must be >= min ({lo}), got {hi}")
        _check_count(lo, f"{field}.min")
        _check_count(hi, f"{field}.max")
        return cls(lo, hi)

    @classmethod
    def choices(cls, values: Iterable[int], *, field: str = "demand") -> "Demand":
        vals = set()
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int):
                raise DemandError(field, f"unit counts must be integers, got {v!r}")
            if v < 1:
                raise DemandError(field, f"unit counts must be >= 1, got {v}")
            if v > MAX_UNITS:
                raise DemandError(field, f"unit counts must be <= {MAX_UNITS}, got {v}")
            vals.add(v)
            if len(vals) > MAX_CHOICES:
                raise DemandError(field, f"at most {MAX_CHOICES} feasible unit counts (use a {{min, max}} range)")
        if not vals:
            raise DemandError(field, "the set of feasible unit counts is empty")
        picks = tuple(sorted(vals))
        return cls(picks[0], picks[-1], None if len(picks) == 1 else picks)

    @property
    def options(self) -> tuple[int, ...]:
        """Every feasible count, ascending (``hi - lo + 1`` of them for a range: cap it first)."""
        if self.picks is not None:
            return self.picks
        return tuple(range(self.lo, self.hi + 1))

    @property
    def min(self) -> int:
        return self.lo

    @property
    def max(self) -> int:
        return self.hi

    @property
    def elastic(self) -> bool:
        return self.hi > self.lo

    def __len__(self) -> int:
        return len(self.picks) if self.picks is not None else self.hi - self.lo + 1

    def __contains__(self, n: object) -> bool:
        if self.picks is not None:
            return n in self.picks
        return isinstance(n, int) and self.lo <= n <= self.hi

    def capped(self, cap: int) -> "Demand | None":
        """The options that fit in ``cap`` units, or None if none does (O(1) for a range)."""
        if cap < self.lo:
            return None
        if cap >= self.hi:
            return self
        if self.picks is None:
            return Demand(self.lo, cap)
        kept = tuple(o for o in self.picks if o <= cap)
        return Demand(kept[0], kept[-1], kept if len(kept) > 1 else None)


@dataclass(frozen=True, slots=True)
class Elasticity:
    """Parallel efficiency ``E(m)`` as a table or as Amdahl's law.

    A table gives E for listed DoPs; between listed points the *speedup*
    ``E(m) * m`` is interpolated linearly, and past the last point the
    speedup stays flat (adding units never helps beyond what was measured).
    """

    table: tuple[tuple[int, float], ...] = ()
    serial_fraction: float | None = None

    @classmethod
    def amdahl(cls, serial_fraction: float, *, field: str = "elasticity.serial_fraction") -> "Elasticity":
        s = float(serial_fraction)
        if not (0.0 <= s <= 1.0) or math.isnan(s):
            raise DemandError(field, f"must be within [0, 1], got {serial_fraction!r}")
        return cls(serial_fraction=s)

    @classmethod
    def linear(cls) -> "Elasticity":
        return cls(serial_fraction=0.0)

    @classmethod
    def from_table(cls, table: Mapping[int | str, float], *, field: str = "elasticity") -> "Elasticity":
        items = []
        for k, v in table.items():
            try:
                m = int(k)
            except (TypeError, ValueError):
                raise DemandError(f"{field}[{k!r}]", "DoP keys must be integers") from None
            if m < 1:
                raise DemandError(f"{field}[{k!r}]", "DoP keys must be >= 1")
            e = float(v)
            if not (0.0 < e <= 1.0):
                raise DemandError(f"{field}[{m}]", f"E(m) must be within (0, 1], got {v!r}")
            items.append((m, e))
        if not items:
            raise DemandError(field, "the table is empty")
        items.sort()
        if items[0][0] != 1:
            items.insert(0, (1, 1.0))
        return cls(table=tuple(items))

    def efficiency(self, m: int) -> float:
        if m < 1:
            raise ValueError(f"DoP must be >= 1, got {m}")
        if self.serial_fraction is not None:
            s = self.serial_fraction
            return 1.0 / (m * (s + (1.0 - s) / m))
        return self._speedup_from_table(m) / m

    def _speedup_from_table(self, m: int) -> float:
        pts = self.table
        prev_m, prev_e = pts[0]
        if m <= prev_m:
            return prev_e * prev_m
        for pm, pe in pts[1:]:
            if m == pm:
                return pe * pm
            if m < pm:
                lo, hi = prev_e * prev_m, pe * pm
                return lo + (hi - lo) * (m - prev_m) / (pm - prev_m)
            prev_m, prev_e = pm, pe
        return prev_e * prev_m  # flat speedup past the last measured DoP

    def duration(self, t1: float, m: int) -> float:
        """``T(m) = T1 / (E(m) * m)``."""
        return t1 / (self.efficiency(m) * m)

    def durations(self, t1: float, ms: "np.ndarray") -> "np.ndarray":
        """:meth:`duration` for an array of DoPs at once (the policy's hot path)."""
        ms = np.asarray(ms, dtype=np.float64)
        if self.serial_fraction is not None:
            s = self.serial_fraction
            return t1 * (s + (1.0 - s) / ms)
        pm = np.array([m for m, _ in self.table], dtype=np.float64)
        speed = np.array([m * e for m, e in self.table], dtype=np.float64)
        return t1 / np.interp(ms, pm, speed)  # flat past both ends, as efficiency()

    def as_dict(self) -> dict:
        if self.serial_fraction is not None:
            return {"amdahl": self.serial_fraction}
        return {"table": {str(m): e for m, e in self.table}}


@dataclass(frozen=True, slots=True)
class Profile:
    """What offline profiling knows of an action class."""

    t1_s: float
    elasticity: Elasticity | None = None
    max_dop: int | None = None

    def __post_init__(self) -> None:
        if not (self.t1_s > 0) or math.isinf(self.t1_s):
            raise DemandError("profile.t1_s", f"must be a positive finite duration, got {self.t1_s!r}")


_EMPTY: Mapping[str, Any] = MappingProxyType({})


class _WeakReferable:
    """A slot for weak references (``dataclass(weakref_slot=True)`` is Python 3.11+): what other
    layers derive from a frozen action and keep (the policy's memos) goes when the action does."""

    __slots__ = ("__weakref__",)


@dataclass(frozen=True, slots=True, eq=False)
class Action(_WeakReferable):
    """One validated action. Build it with :meth:`Action.build`.

    ``demands`` maps resource type to :class:`Demand`; ``key`` is the single
    type with more than one option, if any. ``t1_s`` and ``elasticity`` come
    from a profile; without them the action is non-scalable and gets its
    minimum, and its duration is estimated from its class's running average
    (an elastic one gets them from its class's runs once one has ended:
    ``tangram.core.estimator``).
    ``mem_mb`` is the memory its trajectory reserves on the node that hosts
    it (held until the trajectory ends).
    """

    id: str
    demands: Mapping[str, Demand]
    key: str | None
    action_class: str = "default"
    trajectory: str | None = None
    t1_s: float | None = None
    elasticity: Elasticity | None = None
    mem_mb: int = 0
    timeout_s: float | None = None
    service: str | None = None
    payload: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    # GPU actions: seconds to restore the service's state onto a chunk of m
    # devices on a cache miss (evict-on-execution); the policy adds it to the
    # duration of a DoP whose service is not resident
    restore_s: Mapping[int, float] = field(default_factory=lambda: _EMPTY)
    # its run may be stopped and started again from the start at another DoP (a reward that reads its
    # environment and changes nothing a second run depends on, such as a test suite): the engine
    # restarts a straggler at a wider DoP once units are idle (tangram.policy.restart)
    restartable: bool = False

    @classmethod
    def build(
        cls,
        id: str,
        demands: Mapping[str, Demand | int | Iterable[int] | Mapping[str, int]],
        *,
        action_class: str = "default",
        trajectory: str | None = None,
        profile: Profile | None = None,
        t1_s: float | None = None,
        elasticity: Elasticity | None = None,
        mem_mb: int = 0,
        timeout_s: float | None = None,
        service: str | None = None,
        payload: Mapping[str, Any] | None = None,
        restore_s: Mapping[int, float] | None = None,
        restartable: bool = False,
    ) -> "Action":
        if not isinstance(id, str) or not id:
            raise DemandError("id", "must be a non-empty string")
        parsed: dict[str, Demand] = {}
        for rtype, raw in demands.items():
            fname = f"resources.{rtype}"
            _check_type(rtype, fname)
            d = parse_demand(raw, field=fname)
            if rtype == "gpu":
                bad = [o for o in d.options if o not in GPU_DOPS] if d.max <= GPU_DOPS[-1] else [d.max]
                if bad:
                    raise DemandError(fname, f"GPU DoP must be one of {{1, 2, 4, 8}}, got {bad[0]}")
            parsed[rtype] = d
        if not parsed:
            raise DemandError("resources", "an action must demand at least one resource type")
        if "mem" in parsed:
            raise DemandError("resources.mem", "memory is reserved per trajectory: use mem_mb")
        elastic = [t for t, d in parsed.items() if d.elastic]
        if len(elastic) > 1:
            raise DemandError("resources", f"at most one key elastic resource, got {sorted(elastic)}")
        if profile is not None:
            t1_s = profile.t1_s if t1_s is None else t1_s
            elasticity = profile.elasticity if elasticity is None else elasticity
            if profile.max_dop is not None and elastic:
                capped = parsed[elastic[0]].capped(profile.max_dop)
                if capped is not None:
                    parsed[elastic[0]] = capped
                    elastic = [t for t, d in parsed.items() if d.elastic]
        if t1_s is not None:
            t1_s = float(t1_s)
            if not (t1_s > 0) or math.isinf(t1_s):
                raise DemandError("t1_s", f"duration must be positive and finite, got {t1_s!r}")
        if isinstance(mem_mb, bool) or not isinstance(mem_mb, int) or mem_mb < 0:
            raise DemandError("mem_mb", f"must be a non-negative integer, got {mem_mb!r}")
        if timeout_s is not None and not (float(timeout_s) > 0):
            raise DemandError("timeout_s", f"must be positive, got {timeout_s!r}")
        if elasticity is not None and elastic:
            d = parsed[elastic[0]]
            # E is piecewise between the table's points: checking the ends and those points checks all
            probe = {d.min, d.max, *(m for m, _ in elasticity.table if m in d)}
            for m in sorted(probe):
                e = elasticity.efficiency(m)
                if not (0.0 < e <= 1.0 + 1e-9):
                    raise DemandError("elasticity", f"E({m}) must be within (0, 1], got {e!r}")
                # the speedup E(m)*m is piecewise linear between these points: the slowest is one of them
                if t1_s is not None and math.isinf(elasticity.duration(t1_s, m)):
                    raise DemandError("t1_s", f"T({m}) = t1_s / (E({m}) * {m}) overflows: {t1_s!r} is too long")
        if not isinstance(restartable, bool):
            raise DemandError("restartable", f"must be true or false, got {restartable!r}")
        restore: dict[int, float] = {}
        for m, sec in (restore_s or {}).items():
            sec = float(sec)
            if not (sec >= 0) or math.isinf(sec):
                raise DemandError(f"restore_s[{m}]", f"must be a non-negative finite duration, got {sec!r}")
            restore[int(m)] = sec
        return cls(
            id=id,
            demands=MappingProxyType(parsed),
            key=elastic[0] if elastic else None,
            action_class=action_class,
            trajectory=trajectory,
            t1_s=t1_s,
            elasticity=elasticity,
            mem_mb=mem_mb,
            timeout_s=None if timeout_s is None else float(timeout_s),
            service=service,
            # most actions have neither: one shared empty view (two fewer objects per queued action to
            # allocate and for every full garbage collection to scan)
            payload=MappingProxyType(dict(payload)) if payload else _EMPTY,
            restore_s=MappingProxyType(restore) if restore else _EMPTY,
            restartable=restartable,
        )

    @property
    def scalable(self) -> bool:
        """Elastic with a known model: the scheduler may choose its DoP."""
        return self.key is not None and self.t1_s is not None and self.elasticity is not None

    def duration(self, units: int) -> float | None:
        """Estimated duration on ``units`` of the key resource, if known."""
        if self.t1_s is None:
            return None
        if self.elasticity is None:
            return self.t1_s
        return self.elasticity.duration(self.t1_s, units)

    def min_units(self, rtype: str) -> int:
        d = self.demands.get(rtype)
        return d.min if d else 0


def parse_demand(raw: Any, *, field: str) -> Demand:
    """Accept ``4``, ``{"min": 1, "max": 8}``, ``[1, 2, 4]`` or a Demand."""
    if isinstance(raw, Demand):
        return raw
    if isinstance(raw, bool):
        raise DemandError(field, f"expected an integer, a {{min, max}} range or a list, got {raw!r}")
    if isinstance(raw, int):
        return Demand.fixed(raw, field=field)
    if isinstance(raw, Mapping):
        unknown = set(raw) - {"min", "max"}
        if unknown:
            raise DemandError(field, f"unknown keys {sorted(unknown)} (expected min and max)")
        if "min" not in raw:
            raise DemandError(f"{field}.min", "is required in a range")
        lo = raw["min"]
        return Demand.range(lo, raw.get("max", lo), field=field)
    if isinstance(raw, (list, tuple, set, frozenset)):
        return Demand.choices(raw, field=field)
    raise DemandError(field, f"expected an integer, a {{min, max}} range or a list, got {type(raw).__name__}")


def render_command(command: str, dop: int) -> str:
    """Substitute the allocated DoP for ``${parallel_num}``.

    A plain replace, not ``string.Template``: the rest of a shell command
    (``$$``, ``$HOME``) must survive byte for byte.
    """
    return command.replace(PARALLEL_NUM, str(int(dop)))
